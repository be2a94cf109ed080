"""Importance matrix → per-tensor quantizer weights, decided before any tensor is read.

llama-quantize (``src/llama-quant.cpp``) looks each tensor up by its GGUF name: a missing entry
means "quantize without"; a size mismatch is fatal except for the token embedding; and for a
``Q2_K_S`` file every ``Q2_K`` tensor other than ``token_embd`` / ``output`` *must* have an
entry ("a very low-bit quantization" gives garbage without one). Doing all lookups at plan
time turns a bad or mismatched file into one ``InputError`` before a byte is written.

``metadata_entries`` are the four ``quantize.imatrix.*`` keys llama-quantize adds (as KV
overrides, appended after the model's own keys) so a file records which matrix shaped it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from hf2q.arch.base import Metadata
from hf2q.errors import InputError
from hf2q.sources.imatrix import ImatrixFile, weights_for_tensor

T = gguf.GGMLQuantizationType
F = gguf.LlamaFileType
MAX_VALUE_CHARS = 127  # llama-quantize copies override strings into a char[128]
_NEVER_REQUIRED = ("token_embd.weight", "per_layer_token_embd.weight", "output.weight")
# target types for which llama-quantize refuses to run without weights (any file type)
_ALWAYS_REQUIRED = {T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S}
_QUANTIZED_FROM_WEIGHTS = {T.F32, T.F16, T.BF16}  # float targets never take an imatrix


def requires_imatrix(name: str, qtype: T, ftype: F) -> bool:
    """llama-quantize's ``tensor_requires_imatrix``."""
    if name in _NEVER_REQUIRED:
        return False
    if qtype in _ALWAYS_REQUIRED:
        return True
    return qtype == T.Q2_K and ftype == F.MOSTLY_Q2_K_S


def tensor_weights(imatrix: ImatrixFile, tensors, types, ftype: F) -> list[np.ndarray | None]:
    """Per planned tensor: ``[n_expert, ne0]`` float32 weights, or None (no entry / float target)."""
    out: list[np.ndarray | None] = []
    for t, qtype in zip(tensors, types):
        if qtype in _QUANTIZED_FROM_WEIGHTS:
            out.append(None)
            continue
        w = weights_for_tensor(imatrix.weights, t.name, [int(v) for v in t.ne])
        if w is None and requires_imatrix(t.name, qtype, ftype):
            raise InputError(f"imatrix {imatrix.path.name} has no entry for {t.name}, which {qtype.name} "
                             "needs in this very low-bit quantization")
        out.append(w)
    return out


def add_metadata(md: Metadata, imatrix: ImatrixFile, file_arg: str) -> None:
    """llama-quantize's ``quantize.imatrix.*`` keys (strings cut to 127 chars, counts as u32).

    ``file_arg`` is the path as the user typed it, which is what llama-quantize records."""
    md.string("quantize.imatrix.file", str(file_arg)[:MAX_VALUE_CHARS])
    if imatrix.datasets:
        md.string("quantize.imatrix.dataset", imatrix.datasets[0][:MAX_VALUE_CHARS])
    md.u32("quantize.imatrix.entries_count", len(imatrix.weights))
    if imatrix.chunk_count > 0:
        md.u32("quantize.imatrix.chunks_count", imatrix.chunk_count)


def describe(imatrix: ImatrixFile) -> dict:
    """The imatrix part of the JSON report."""
    return {"file": str(Path(imatrix.path)), "format": "legacy" if imatrix.legacy else "gguf",
            "entries": len(imatrix.weights), "chunks": imatrix.chunk_count,
            "datasets": list(imatrix.datasets)}
