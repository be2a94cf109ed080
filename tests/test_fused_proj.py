"""Projections fused at load (q/k/v, gate/up) give the logits of the unfused model, bit for bit.

The reference is the same GGUF loaded with ``HF2Q_NO_FUSED_PROJ=1`` (every projection its own product), on each
CPU path a product can take: the host decode step (it reads the parts, now views of the fused buffers), the MLX
graph with the host C matvec (decode) and host BLAS (prefill chunks), and the MLX graph alone
(``mx.quantized_matmul``, the GPU's path). Files: the tiny llama/qwen3 checkpoints converted to F32, their
projections re-quantized per role — all Q8_0 (everything fuses), or mixed types (only matching neighbours fuse:
q|k beside v, k|v beside q). Transformers parity of the same families is ``test_engine_fidelity.py``.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q.engine.layers import Linear, on_cpu, run_products
from hf2q.engine.quant_repack import to_affine
from hf2q.formats.gguf_file import GGUFTensor
from hf2q.ggml import codec
from tests.engine_support import convert_f32, random_tokens

ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
MIXES = {
    "q8_0": dict.fromkeys(ROLES, T.Q8_0),
    # q|k fused beside v; gate|up fused at an odd width (5-bit: the host kernel's unpacked copy)
    "mixed_qk": {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q4_0, "attn_output": T.Q4_1,
                 "ffn_gate": T.Q5_0, "ffn_up": T.Q5_0, "ffn_down": T.Q4_0},
    # k|v fused beside q; gate and up of different types stay apart
    "mixed_kv": {"attn_q": T.Q4_1, "attn_k": T.Q4_0, "attn_v": T.Q4_0, "attn_output": T.Q8_0,
                 "ffn_gate": T.Q8_0, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0},
}
CASES = [("qwen3", "q8_0"), ("llama", "mixed_qk"), ("qwen3", "mixed_kv")]


def requantize(src, out, mix: dict) -> None:
    """``src`` (an F32 GGUF) with each projection of ``mix``'s roles quantized to its type; the rest as is."""
    r = gguf.GGUFReader(src)
    arch_key = gguf.Keys.General.ARCHITECTURE
    arch = bytes(r.fields[arch_key].parts[-1]).decode()
    w = gguf.GGUFWriter(out, arch)
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == arch_key:
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, field.contents(), vt, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, field.contents(), vt)
    for t in r.tensors:
        role = t.name.split(".")[-2] if t.name.startswith("blk.") else None
        data = np.asarray(t.data)
        if role in mix:
            q = codec.quantize(np.ascontiguousarray(data, dtype=np.float32), mix[role])
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=mix[role])
        else:
            w.add_tensor(t.name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(family: str, mix: str):
        if (family, mix) not in made:
            root = tmp_path_factory.mktemp(f"{family}-{mix}")
            f32 = convert_f32(tiny_checkpoint(family), root / "f32.gguf")
            requantize(f32, root / "m.gguf", MIXES[mix])
            made[family, mix] = root / "m.gguf"
        return made[family, mix]

    return get


def _load(path, monkeypatch, fused: bool, **env):
    from hf2q.engine.runner import MlxModelRunner

    with monkeypatch.context() as m:
        for k, v in {"HF2Q_NO_FUSED_PROJ": "" if fused else "1", **env}.items():
            m.setenv(k, v) if v else m.delenv(k, raising=False)
        return MlxModelRunner.load(path)


def _logits(runner) -> list[np.ndarray]:
    """A 12-token prefill, a 3-token chunk on it, two single decodes, two stacked 3-sequence decodes."""
    toks = random_tokens(24)
    out = []
    a, b, c = runner.new_sequence(), runner.new_sequence(), runner.new_sequence()
    out.append(runner.prefill(a, toks[:12]))
    out.append(runner.prefill(a, toks[12:15]))
    out.append(runner.prefill(b, toks[15:20]))
    out.append(runner.prefill(c, toks[20:22]))
    for t in toks[:2]:
        out.append(runner.decode([a], [t]))
    for t in toks[2:4]:
        out.append(runner.decode([a, b, c], [t, t + 1, t + 2]))
    return out


def _groups(runner):
    layer = runner.model.layers[0]
    return ([widths for _, widths in layer.attn.qkv], [widths for _, widths in layer.ffn.gate_up])


@pytest.mark.parametrize("family,mix", CASES)
@pytest.mark.parametrize("path", ["host_step", "graph_c_kernels", "graph_mlx_only"])
def test_fused_logits_equal_unfused(family, mix, path, quantized, monkeypatch):
    env = {} if path == "host_step" else {"HF2Q_NO_HOST_DECODE": "1"}
    path_ = quantized(family, mix)
    fused, plain = _load(path_, monkeypatch, True, **env), _load(path_, monkeypatch, False, **env)
    if path == "graph_mlx_only":  # no C kernel arrays: every few-row product is an MLX quantized matmul
        for r in (fused, plain):
            for layer in r.model.layers:
                for lin, _ in (*layer.attn.qkv, (layer.attn.o, 0), *layer.ffn.gate_up, (layer.ffn.down, 0)):
                    lin._host = None
    assert (fused.host_decoder is None) == (path != "host_step")
    n_heads, n_kv, hd = fused.model.cfg.n_heads, fused.model.cfg.n_kv_heads, fused.model.cfg.head_dim
    q, kv = n_heads * hd, n_kv * hd
    ffn = fused.model.layers[0].ffn.gate.shape[0]
    want = {"q8_0": ([(q, kv, kv)], [(ffn, ffn)]), "mixed_qk": ([(q, kv), (kv,)], [(ffn, ffn)]),
            "mixed_kv": ([(q,), (kv, kv)], [(ffn,), (ffn,)])}[mix]
    assert _groups(fused) == want
    assert _groups(plain) == ([(q,), (kv,), (kv,)], [(ffn,), (ffn,)])
    assert fused.model.weights_nbytes() == plain.model.weights_nbytes()
    for i, (got, ref) in enumerate(zip(_logits(fused), _logits(plain))):
        assert np.array_equal(got, ref), f"call {i}: max diff {np.abs(got - ref).max()}"


def test_parts_read_the_fused_buffers(quantized, monkeypatch):
    """After fusion a part is a view of its rows of the fused weight: no second copy of the weights."""
    runner = _load(quantized("qwen3", "q8_0"), monkeypatch, True)
    attn = runner.model.layers[0].attn
    (fused, widths), = attn.qkv
    whole = np.asarray(memoryview(fused.weight))
    row = 0
    for part, w in zip((attn.q, attn.k, attn.v), widths):
        view = np.asarray(memoryview(part.weight))
        assert np.shares_memory(view, whole) and np.array_equal(view, whole[row:row + w])
        assert part._host is not None and np.shares_memory(part._host[0], fused._host[0])
        row += w
    assert fused.observed == ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")


def test_imatrix_observer_sees_every_part(quantized, monkeypatch):
    """A fused product reports its input once for each tensor it stands for (``hf2q imatrix`` counts per tensor)."""
    from hf2q.engine import layers

    class Seen:
        def __init__(self):
            self.names, self.calls = {}, {}

        def dense(self, name, x):
            self.names.setdefault(name, np.array(x, copy=True))
            self.calls[name] = self.calls.get(name, 0) + 1

        def experts(self, *a):
            raise AssertionError("no experts here")

    runner = _load(quantized("qwen3", "q8_0"), monkeypatch, True, HF2Q_NO_HOST_DECODE="1")
    seen = Seen()
    layers.set_observer(seen)
    try:
        seq = runner.new_sequence()
        runner.prefill(seq, random_tokens(12))  # many rows: the CPU runs a fused product part by part
        runner.prefill(seq, random_tokens(3))  # few rows: one fused product
    finally:
        layers.set_observer(None)
    for i in range(runner.model.cfg.n_layers):
        p = f"blk.{i}."
        assert {p + r + ".weight" for r in ROLES} <= set(seen.names)
        assert {seen.calls[p + r + ".weight"] for r in ROLES} == {2}
        assert np.array_equal(seen.names[p + "attn_q.weight"], seen.names[p + "attn_v.weight"])
        assert np.array_equal(seen.names[p + "ffn_gate.weight"], seen.names[p + "ffn_up.weight"])


QTYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K]


def _tensor(name: str, rows: int, qtype, seed: int) -> GGUFTensor:
    w = (np.random.default_rng(seed).standard_normal((rows, 256)) * 0.05).astype(np.float32)
    data = codec.quantize(w, qtype)
    return GGUFTensor(name, qtype, (rows, 256), data, data.nbytes)


@settings(max_examples=10, deadline=None)
@given(parts=st.lists(st.tuples(st.sampled_from(QTYPES), st.integers(1, 40)), min_size=2, max_size=4),
       chunk=st.sampled_from([256, 256 * 7, 1 << 24]), rows=st.sampled_from([1, 3, 12]), seed=st.integers(0, 2 ** 16))
def test_products_fused_as_read_match_each_part(parts, chunk, rows, seed):
    """Tensors fused as they are read (stored blocks repacked band by band into one MLX buffer, bands of any size;
    K-quants and odd widths too): the same packed weights, row for row, as each tensor loaded alone, and the same
    products on the host kernel, the prefill path and MLX's quantized matmul (a GPU's)."""
    from hf2q.engine import quant_repack
    from hf2q.engine.layers import load_products

    tensors = [_tensor(f"p{i}", n, qt, seed + i) for i, (qt, n) in enumerate(parts)]
    kept, quant_repack.REPACK_CHUNK = quant_repack.REPACK_CHUNK, chunk
    try:
        mine, products = load_products(tensors, mx.float32)
    finally:
        quant_repack.REPACK_CHUNK = kept
    alone = [Linear(t, mx.float32) for t in tensors]
    same_run = sum(1 for a, b in zip(parts, parts[1:]) if a[0] == b[0])
    assert len(products) == len(parts) - same_run
    assert [p.name for p in mine] == [t.name for t in tensors]
    for p, a, t in zip(mine, alone, tensors):
        ref = to_affine(t.data, t.qtype, t.shape, wide=on_cpu())  # the repack in one piece, no MLX (a CPU's widths)
        for k, want in (("weight", ref.packed), ("scales", ref.scales), ("biases", ref.biases)):
            assert np.array_equal(np.array(getattr(p, k)), want) and np.array_equal(np.array(getattr(a, k)), want)
    x = mx.array(np.random.default_rng(seed).standard_normal((1, rows, 256)).astype(np.float32))
    for g, a in zip(run_products(products, x), alone):
        assert np.array_equal(np.array(g), np.array(a(x)))
    flat = np.concatenate([np.array(lin._quantized_product(x)) for lin, _ in products], axis=-1)
    offsets = np.cumsum([0] + [n for _, n in parts])
    for i, a in enumerate(alone):
        assert np.array_equal(flat[..., offsets[i]:offsets[i + 1]], np.array(a._quantized_product(x)))
