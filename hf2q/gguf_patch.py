"""``hf2q gguf-patch FILE``: change a GGUF's metadata without touching its tensor bytes.

A wrong chat template or BOS flag in a published GGUF should not need a re-conversion. The new
file is the old header with the asked-for key/values replaced, added or dropped — every other
key/value and the tensor directory copied byte for byte — then zero padding to
``general.alignment`` and the old data section streamed across unchanged. Tensor offsets are
relative to the data section, so they stay valid wherever the section now starts.

Output goes through :func:`hf2q.atomic.atomic_output` (temp file beside the target, fsync,
rename): an interrupted patch leaves the original as it was.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as VT

from hf2q.atomic import atomic_output
from hf2q.errors import InputError, UsageError
from hf2q.formats.gguf_file import GGUF_MAGIC, open_gguf
from hf2q.formats.gguf_keys import ExtraKeys, Keys
from hf2q.formats.gguf_parse import layout

COPY_CHUNK = 16 << 20

#: ``KEY:TYPE=VALUE`` spellings for a key the file does not have yet
TYPE_NAMES = {"u8": VT.UINT8, "i8": VT.INT8, "u16": VT.UINT16, "i16": VT.INT16, "u32": VT.UINT32,
              "i32": VT.INT32, "u64": VT.UINT64, "i64": VT.INT64, "f32": VT.FLOAT32, "f64": VT.FLOAT64,
              "bool": VT.BOOL, "str": VT.STRING}
_INT_FORMATS = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
                VT.INT32: "<i", VT.UINT64: "<Q", VT.INT64: "<q"}
_FLOAT_FORMATS = {VT.FLOAT32: "<f", VT.FLOAT64: "<d"}
#: keys whose change would move tensors or contradict the container; never patched
_FROZEN = (Keys.General.ALIGNMENT, ExtraKeys.GGUF_VERSION, ExtraKeys.GGUF_TENSOR_COUNT, ExtraKeys.GGUF_KV_COUNT)


def parse_value(key: str, text: str, vtype: VT) -> Any:
    """``text`` as a value of GGUF type ``vtype``; a bad one is a one-line ``UsageError``."""
    if vtype == VT.STRING:
        return text
    if vtype == VT.BOOL:
        low = text.strip().lower()
        if low in ("true", "1"):
            return True
        if low in ("false", "0"):
            return False
        raise UsageError(f"{key} is a bool: give true or false, not {text!r}")
    try:
        if vtype in _FLOAT_FORMATS:
            return float(text)
        value = int(text)
    except ValueError:
        raise UsageError(f"{key} is {vtype.name.lower()}: cannot read {text!r}") from None
    try:
        struct.pack(_INT_FORMATS[vtype], value)
    except struct.error:
        raise UsageError(f"{key}: {value} does not fit {vtype.name.lower()}") from None
    return value


def _guess_type(text: str) -> VT:
    """The type of a new key written without ``:TYPE``: bool, then integer, then float, else string."""
    if text.strip().lower() in ("true", "false"):
        return VT.BOOL
    try:
        return VT.UINT32 if int(text) >= 0 else VT.INT32
    except ValueError:
        pass
    try:
        float(text)
        return VT.FLOAT32
    except ValueError:
        return VT.STRING


def encode_kv(key: str, vtype: VT, value: Any) -> bytes:
    """One scalar key/value as it lies in a GGUF header."""
    name = key.encode("utf-8")
    head = struct.pack("<Q", len(name)) + name + struct.pack("<I", int(vtype))
    if vtype == VT.STRING:
        raw = str(value).encode("utf-8")
        return head + struct.pack("<Q", len(raw)) + raw
    if vtype == VT.BOOL:
        return head + struct.pack("<?", bool(value))
    fmt = _FLOAT_FORMATS.get(vtype) or _INT_FORMATS[vtype]
    return head + struct.pack(fmt, value)


def plan_changes(args, existing: dict[str, VT]) -> tuple[dict[str, tuple[VT, Any]], list[str]]:
    """The command line → (``{key: (type, value)}`` to set, keys to drop). A key's type is the type it
    has in the file; a new key takes ``KEY:TYPE=VALUE``'s type or a guess from the value."""
    sets: dict[str, tuple[VT, Any]] = {}

    def put(key: str, text: str, new_type: VT | None) -> None:
        if key in sets:
            raise UsageError(f"{key} is set twice")
        if key in _FROZEN:
            raise UsageError(f"{key} cannot be patched (it would move the tensor data)")
        vtype = existing.get(key)
        if vtype == VT.ARRAY:
            raise UsageError(f"{key} is an array; only scalar keys can be set")
        if vtype is not None and new_type is not None and new_type != vtype:
            raise UsageError(f"{key} is {vtype.name.lower()} in the file, not {new_type.name.lower()}")
        if vtype is None:
            vtype = new_type if new_type is not None else _guess_type(text)
        sets[key] = (vtype, parse_value(key, text, vtype))

    for item in args.set or []:
        spec, eq, text = item.partition("=")
        key, colon, tname = spec.partition(":")
        if not eq or not key:
            raise UsageError(f"--set wants KEY=VALUE or KEY:TYPE=VALUE, not {item!r}")
        if colon and tname not in TYPE_NAMES:
            raise UsageError(f"--set {key}: unknown type {tname!r} (one of {', '.join(TYPE_NAMES)})")
        put(key, text, TYPE_NAMES[tname] if colon else None)
    if args.chat_template:
        try:
            text = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read --chat-template {args.chat_template}: {getattr(e, 'strerror', e)}") from None
        put(Keys.Tokenizer.CHAT_TEMPLATE, text, VT.STRING)
    if getattr(args, "chat_template_name", None):
        from hf2q.text.official_templates import official_template

        put(Keys.Tokenizer.CHAT_TEMPLATE, official_template(args.chat_template_name), VT.STRING)
    for flag, key, vtype in (("add_bos", Keys.Tokenizer.ADD_BOS, VT.BOOL), ("add_eos", Keys.Tokenizer.ADD_EOS, VT.BOOL),
                             ("bos_id", Keys.Tokenizer.BOS_ID, VT.UINT32), ("eos_id", Keys.Tokenizer.EOS_ID, VT.UINT32)):
        value = getattr(args, flag, None)
        if value is not None:
            put(key, str(value), vtype)
    drops = []
    for key in args.drop or []:
        if key in sets or key in drops:
            raise UsageError(f"{key} is both set and dropped, or dropped twice")
        if key in _FROZEN:
            raise UsageError(f"{key} cannot be dropped (it would move the tensor data)")
        if key not in existing:
            raise UsageError(f"--drop {key}: the file has no such key")
        drops.append(key)
    return sets, drops


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    if isinstance(value, list):
        text = f"[{len(value)} items]"
    return text if len(text) <= 72 else text[:60] + f"… ({len(str(value))} chars)"


def diff_lines(metadata: dict[str, Any], sets: dict[str, tuple[VT, Any]], drops: list[str]) -> list[str]:
    """``key: old → new`` for every key whose value changes."""
    lines = []
    for key, (_vtype, value) in sets.items():
        old = metadata.get(key, None)
        if key in metadata and old == value and type(old) is type(value):
            continue
        lines.append(f"{key}: {_show(old) if key in metadata else '(absent)'} → {_show(value)}")
    lines += [f"{key}: {_show(metadata[key])} → (dropped)" for key in drops]
    return lines


def _header_bytes(mm, lay, version: int, n_tensors: int, sets, drops) -> bytes:
    parts, kept = [], 0
    present = {key for key, _t, _s, _e in lay.kv_spans}
    for key, _vtype, start, end in lay.kv_spans:
        if key in drops:
            continue
        parts.append(encode_kv(key, *sets[key]) if key in sets else bytes(mm[start:end]))
        kept += 1
    for key, (vtype, value) in sets.items():
        if key not in present:
            parts.append(encode_kv(key, vtype, value))
            kept += 1
    t0, t1 = lay.tensor_infos
    parts.append(bytes(mm[t0:t1]))
    head = GGUF_MAGIC + struct.pack("<IQQ", version, n_tensors, kept) + b"".join(parts)
    return head + b"\0" * (-len(head) % lay.alignment)


def _copy_data(src: Path, start: int, out) -> None:
    with open(src, "rb") as fh:
        fh.seek(start)
        while chunk := fh.read(COPY_CHUNK):
            out.write(chunk)


def patch(path: Path, output: Path, header: bytes, data_start: int) -> None:
    """Write ``header`` then ``path``'s data section (from ``data_start``) to ``output`` (which may be
    ``path``).

    In place, a symlink's target is what gets replaced (a Hub cache's link keeps pointing at the
    patched blob), and the file keeps its permission bits."""
    in_place = output.resolve() == path.resolve()
    target = path.resolve() if in_place else output
    with atomic_output(target) as out:
        if in_place:
            os.fchmod(out.fileno(), path.stat().st_mode & 0o7777)
        out.write(header)
        _copy_data(path, data_start, out)


def run(args) -> int:
    if getattr(args, "list_chat_templates", False):
        from hf2q.text.official_templates import template_names

        print("\n".join(template_names()))
        return 0
    if not args.file:
        raise UsageError("gguf-patch needs FILE (the .gguf to patch)")
    path = Path(args.file)
    open_gguf(path)  # the container check: every defect is one InputError line (exit 3)
    metadata, lay, version, mm = layout(path)
    try:
        existing = {key: VT(vtype) for key, vtype, _s, _e in lay.kv_spans}
        sets, drops = plan_changes(args, existing)
        lines = diff_lines(metadata, sets, drops)
        for line in lines:
            print(line)
        if not lines:
            print(f"{path.name}: nothing to change; nothing written")
            return 0
        if args.dry_run:
            print("dry run: nothing written")
            return 0
        output = Path(args.output) if args.output else path
        if output.exists() and output.is_dir():
            raise UsageError(f"-o {output} is a directory")
        header = _header_bytes(mm, lay, version, metadata[ExtraKeys.GGUF_TENSOR_COUNT], sets, drops)
    finally:
        del mm  # the map is released before the output is written (in place, the file is replaced)
    patch(path, output, header, lay.data_start)
    print(f"wrote {output} ({os.path.getsize(output)} bytes)", file=sys.stderr)
    return 0
