"""Crafted GGUF files: one valid tiny llama and many ways of breaking it, each with the exit codes
``hf2q info`` and ``hf2q serve`` must give.

The files are written by a small serializer of our own (not ``gguf.GGUFWriter``), because most
defects are ones a correct writer refuses to produce: counts of 2^60, a string length past the end
of the file, tensor data past EOF or overlapping another tensor, a misaligned offset, a key of the
wrong value type. The valid model is a real llama graph (hidden 64, 2 blocks, 4 heads over 2 KV
heads of 16, SwiGLU 128, Q8_0 matrices so the host matvec kernel runs) with a byte-level BPE
vocabulary and a ChatML template, so the control case loads, warms up and serves.

``build_cases(out_dir)`` writes every case (deterministic, a second or two) and returns them;
the reliability bench and ``tests/test_gguf_validation.py`` import it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import Keys, quants

from hf2q.text.tokenizer import gpt2_byte_alphabet

ARCH = "llama"
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ALIGN = 32


@attrs.frozen
class CraftedGGUF:
    name: str        # short id, e.g. "attn_k_wrong_shape"
    path: Path
    info_exit: int   # expected `hf2q info PATH` exit code (0 only for the valid control case)
    serve_exit: int  # expected exit code of `hf2q serve --model PATH` at start-up (3 for every bad file)


# ---- the model: key/values and tensors as plain data, then bytes --------------------------------

@attrs.define
class Tensor:
    name: str
    dims: tuple[int, ...]  # ggml order (fastest first), as the file stores them
    ttype: int
    data: bytes
    offset: int | None = None  # relative to the data section; None = packed in order


@attrs.define
class Model:
    kvs: dict[str, tuple[int, Any, int | None]]  # key → (value type, value, array element type)
    tensors: list[Tensor]
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: int | None = None  # None = the real count
    n_kv: int | None = None

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)


def _key(template: str) -> str:
    return template.format(arch=ARCH)


def vocabulary() -> list[str]:
    return list(gpt2_byte_alphabet().values()) + ["Ġt", "he"] + SPECIALS


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def make_tensor(name: str, dims: tuple[int, ...], ttype: int = T.Q8_0, *, norm: bool = False) -> Tensor:
    """Seeded values for ``name`` in ``ttype`` (a norm is near one, a matrix near zero)."""
    shape = tuple(reversed(dims))
    r = _rng(name)
    x = (1.0 + 0.1 * r.standard_normal(shape)) if norm else 0.08 * r.standard_normal(shape)
    x = x.astype(np.float32)
    if ttype == T.F32:
        raw = x.tobytes()
    elif ttype == T.F16:
        raw = x.astype(np.float16).tobytes()
    else:
        raw = quants.quantize(x, T(ttype)).tobytes()
    return Tensor(name, dims, int(ttype), raw)


def valid_model() -> Model:
    vocab = vocabulary()
    n = len(vocab)
    types = [1] * (n - len(SPECIALS)) + [3] * len(SPECIALS)
    kvs: dict[str, tuple[int, Any, int | None]] = {
        Keys.General.ARCHITECTURE: (V.STRING, ARCH, None),
        Keys.General.NAME: (V.STRING, "crafted tiny llama", None),
        Keys.General.ALIGNMENT: (V.UINT32, ALIGN, None),
        _key(Keys.LLM.CONTEXT_LENGTH): (V.UINT32, 512, None),
        _key(Keys.LLM.EMBEDDING_LENGTH): (V.UINT32, HIDDEN, None),
        _key(Keys.LLM.BLOCK_COUNT): (V.UINT32, LAYERS, None),
        _key(Keys.LLM.FEED_FORWARD_LENGTH): (V.UINT32, FFN, None),
        _key(Keys.Attention.HEAD_COUNT): (V.UINT32, HEADS, None),
        _key(Keys.Attention.HEAD_COUNT_KV): (V.UINT32, KV_HEADS, None),
        _key(Keys.Attention.LAYERNORM_RMS_EPS): (V.FLOAT32, 1e-5, None),
        _key(Keys.Rope.FREQ_BASE): (V.FLOAT32, 10000.0, None),
        _key(Keys.Rope.DIMENSION_COUNT): (V.UINT32, HEAD_DIM, None),
        Keys.Tokenizer.MODEL: (V.STRING, "gpt2", None),
        Keys.Tokenizer.PRE: (V.STRING, "smollm", None),
        Keys.Tokenizer.LIST: (V.ARRAY, vocab, V.STRING),
        Keys.Tokenizer.TOKEN_TYPE: (V.ARRAY, types, V.INT32),
        Keys.Tokenizer.MERGES: (V.ARRAY, MERGES, V.STRING),
        Keys.Tokenizer.BOS_ID: (V.UINT32, n - 3, None),
        Keys.Tokenizer.EOS_ID: (V.UINT32, n - 1, None),
        Keys.Tokenizer.ADD_BOS: (V.BOOL, False, None),
        Keys.Tokenizer.CHAT_TEMPLATE: (V.STRING, CHATML, None),
    }
    tensors = [make_tensor("token_embd.weight", (HIDDEN, n)),
               make_tensor("output_norm.weight", (HIDDEN,), T.F32, norm=True)]
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"blk.{i}."
        tensors += [make_tensor(p + "attn_norm.weight", (HIDDEN,), T.F32, norm=True),
                    make_tensor(p + "attn_q.weight", (HIDDEN, q)),
                    make_tensor(p + "attn_k.weight", (HIDDEN, kv)),
                    make_tensor(p + "attn_v.weight", (HIDDEN, kv)),
                    make_tensor(p + "attn_output.weight", (q, HIDDEN)),
                    make_tensor(p + "ffn_norm.weight", (HIDDEN,), T.F32, norm=True),
                    make_tensor(p + "ffn_gate.weight", (HIDDEN, FFN)),
                    make_tensor(p + "ffn_up.weight", (HIDDEN, FFN)),
                    make_tensor(p + "ffn_down.weight", (FFN, HIDDEN))]
    return Model(kvs, tensors)


_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


def _string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value: Any, sub: int | None) -> bytes:
    if vtype == V.STRING:
        return _string(value)
    if vtype == V.ARRAY:
        return struct.pack("<IQ", sub, len(value)) + b"".join(_value(sub, v, None) for v in value)
    return struct.pack(_SCALAR[V(vtype)], value)


def to_bytes(m: Model) -> bytes:
    """The file: header, key/values, tensor directory, padding, data (offsets as given or packed)."""
    out = bytearray(m.magic + struct.pack("<I", m.version))
    out += struct.pack("<QQ", len(m.tensors) if m.n_tensors is None else m.n_tensors,
                       len(m.kvs) if m.n_kv is None else m.n_kv)
    for key, (vtype, value, sub) in m.kvs.items():
        out += _string(key) + struct.pack("<I", vtype) + _value(vtype, value, sub)
    offsets, pos = [], 0
    for t in m.tensors:
        offsets.append(pos if t.offset is None else t.offset)
        pos = (pos + len(t.data) + ALIGN - 1) // ALIGN * ALIGN
    for t, off in zip(m.tensors, offsets):
        out += _string(t.name) + struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims)
        out += struct.pack("<IQ", t.ttype, off)
    out += b"\0" * (-len(out) % ALIGN)
    data = bytearray()
    for t in m.tensors:
        data += t.data + b"\0" * (-len(t.data) % ALIGN)
    return bytes(out + data)


# ---- the defects --------------------------------------------------------------------------------

Edit = Callable[[Model], Any]


def _set(template: str, vtype: int, value: Any, sub: int | None = None) -> Edit:
    return lambda m: m.kvs.__setitem__(_key(template), (vtype, value, sub))


def _drop(template: str) -> Edit:
    return lambda m: m.kvs.pop(_key(template))


def _reshape(name: str, dims: tuple[int, ...], ttype: int = T.Q8_0) -> Edit:
    def edit(m: Model) -> None:
        t = m.tensor(name)
        norm = len(dims) == 1
        new = make_tensor(name, dims, ttype if not norm or ttype != T.Q8_0 else T.F32, norm=norm)
        t.dims, t.ttype, t.data = new.dims, new.ttype, new.data
    return edit


def _retype(name: str, ttype: int, data: bytes | None = None) -> Edit:
    def edit(m: Model) -> None:
        t = m.tensor(name)
        t.ttype = int(ttype)
        if data is not None:
            t.data = data
    return edit


def _remove(name: str) -> Edit:
    return lambda m: m.tensors.remove(m.tensor(name))


def _add(name: str, dims: tuple[int, ...], ttype: int = T.F32) -> Edit:
    return lambda m: m.tensors.append(make_tensor(name, dims, ttype, norm=len(dims) == 1))


def _poison(name: str, value: float) -> Edit:
    def edit(m: Model) -> None:
        t = m.tensor(name)
        x = np.frombuffer(t.data, dtype=np.float32).copy()
        x[3] = value
        t.data = x.tobytes()
    return edit


def _offset(name: str, offset: Callable[[Model], int]) -> Edit:
    def edit(m: Model) -> None:
        m.tensor(name).offset = offset(m)
    return edit


def _resize_vocab(delta: int) -> Edit:
    """A token list ``delta`` entries longer or shorter than the embedding (token types and EOS kept
    consistent with it, so only the vocabulary/embedding mismatch is wrong)."""
    def edit(m: Model) -> None:
        tokens = list(m.kvs[Keys.Tokenizer.LIST][1])
        tokens = tokens[:delta] if delta < 0 else tokens + [f"extra{i}" for i in range(delta)]
        m.kvs[Keys.Tokenizer.LIST] = (V.ARRAY, tokens, V.STRING)
        m.kvs[Keys.Tokenizer.TOKEN_TYPE] = (V.ARRAY, [1] * len(tokens), V.INT32)
        m.kvs[Keys.Tokenizer.EOS_ID] = (V.UINT32, min(m.kvs[Keys.Tokenizer.EOS_ID][1], len(tokens) - 1), None)
    return edit


def _packed_offset(m: Model, name: str) -> int:
    pos = 0
    for t in m.tensors:
        if t.name == name:
            return pos
        pos = (pos + len(t.data) + ALIGN - 1) // ALIGN * ALIGN
    raise KeyError(name)


def _model_edits() -> dict[str, Edit]:
    """name → one edit of the valid model; every one makes a file the engine must refuse."""
    kv, q = KV_HEADS * HEAD_DIM, HEADS * HEAD_DIM
    L, A, R, TK, G = Keys.LLM, Keys.Attention, Keys.Rope, Keys.Tokenizer, Keys.General
    n = len(vocabulary())
    return {
        # shapes, one per tensor kind (the first is the SIGSEGV in qmv_group)
        "attn_k_wrong_shape": _reshape("blk.0.attn_k.weight", (HIDDEN, 2 * kv)),
        "attn_q_wrong_shape": _reshape("blk.1.attn_q.weight", (HIDDEN, kv)),
        "attn_v_wrong_shape": _reshape("blk.0.attn_v.weight", (HIDDEN, 3 * kv)),
        "attn_output_wrong_shape": _reshape("blk.0.attn_output.weight", (q, 2 * HIDDEN)),
        "ffn_gate_wrong_shape": _reshape("blk.0.ffn_gate.weight", (HIDDEN, FFN + 32)),
        "ffn_up_wrong_shape": _reshape("blk.1.ffn_up.weight", (HIDDEN, FFN // 2)),
        "ffn_down_wrong_shape": _reshape("blk.0.ffn_down.weight", (FFN // 2, HIDDEN)),
        "token_embd_wrong_width": _reshape("token_embd.weight", (HIDDEN // 2, n)),
        "attn_norm_wrong_length": _reshape("blk.0.attn_norm.weight", (HIDDEN // 2,), T.F32),
        "output_norm_wrong_length": _reshape("output_norm.weight", (2 * HIDDEN,), T.F32),
        "attn_k_three_dims": _reshape("blk.0.attn_k.weight", (HIDDEN, kv, 2)),
        "output_wrong_rows": _add("output.weight", (HIDDEN, n + 32), T.Q8_0),
        # types
        "norm_quantized": _retype("blk.0.ffn_norm.weight", T.Q8_0,
                                  quants.quantize(np.ones((HIDDEN,), np.float32), T.Q8_0).tobytes()),
        "norm_int32": _retype("blk.1.attn_norm.weight", T.I32),
        "matrix_iq4_nl": _retype("blk.0.attn_q.weight", T.IQ4_NL,
                                 bytes(HIDDEN // 32 * 18 * q)),
        "unknown_ggml_type": _retype("blk.0.attn_v.weight", 99),
        "row_not_block_aligned": lambda m: setattr(m.tensor("blk.0.attn_q.weight"), "dims", (48, q)),
        # the container
        "bad_magic": lambda m: setattr(m, "magic", b"GGUG"),
        "version_1": lambda m: setattr(m, "version", 1),
        "version_big_endian": lambda m: setattr(m, "version", 3 << 24),
        "huge_tensor_count": lambda m: setattr(m, "n_tensors", 1 << 60),
        "huge_kv_count": lambda m: setattr(m, "n_kv", 1 << 60),
        "tensor_count_short": lambda m: setattr(m, "n_tensors", len(m.tensors) + 1),
        "offset_beyond_eof": _offset("blk.1.ffn_down.weight", lambda m: 1 << 40),
        "overlapping_tensors": _offset("blk.0.attn_v.weight", lambda m: _packed_offset(m, "blk.0.attn_k.weight")),
        "misaligned_offset": _offset("blk.1.attn_q.weight",
                                     lambda m: _packed_offset(m, "blk.1.attn_q.weight") + 4),
        "alignment_not_power_of_two": lambda m: m.kvs.__setitem__(G.ALIGNMENT, (V.UINT32, 24, None)),
        "alignment_string": lambda m: m.kvs.__setitem__(G.ALIGNMENT, (V.STRING, "32", None)),
        "duplicate_tensor": lambda m: m.tensors.append(make_tensor("blk.0.ffn_norm.weight", (HIDDEN,), T.F32,
                                                                    norm=True)),
        "zero_dim_tensor": lambda m: setattr(m.tensor("blk.1.ffn_norm.weight"), "dims", (0,)),
        # hyper-parameters
        "head_count_zero": _set(A.HEAD_COUNT, V.UINT32, 0),
        "head_count_kv_zero": _set(A.HEAD_COUNT_KV, V.UINT32, 0),
        "head_count_kv_not_divisor": _set(A.HEAD_COUNT_KV, V.UINT32, 3),
        "head_count_float": _set(A.HEAD_COUNT, V.FLOAT32, 4.0),
        "head_count_per_layer_array": _set(A.HEAD_COUNT, V.ARRAY, [HEADS, HEADS], V.UINT32),
        "block_count_huge": _set(L.BLOCK_COUNT, V.UINT32, 10 ** 9),
        "block_count_short": _set(L.BLOCK_COUNT, V.UINT32, 1),
        "block_count_zero": _set(L.BLOCK_COUNT, V.UINT32, 0),
        "block_count_missing": _drop(L.BLOCK_COUNT),
        "context_length_zero": _set(L.CONTEXT_LENGTH, V.UINT32, 0),
        "embedding_length_negative": _set(L.EMBEDDING_LENGTH, V.INT32, -64),
        "embedding_length_string": _set(L.EMBEDDING_LENGTH, V.STRING, "64"),
        "feed_forward_length_missing": _drop(L.FEED_FORWARD_LENGTH),
        "key_length_huge": _set(A.KEY_LENGTH, V.UINT64, 1 << 40),
        "rope_theta_string": _set(R.FREQ_BASE, V.STRING, "10000"),
        "rope_theta_negative": _set(R.FREQ_BASE, V.FLOAT32, -10000.0),
        "rope_theta_nan": _set(R.FREQ_BASE, V.FLOAT32, float("nan")),
        "rope_dims_odd": _set(R.DIMENSION_COUNT, V.UINT32, HEAD_DIM - 1),
        "rope_dims_past_head": _set(R.DIMENSION_COUNT, V.UINT32, 2 * HEAD_DIM),
        "rope_scaling_unknown": _set(R.SCALING_TYPE, V.STRING, "longrope9"),
        "rms_eps_zero": _set(A.LAYERNORM_RMS_EPS, V.FLOAT32, 0.0),
        # tensors present or not
        "missing_attn_q": _remove("blk.1.attn_q.weight"),
        "missing_output_norm": _remove("output_norm.weight"),
        "missing_token_embd": _remove("token_embd.weight"),
        "extra_block": _add("blk.2.attn_norm.weight", (HIDDEN,)),
        "unexpected_bias": _add("blk.0.attn_q.bias", (q,)),
        "nan_in_norm": _poison("blk.0.attn_norm.weight", float("nan")),
        "inf_in_norm": _poison("output_norm.weight", float("inf")),
        # tokenizer
        "missing_tokenizer_model": lambda m: m.kvs.pop(TK.MODEL),
        "missing_tokens": lambda m: m.kvs.pop(TK.LIST),
        "unknown_tokenizer_model": lambda m: m.kvs.__setitem__(TK.MODEL, (V.STRING, "wordpiece9", None)),
        "unknown_pre_tokenizer": lambda m: m.kvs.__setitem__(TK.PRE, (V.STRING, "no-such-pre", None)),
        "missing_merges": lambda m: m.kvs.pop(TK.MERGES),
        "vocab_smaller_than_embedding": _resize_vocab(-1),
        "vocab_larger_than_embedding": _resize_vocab(+1),
        "token_type_length_mismatch": lambda m: m.kvs.__setitem__(TK.TOKEN_TYPE, (V.ARRAY, [1] * 7, V.INT32)),
        "eos_id_out_of_range": lambda m: m.kvs.__setitem__(TK.EOS_ID, (V.UINT32, n + 1000, None)),
        # architecture
        "unknown_architecture": lambda m: m.kvs.__setitem__(G.ARCHITECTURE, (V.STRING, "mamba9", None)),
        "missing_architecture": lambda m: m.kvs.pop(G.ARCHITECTURE),
        "convert_only_architecture": lambda m: m.kvs.__setitem__(G.ARCHITECTURE, (V.STRING, "gemma4", None)),
    }


def _byte_edits(valid: bytes) -> dict[str, bytes]:
    """Defects of the bytes themselves: truncations at several points, lengths past the end."""
    first_key = 24  # magic, version, two counts
    name_len = struct.unpack_from("<Q", valid, first_key)[0]
    huge_string = bytearray(valid)
    struct.pack_into("<Q", huge_string, first_key, 1 << 60)
    # the token array: find its element count (just after the key, the type and the element type)
    key = Keys.Tokenizer.LIST.encode()
    at = valid.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4
    huge_array = bytearray(valid)
    struct.pack_into("<Q", huge_array, at, 1 << 60)
    data_tail = len(valid) - 3000
    return {
        "empty_file": b"",
        "truncated_in_header": valid[:20],
        "truncated_in_first_key": valid[:first_key + 8 + name_len // 2],
        "truncated_in_metadata": valid[:at + 5000],
        "truncated_in_tensor_directory": valid[:_directory_start(valid) + 40],
        "truncated_in_tensor_data": valid[:data_tail],
        "huge_string_length": bytes(huge_string),
        "huge_array_length": bytes(huge_array),
    }


def _directory_start(valid: bytes) -> int:
    """The byte where the tensor directory starts (after the last key/value)."""
    name = b"token_embd.weight"
    return valid.index(struct.pack("<Q", len(name)) + name)


def build_cases(out_dir: Path) -> list[CraftedGGUF]:
    """Write the valid control and every defect under ``out_dir``; deterministic and fast."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    valid = to_bytes(valid_model())
    cases = [_write(out_dir, "valid_control", valid, 0)]
    for name, edit in _model_edits().items():
        m = valid_model()
        edit(m)
        cases.append(_write(out_dir, name, to_bytes(m), 3))
    for name, raw in _byte_edits(valid).items():
        cases.append(_write(out_dir, name, raw, 3))
    return cases


def _write(out_dir: Path, name: str, raw: bytes, code: int) -> CraftedGGUF:
    path = out_dir / f"{name}.gguf"
    path.write_bytes(raw)
    return CraftedGGUF(name, path, info_exit=code, serve_exit=code)


if __name__ == "__main__":
    import sys
    import tempfile

    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="crafted-gguf-"))
    for c in build_cases(where):
        print(f"{c.info_exit} {c.serve_exit} {c.path}")
