"""sha256 of every input file, recorded in the conversion report (``--no-integrity`` skips it).

The hashes let a user (and ``--batch`` receipts) prove which exact bytes produced an output.
Files are read in 8 MiB chunks so hashing never holds a shard in memory.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 8 << 20

# files besides the weights that influence a GGUF's content
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
              "generation_config.json", "modules.json", "vocab.txt", "added_tokens.json",
              "model.safetensors.index.json", "1_Pooling/config.json")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def input_files(src: Path, weight_files: list[Path]) -> list[Path]:
    side = [src / n for n in SIDE_FILES if (src / n).is_file()]
    return side + list(weight_files)


def hash_inputs(src: Path, weight_files: list[Path]) -> dict[str, str]:
    """``{relative path: sha256}`` for config, tokenizer and weight files."""
    return {str(p.relative_to(src)): sha256_file(p) for p in input_files(src, weight_files)}
