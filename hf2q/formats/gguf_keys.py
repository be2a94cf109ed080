"""GGUF metadata key names: the PyPI ``gguf`` package's ``gguf.Keys``, plus the few it lacks.

Every key hf2q reads or writes is named through ``gguf.Keys`` (``Keys.LLM.BLOCK_COUNT`` is
``"{arch}.block_count"``) or through :class:`ExtraKeys` below, never as a literal string, so a
misspelt key is an ``AttributeError`` at import time instead of a silently missing value.
"""

from __future__ import annotations

from gguf import Keys

__all__ = ["ExtraKeys", "ExtraTensors", "Keys", "arch_key"]


class ExtraKeys:
    """Keys the PyPI ``gguf`` package does not define."""

    #: BERT vocabularies: the id of ``[CLS]`` (llama.cpp's ``LLM_KV_TOKENIZER_CLS_ID``)
    CLS_ID = "tokenizer.ggml.cls_token_id"
    #: hf2q's WordPiece normaliser flags, written by ``sources.tokenizer_meta`` for BERT vocabularies
    NORMALIZER_LOWERCASE = "tokenizer.ggml.normalizer.lowercase"
    NORMALIZER_STRIP_ACCENTS = "tokenizer.ggml.normalizer.strip_accents"
    #: hybrid recurrent models (qwen35, qwen3next): one flag per block, True for a recurrent
    #: (linear-attention) layer (llama.cpp's ``LLM_KV_ATTENTION_RECURRENT_LAYERS``)
    RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
    #: DeepSeek-V4 (``deepseek4``, llama.cpp's ``LLM_KV_*`` of the same names): per-layer compression
    #: ratio (0 sliding window only, 4 compressed sparse, 128 heavily compressed), the compressed
    #: branches' RoPE base, the grouped output projection, hash-routed layers, hyper-connections
    COMPRESS_RATIOS = "{arch}.attention.compress_ratios"
    COMPRESS_ROPE_FREQ_BASE = "{arch}.attention.compress_rope_freq_base"
    OUTPUT_GROUP_COUNT = "{arch}.attention.output_group_count"
    OUTPUT_LORA_RANK = "{arch}.attention.output_lora_rank"
    HASH_LAYER_COUNT = "{arch}.hash_layer_count"
    HYPER_CONNECTION_COUNT = "{arch}.hyper_connection.count"
    HYPER_CONNECTION_SINKHORN_ITERATIONS = "{arch}.hyper_connection.sinkhorn_iterations"
    HYPER_CONNECTION_EPSILON = "{arch}.hyper_connection.epsilon"
    #: ``[rank, size]`` on the per-rank view of a tensor-parallel shard (never written to a file)
    TENSOR_PARALLEL = "hf2q.tensor_parallel"
    #: the parser's own entries (not file keys): the container version and counts
    GGUF_VERSION = "GGUF.version"
    GGUF_TENSOR_COUNT = "GGUF.tensor_count"
    GGUF_KV_COUNT = "GGUF.kv_count"


class ExtraTensors:
    """Tensor names llama.cpp writes that the PyPI ``gguf`` package's ``TENSOR_NAMES`` does not spell out.

    Gemma 4's MoE scales ride on the router and expert tensors under a ``.scale`` suffix instead of
    ``.weight`` (llama.cpp's converter forms them from ``FFN_GATE_INP`` / ``FFN_DOWN_EXP`` + ``.scale``).
    """

    #: per-channel scale of the router's input (Gemma 4 ``router.scale``)
    FFN_GATE_INP_SCALE = "blk.{bid}.ffn_gate_inp.scale"
    #: per-expert multiplier of each expert's output (Gemma 4 ``router.per_expert_scale``)
    FFN_DOWN_EXPS_SCALE = "blk.{bid}.ffn_down_exps.scale"


def arch_key(template: str, arch: str) -> str:
    """``template`` (a ``gguf.Keys`` name, possibly ``"{arch}.…"``) for the architecture ``arch``."""
    return template.format(arch=arch) if "{arch}" in template else template
