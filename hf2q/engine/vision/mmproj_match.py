"""Which mmproj (vision projector GGUF) serves a text model: the one named, or one found beside it.

llama.cpp ships a vision-language model as two files, and its converter names the projector
``mmproj-NAME-TYPE.gguf``; a directory may hold several (one per quantization, or for another
model). A projector fits a model when it is the family's (Qwen3-VL's ``qwen3vl_merger`` for
``qwen3vl``/``qwen3vlmoe``) and its merger writes the text model's embedding width. Reads headers
only (no MLX).
"""

from __future__ import annotations

from pathlib import Path

import gguf

from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile, open_gguf
from hf2q.formats.gguf_keys import Keys

#: text architectures that take images, and the projector type each needs
PROJECTORS = {"qwen3vl": gguf.VisionProjectorType.QWEN3VL, "qwen3vlmoe": gguf.VisionProjectorType.QWEN3VL}
#: the merger's output layer, whose rows are the text model's embedding width
MERGER_OUT = "mm.2.weight"


def misfit(model: GGUFFile, mmproj: GGUFFile) -> str | None:
    """Why ``mmproj`` cannot serve ``model`` (None when it can)."""
    want = PROJECTORS.get(model.arch)
    if want is None:
        return f"{model.path.name} is a {model.arch} model, which takes no images"
    kind = mmproj.metadata.get(Keys.Clip.PROJECTOR_TYPE)
    if mmproj.metadata.get(Keys.General.ARCHITECTURE) != "clip" or kind != want:
        return f"{mmproj.path.name} is not a {want} projector (projector type {kind!r})"
    width = model.get(Keys.LLM.EMBEDDING_LENGTH)
    out = mmproj.tensors.get(MERGER_OUT)
    if out is None or width is None or out.shape[0] != int(width):
        rows = out.shape[0] if out is not None else None
        return f"{mmproj.path.name} projects to width {rows}, the model's embeddings are {width} wide"
    return None


def choose_mmproj(model: GGUFFile, named: Path | None) -> tuple[Path | None, str]:
    """(the mmproj to serve with ``model`` or None, a line saying which and why).

    A named file must fit (else ``InputError``); otherwise the first fitting ``mmproj-*.gguf`` in
    the model's directory, by name, is taken."""
    if named is not None:
        reason = misfit(model, open_gguf(named))
        if reason:
            raise InputError(f"--mmproj: {reason}")
        return named, f"vision projector {named} (--mmproj)"
    if model.arch not in PROJECTORS:
        return None, ""
    skipped = []
    for path in sorted(model.path.parent.glob("mmproj-*.gguf")):
        try:
            reason = misfit(model, open_gguf(path))
        except InputError as e:
            reason = str(e)
        if reason is None:
            return path, f"vision projector {path} (found beside the model)"
        skipped.append(reason)
    why = f"; skipped: {'; '.join(skipped)}" if skipped else ""
    return None, f"no vision projector beside {model.path.name} (images are refused; --mmproj FILE){why}"
