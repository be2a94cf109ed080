"""hf2q: HuggingFace → GGUF / mlx-lm converter and an OpenAI-compatible server for GGUFs."""

__version__ = "0.1.0"

#: Bumped whenever an on-disk format we write (reports, receipts, KV blocks) changes meaning.
FORMAT_VERSION = 1
