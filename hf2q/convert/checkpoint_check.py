"""Does the checkpoint hold the model its config describes? Checked on headers only, before any output.

The converter trusts ``config.json`` for the GGUF metadata and the safetensors headers for the
tensors; a runtime later trusts both to agree (a K projection wider than the KV heads it was
told about is an out-of-bounds read in a kernel). So before a byte is written:

* the config's values have sane types and ranges (``hf_config.check_values``), and its layer
  count is bounded by the checkpoint before the family builds a name table that large;
* every block the config declares has tensors, blocks of a uniform family hold the same tensors
  and the family's required ones, and the final norm and the embedding exist;
* every planned tensor has the shape the config implies for its kind (``Family.expected_dims``),
  floating-point data, and an embedding with a row for every token of the vocabulary.

Only names, shapes and dtypes are read, so this costs milliseconds on any model size.
"""

from __future__ import annotations

import gguf

from hf2q.arch.base import LAYER_KEYS, Family, Metadata, PlannedTensor
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.sources.hf_config import check_values, optional
from hf2q.sources.safetensors_reader import FLOAT_DTYPES, SafetensorsCheckpoint

MT = gguf.MODEL_TENSOR


def check_config(cfg: dict, ck: SafetensorsCheckpoint) -> None:
    """Before the family is built: value types and ranges, and a layer count the checkpoint can hold
    (each layer has at least one tensor, so more layers than tensors is impossible)."""
    check_values(cfg)
    for key in LAYER_KEYS:
        n = cfg.get(key)
        if n is not None:
            if n > len(ck.entries):
                raise InputError(f"config.json: {key} is {n} but the checkpoint has only {len(ck.entries)} tensors")
            break


def check_plan(family: Family, ck: SafetensorsCheckpoint, tensors: list[PlannedTensor]) -> None:
    """The planned tensors against what ``family``'s config implies (see the module docstring)."""
    _check_storage(ck, tensors)
    _check_blocks(family, tensors)
    _check_required(family, tensors)
    _check_shapes(family, ck, tensors)


def check_vocabulary(md: Metadata, tensors: list[PlannedTensor]) -> None:
    """llama.cpp sizes the vocabulary from the token list and looks every id up in ``token_embd``."""
    tokens = md.get(Keys.Tokenizer.LIST)
    embd = next((t for t in tensors if t.name == _name(MT.TOKEN_EMBD)), None)
    if tokens is None or embd is None or len(embd.shape) != 2:
        return
    if len(tokens) > embd.shape[0]:
        raise InputError(f"the tokenizer has {len(tokens)} tokens but the embedding "
                         f"({_hf_name(embd)}) has only {embd.shape[0]} rows")


def _name(kind: gguf.MODEL_TENSOR, bid: int | None = None) -> str:
    base = gguf.TENSOR_NAMES[kind]
    return (base.format(bid=bid) if bid is not None else base) + ".weight"


def _hf_name(t: PlannedTensor) -> str:
    names = t.source.source_names
    return _shown(names[0] if names else t.name)


def _shown(name: str) -> str:
    """A checkpoint's tensor name as it can be printed on one line."""
    return name if name.isprintable() else repr(name)


def _block(name: str) -> tuple[int, str] | None:
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None


def _layer_key(cfg: dict) -> str:
    return next((k for k in LAYER_KEYS if cfg.get(k) is not None), LAYER_KEYS[0])


def _ranges(ids: list[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:5])
    return shown + (f", … ({len(ids)} in all)" if len(ids) > 5 else "")


def _check_storage(ck: SafetensorsCheckpoint, tensors: list[PlannedTensor]) -> None:
    """Every tensor has values along each axis and floating-point data to read them from."""
    for t in tensors:
        if not t.shape or 0 in t.shape:  # the writer works in rows of shape[-1] values
            raise InputError(f"{_hf_name(t)} ({t.name}) has shape {list(t.shape)}; every tensor needs at least "
                             "one value along each axis")
        if getattr(t.source, "reads_integers", False):
            continue  # a packed source checks its own dtypes
        for name in t.source.source_names:
            dtype = ck.entry(name).dtype
            if dtype not in FLOAT_DTYPES:
                raise InputError(f"{_shown(name)} has dtype {dtype}; weights must be floating point "
                                 f"({', '.join(sorted(FLOAT_DTYPES))})")


def _check_blocks(family: Family, tensors: list[PlannedTensor]) -> None:
    found = {b[0] for t in tensors if (b := _block(t.name))}
    expected = family.expected_blocks()
    key = _layer_key(family.cfg)
    missing = [b for b in expected if b not in found]
    if missing:
        raise InputError(f"config.json: {key} is {family.n_layer} but the checkpoint has no tensors for "
                         f"layer(s) {_ranges(missing)}")
    extra = sorted(found - set(expected))
    if extra:
        raise InputError(f"config.json: {key} is {family.n_layer} but the checkpoint has layer(s) {_ranges(extra)}")


def _check_required(family: Family, tensors: list[PlannedTensor]) -> None:
    names = {t.name for t in tensors}
    if family.mtp != "only":
        for kind in family.required_tensors:
            if _name(kind) not in names:
                raise InputError(f"the checkpoint has no {_name(kind)} (the {kind.name.lower().replace('_', ' ')} "
                                 f"tensor every {family.arch_name} model has)")
    if not family.uniform_blocks:
        return
    per_block: dict[int, set[str]] = {}
    for t in tensors:
        if b := _block(t.name):
            per_block.setdefault(b[0], set()).add(b[1])
    wanted = set().union(*per_block.values()) | {_name(k, 0).split(".", 2)[2] for k in family.block_tensors}
    for bid in family.expected_blocks():
        lacking = sorted(wanted - per_block.get(bid, set()))
        if lacking:
            raise InputError(f"layer {bid} of the checkpoint lacks " + ", ".join(f"blk.{bid}.{n}" for n in lacking[:3])
                             + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""))


def _check_shapes(family: Family, ck: SafetensorsCheckpoint, tensors: list[PlannedTensor]) -> None:
    dims = family.expected_dims()
    vocab = optional(family.cfg, "vocab_size")
    for t in tensors:
        if not t.name.endswith((".weight", ".bias")):
            continue
        kind = family.tensor_kind(t.name)
        want = dims.get(kind)
        if kind == MT.TOKEN_EMBD and vocab is not None and t.source.source_names:
            rows = ck.entry(t.source.source_names[0]).shape[:1]
            if rows and rows[0] < vocab:
                raise InputError(f"config.json: vocab_size is {vocab} but {_hf_name(t)} has only {rows[0]} rows")
        if want is None or t.name.endswith(".bias") and len(want) != 1:
            continue
        shape = tuple(t.shape)
        if len(shape) != len(want) or any(w is not None and w != s for w, s in zip(want, shape)):
            shown = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
            raise InputError(f"{_hf_name(t)} ({t.name}) has shape {list(shape)} but config.json implies {shown}")
