"""One module per model family; :func:`build_model` picks it from ``general.architecture``."""

from __future__ import annotations

import importlib

from hf2q.errors import InputError
from hf2q.formats.gguf_check import check_weights
from hf2q.formats.gguf_file import GGUFFile
from hf2q.formats.gguf_keys import ExtraKeys

FAMILIES = {
    "llama": "hf2q.engine.models.llama",
    "qwen3": "hf2q.engine.models.qwen3",
    "qwen3moe": "hf2q.engine.models.qwen3_moe",
    "qwen35": "hf2q.engine.models.qwen35",
    "qwen35moe": "hf2q.engine.models.qwen35_moe",
    "qwen3vl": "hf2q.engine.models.qwen3vl",
    "qwen3vlmoe": "hf2q.engine.models.qwen3vl_moe",
    "gemma3": "hf2q.engine.models.gemma3",
    "gemma4": "hf2q.engine.models.gemma4",
    "deepseek4": "hf2q.engine.models.deepseek4",
    "bert": "hf2q.engine.models.bert",
    "nomic-bert": "hf2q.engine.models.nomic_bert",
    "nomic-bert-moe": "hf2q.engine.models.nomic_bert_moe",
}


def supported(arch: str) -> bool:
    return arch in FAMILIES


def build_model(g: GGUFFile, dtype):
    """The family's graph over ``g``'s weights, after ``formats.gguf_check.check_weights`` passed the file: no
    tensor reaches a kernel unless its shape and type are the ones the hyper-parameters imply."""
    arch = g.arch
    if arch not in FAMILIES:
        raise InputError(f"{g.path.name}: unsupported architecture {arch or '(none)'!r} "
                         f"(supported: {', '.join(sorted(FAMILIES))})")
    if ExtraKeys.TENSOR_PARALLEL not in g.metadata:  # a rank's view: load_shard checked the whole file
        check_weights(g)
    return importlib.import_module(FAMILIES[arch]).build(g, dtype)
