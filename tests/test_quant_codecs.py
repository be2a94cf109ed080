"""hf2q.ggml codecs against independent oracles.

* llama.cpp itself: ``tests/fixtures/quants/*.npz`` hold inputs and the bytes that stock
  llama.cpp's ``ggml_quantize_chunk`` / ``to_float`` produced for them
  (regenerate with ``python -m tests.tools.make_quant_fixtures``);
* the ``gguf`` package's numpy (de)quantizers, written independently of ours;
* our own plain per-block references (``ggml_*_ref``) for inputs the fixtures lack.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from hf2q.errors import InputError
from hf2q.ggml import codec

FIXTURES = Path(__file__).parent / "fixtures" / "quants"
SETS = ("nasty256", "random1024", "legacy96", "wide4096", "floats")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _load(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


_CACHE: dict[str, dict[str, np.ndarray]] = {}


def fixture_set(name: str) -> dict[str, np.ndarray]:
    if name not in _CACHE:
        _CACHE[name] = _load(name)
    return _CACHE[name]


def _cases(prefix: str, sets=SETS):
    out = []
    for s in sets:
        with np.load(FIXTURES / f"{s}.npz") as z:
            out += [pytest.param(s, k[len(prefix):], id=f"{s}-{k[len(prefix):]}") for k in z.files
                    if k.startswith(prefix)]
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a, np.float32).view(np.uint32),
                                                 np.ascontiguousarray(b, np.float32).view(np.uint32))


def _first_diff(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.argwhere(got != want)
    return f"{len(bad)} bytes differ, first at (row, byte) {bad[:3].tolist()}"


@pytest.fixture(params=["jit", "numpy"])
def fast_quantize(request):
    """Both fast paths: the compiled kernels (numba) and the vectorised numpy fallback."""
    if request.param == "jit":
        if not codec.numba_installed():
            pytest.skip("numba is not installed")
        return codec.jit_quantize
    return codec.numpy_quantize


@pytest.mark.parametrize("set_name,qtype", _cases("q_"))
def test_fast_quantize_is_byte_identical_to_llama_cpp(set_name, qtype, fast_quantize):
    data = fixture_set(set_name)
    got = fast_quantize(data["x"].astype(np.float32), T[qtype])
    want = data[f"q_{qtype}"]
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got, want), _first_diff(got, want)


@pytest.mark.parametrize("set_name,qtype", _cases("dq_"))
def test_fast_dequantize_is_bit_identical_to_llama_cpp(set_name, qtype):
    data = fixture_set(set_name)
    got = codec.dequantize(data[f"q_{qtype}"], T[qtype], data["x"].shape)
    assert _same_bits(got, data[f"dq_{qtype}"])


@pytest.mark.parametrize("set_name,qtype", _cases("q_", ("nasty256", "random1024", "legacy96")))
def test_reference_codec_is_byte_identical_to_llama_cpp(set_name, qtype):
    data = fixture_set(set_name)
    x = data["x"].astype(np.float32)
    rows = slice(None) if qtype not in K_TYPES or set_name == "nasty256" else slice(0, 2)
    got = codec.reference_quantize(x[rows], T[qtype])
    want = data[f"q_{qtype}"][rows]
    assert np.array_equal(got, want), _first_diff(got, want)
    back = codec.reference_dequantize(want, T[qtype], x[rows].shape)
    assert _same_bits(back, data[f"dq_{qtype}"][rows])


def _extra_inputs(n: int) -> np.ndarray:
    """Inputs the fixtures do not contain: heavy tails, narrow ranges, offsets, duplicated blocks."""
    rng = np.random.default_rng(1234)
    rows = [rng.standard_t(2, n) * 0.05, rng.uniform(0.2, 0.21, n), rng.standard_normal(n) + 5.0,
            np.repeat(rng.standard_normal(n // 16), 16), rng.laplace(0, 1e-2, n),
            rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-6, 1, n // 16), 16)]
    return np.stack(rows).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_TYPES])
def test_fast_codec_equals_reference_on_new_inputs(qtype):
    x = _extra_inputs(512)
    fast = codec.quantize(x, T[qtype])
    ref = codec.reference_quantize(x, T[qtype])
    assert np.array_equal(fast, ref), _first_diff(fast, ref)
    assert _same_bits(codec.dequantize(fast, T[qtype], x.shape), codec.reference_dequantize(ref, T[qtype], x.shape))


@pytest.mark.parametrize("set_name,qtype", _cases("q_", ("nasty256", "random1024", "legacy96", "floats")))
def test_dequantize_agrees_with_gguf_package(set_name, qtype):
    data = fixture_set(set_name)
    raw = data[f"q_{qtype}"]
    theirs = gguf_quants.dequantize(raw, T[qtype]).astype(np.float32)
    ours = codec.dequantize(raw, T[qtype], data["x"].shape)
    assert _same_bits(ours, theirs.reshape(ours.shape))


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("set_name", ["random1024", "legacy96"])
def test_quantize_agrees_with_gguf_package(set_name, qtype):
    """gguf's numpy quantizers cover the float and legacy types (its edge-case handling differs
    from llama.cpp's on degenerate blocks, so compare on ordinary weights)."""
    x = fixture_set(set_name)["x"].astype(np.float32)
    theirs = np.ascontiguousarray(gguf_quants.quantize(x, T[qtype])).view(np.uint8).reshape(x.shape[0], -1)
    assert np.array_equal(codec.quantize(x, T[qtype]), theirs)


IMATRIX_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_TYPES)


def _imatrix_cases():
    out = []
    for s in SETS:
        with np.load(FIXTURES / f"{s}.npz") as z:
            out += [pytest.param(s, k, id=f"{s}-{k}") for k in z.files if k.startswith(("qw_", "qz_"))]
    return out


@pytest.mark.parametrize("set_name,key", _imatrix_cases())
def test_fast_imatrix_quantize_is_byte_identical_to_llama_cpp(set_name, key, fast_quantize):
    """qw_*: dense positive imatrix; qz_*: imatrix with zeros (incl. whole zero sub-blocks)."""
    data = fixture_set(set_name)
    weights = data["imatrix_sparse" if key.startswith("qz_") else "imatrix"]
    got = fast_quantize(data["x"].astype(np.float32), T[key[3:]], imatrix=weights)
    assert np.array_equal(got, data[key]), _first_diff(got, data[key])


@pytest.mark.parametrize("qtype", IMATRIX_TYPES)
def test_reference_imatrix_quantize_is_byte_identical_to_llama_cpp(qtype):
    nasty, rand = fixture_set("nasty256"), fixture_set("random1024")
    for data, rows, key, weights in ((nasty, slice(3, 9), "qw", "imatrix"), (nasty, slice(9, 12), "qz", "imatrix_sparse"),
                                     (rand, slice(0, 1), "qz", "imatrix_sparse")):
        got = codec.reference_quantize(data["x"][rows].astype(np.float32), T[qtype], imatrix=data[weights])
        want = data[f"{key}_{qtype}"][rows]
        assert np.array_equal(got, want), _first_diff(got, want)


@pytest.mark.parametrize("qtype", IMATRIX_TYPES)
def test_fast_imatrix_equals_reference_on_new_inputs(qtype):
    x = _extra_inputs(256)[[0, 2, 5]]
    rng = np.random.default_rng(99)
    weights = np.where(rng.random(256) < 0.2, 0.0, rng.lognormal(0, 2, 256)).astype(np.float32)
    fast = codec.quantize(x, T[qtype], imatrix=weights)
    ref = codec.reference_quantize(x, T[qtype], imatrix=weights)
    assert np.array_equal(fast, ref), _first_diff(fast, ref)
    assert not np.array_equal(fast, codec.quantize(x, T[qtype]))  # the weights do steer the result


@pytest.mark.parametrize("qtype", IMATRIX_TYPES)
def test_single_block_inputs_match_reference(qtype):
    """One block per chunk: every accumulator is a lone column, which numpy would sum pairwise."""
    rng = np.random.default_rng(17)
    n = 256 if qtype in K_TYPES else 32
    x = (rng.standard_normal((1, n)) * 0.05).astype(np.float16).astype(np.float32)
    weights = rng.gamma(0.7, 1.0, n).astype(np.float32)
    assert np.array_equal(codec.quantize(x, T[qtype]), codec.reference_quantize(x, T[qtype]))
    assert np.array_equal(codec.quantize(x, T[qtype], imatrix=weights),
                          codec.reference_quantize(x, T[qtype], imatrix=weights))


def test_seq_sum_adds_in_index_order():
    from hf2q.ggml.common import seq_sum

    rng = np.random.default_rng(2)
    for shape in ((32, 1), (16, 3), (8, 1000), (256,)):
        a = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, shape)).astype(np.float32)
        running = a[0].copy()
        for row in a[1:]:
            running = running + row
        assert _same_bits(np.atleast_1d(seq_sum(a)), np.atleast_1d(running))


def test_imatrix_is_ignored_by_types_that_ignore_it_in_llama_cpp():
    x = _extra_inputs(256)
    weights = np.linspace(0.1, 3, 256, dtype=np.float32)
    for name in ("Q8_0", "F16", "BF16", "F32"):
        assert np.array_equal(codec.quantize(x, T[name], imatrix=weights), codec.quantize(x, T[name]))


def test_bad_imatrix_raises_input_error():
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(InputError, match="imatrix has 255 weights"):
        codec.quantize(x, T.Q4_K, imatrix=np.ones(255, np.float32))
    with pytest.raises(InputError, match="non-negative"):
        codec.quantize(x, T.Q4_K, imatrix=-np.ones(256, np.float32))


def test_round_trip_error_orders_by_bit_width():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 1024)) * 0.02).astype(np.float16).astype(np.float32)

    def rmse(name):
        back = codec.dequantize(codec.quantize(x, T[name]), T[name], x.shape)
        return float(np.sqrt(np.mean((back - x) ** 2)))

    errs = {name: rmse(name) for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16")}
    order = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]
    assert all(errs[a] > errs[b] for a, b in itertools.pairwise(order)), errs
    assert errs["F16"] == 0.0  # input is already F16-exact
    assert errs["Q8_0"] < 0.01 * 0.02 and errs["Q2_K"] < 0.5 * 0.02, errs
    for low, high in (("Q4_0", "Q5_0"), ("Q4_1", "Q5_1"), ("Q4_0", "Q4_K")):
        assert rmse(low) > rmse(high)


def test_threads_and_chunking_do_not_change_bytes(monkeypatch):
    monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 1024)  # many chunks even on a small matrix
    x = _extra_inputs(2048)
    for name in ("Q4_K", "Q6_K", "Q8_0"):
        one = codec.quantize(x, T[name], threads=1)
        assert np.array_equal(codec.quantize(x, T[name], threads=3), one)
        monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 1 << 16)
        assert np.array_equal(codec.quantize(x, T[name], threads=1), one)
        monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 1024)


needs_numba = pytest.mark.skipif(not codec.numba_installed(), reason="numba is not installed")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_TYPES)


def _awkward_rows(n: int) -> np.ndarray:
    """_extra_inputs plus rows that hit the degenerate branches: zeros, a constant, one spike, tiny values."""
    spike = np.zeros(n)
    spike[5] = 3.0
    tiny = np.random.default_rng(8).standard_normal(n) * 1e-7
    rows = np.vstack([_extra_inputs(n), np.zeros(n), np.full(n, 0.25), spike, tiny])
    return rows.astype(np.float16).astype(np.float32)


@needs_numba
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_jit_and_numpy_paths_agree(qtype, monkeypatch):
    """Three super-blocks (24 legacy blocks) per row so SIMD batches end mid-matrix, chunks that
    start mid-row (imatrix positions must follow), several threads, with and without imatrix."""
    x = _awkward_rows(768)
    rng = np.random.default_rng(77)
    weights = np.where(rng.random(768) < 0.15, 0.0, rng.lognormal(0, 1.5, 768)).astype(np.float32)
    for imatrix in (None, weights):
        want = codec.numpy_quantize(x, T[qtype], threads=1, imatrix=imatrix)
        assert np.array_equal(codec.jit_quantize(x, T[qtype], threads=1, imatrix=imatrix), want)
        monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 512)  # 2 super-blocks / 16 blocks per chunk
        got = codec.jit_quantize(x, T[qtype], threads=3, imatrix=imatrix)
        monkeypatch.undo()
        assert np.array_equal(got, want), _first_diff(got, want)


@needs_numba
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", *K_TYPES])
def test_jit_path_equals_reference_on_new_inputs(qtype):
    x = _awkward_rows(256)[[0, 2, 5, 6, 7, 8]]
    weights = np.random.default_rng(4).gamma(0.5, 1.0, 256).astype(np.float32)
    for imatrix in (None, weights):
        got = codec.jit_quantize(x, T[qtype], imatrix=imatrix)
        want = codec.reference_quantize(x, T[qtype], imatrix=imatrix)
        assert np.array_equal(got, want), _first_diff(got, want)


def test_read_only_input_is_accepted():
    """Memory-mapped checkpoints arrive as read-only arrays; every path must take them as they are."""
    data = fixture_set("random1024")
    x = data["x"].astype(np.float32)
    x.flags.writeable = False
    for name in ("Q4_K", "Q5_0"):
        assert np.array_equal(codec.quantize(x, T[name]), data[f"q_{name}"])
        assert np.array_equal(codec.quantize(x, T[name], imatrix=data["imatrix"]), data[f"qw_{name}"])


def test_no_jit_env_selects_the_numpy_path(monkeypatch):
    data = fixture_set("random1024")
    monkeypatch.setenv("HF2Q_NO_JIT", "1")
    assert not codec.jit_active()

    def refuse(*args, **kwargs):
        raise AssertionError("the compiled path ran although HF2Q_NO_JIT=1")

    monkeypatch.setattr(codec, "_quantize_jit", refuse)
    for name in ("Q4_K", "Q8_0"):
        assert np.array_equal(codec.quantize(data["x"].astype(np.float32), T[name]), data[f"q_{name}"])
    monkeypatch.setenv("HF2Q_NO_JIT", "0")
    assert codec.jit_active() == codec.numba_installed()


def test_unusable_numba_falls_back_to_numpy(monkeypatch, caplog):
    """An installed numba whose kernels fail to load is reported once; quantize keeps working."""
    import sys

    from hf2q.errors import ConversionError

    data = fixture_set("random1024")
    monkeypatch.delenv("HF2Q_NO_JIT", raising=False)
    monkeypatch.setattr(codec, "_JIT_BROKEN", None)
    monkeypatch.setitem(sys.modules, "hf2q.ggml.jit_kquants", None)  # import now raises ImportError
    got = codec.quantize(data["x"].astype(np.float32), T.Q4_K)
    assert np.array_equal(got, data["q_Q4_K"])
    if codec.numba_installed():
        assert "compiled quantizers unavailable" in caplog.text
        assert not codec.jit_active()
        with pytest.raises(ConversionError, match="could not be loaded"):
            codec.jit_quantize(data["x"].astype(np.float32), T.Q4_K)


@needs_numba
def test_jit_float_helpers_match_numpy_rounding():
    """The compiled fp16 / nearest_int helpers against numpy's conversions and ggml_common, bit for bit."""
    from hf2q.ggml import jit_common as jc
    from hf2q.ggml.common import fp16_bits, nearest_int

    rng = np.random.default_rng(21)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                        0x477FEFFF, 0x477FF000, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001, 0x32FFFFFF,
                        0x3F801000, 0x3F803000, 0x3F802FFF, 0x4B400000, 0xCB400001, 0x5F000000], dtype=np.uint32)
    halfish = (rng.standard_normal(6000) * 10.0 ** rng.uniform(-9, 5, 6000)).astype(np.float32)
    values = np.concatenate([rng.integers(0, 2**32, 6000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                             special.view(np.float32), halfish])
    got = np.array([jc.fp16_bits(v) for v in values], dtype=np.uint16)
    assert np.array_equal(got, fp16_bits(values))
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    back = np.array([jc.half_f32(np.int64(h)) for h in halves], dtype=np.float32)
    want = halves.view(np.float16).astype(np.float32)
    nan = np.isnan(want)  # returning a signalling NaN to Python (as a double) quiets it: compare NaN-ness
    assert np.array_equal(np.isnan(back), nan)
    assert np.array_equal(back[~nan].view(np.uint32), want[~nan].view(np.uint32))
    with np.errstate(all="ignore"):
        wide = np.concatenate([halfish * 1e3, values[np.isfinite(values)][:3000]])
        assert np.array_equal(np.array([jc.nearest_int(v) for v in wide]), nearest_int(wide))


def test_row_bytes_and_shapes_follow_ggml_sizes():
    for qtype in codec.SUPPORTED:
        blk, size = GGML_QUANT_SIZES[qtype]
        n = 256 * 3
        assert codec.row_bytes(qtype, n) == n // blk * size
        x = np.zeros((2, n), np.float32)
        q = codec.quantize(x, qtype)
        assert q.shape == (2, codec.row_bytes(qtype, n))
        assert codec.dequantize(q, qtype, (1, 2, n)).shape == (1, 2, n)


def test_bad_input_raises_input_error():
    with pytest.raises(InputError, match="multiple of 256"):
        codec.quantize(np.zeros((1, 96), np.float32), T.Q4_K)
    with pytest.raises(InputError, match="not supported"):
        codec.quantize(np.zeros((1, 256), np.float32), T.IQ2_XXS)
    with pytest.raises(InputError, match="unknown GGML type"):
        codec.row_bytes(999, 256)
    with pytest.raises(InputError, match="does not match shape"):
        codec.dequantize(np.zeros(10, np.uint8), T.Q8_0, (1, 32))
    with pytest.raises(InputError, match="matrix"):
        codec.quantize(np.zeros((1, 1, 32), np.float32), T.Q8_0)
    bad = np.zeros((2, 256), np.float32)
    bad[1, 7] = np.inf
    with pytest.raises(InputError, match="NaN or infinite"):
        codec.quantize(bad, T.Q4_K)
    big = np.full((1, 256), 3e38, np.float32)  # the sum overflows, the values are finite
    assert codec.quantize(big, T.Q8_0).shape == (1, 272)


@pytest.mark.slow
@pytest.mark.llamacpp
def test_real_weights_match_live_llama_cpp(llama_cpp_bin):
    """SmolLM2's stored weights (already 4-bit: many exact ties) re-quantized by us and by the
    llama.cpp build itself, with and without an imatrix, for every type."""
    import gguf

    from hf2q.fetch import SMOLLM2, fetch
    from tests.tools.make_quant_fixtures import Ggml

    ggml = Ggml(llama_cpp_bin)
    reader = gguf.GGUFReader(fetch(SMOLLM2))
    tensors = {t.name: t for t in reader.tensors}

    def rows(name, n):
        t = tensors[name]
        raw = np.asarray(t.data).reshape(-1, codec.row_bytes(t.tensor_type, int(t.shape[0])))[:n]
        return gguf_quants.dequantize(raw, t.tensor_type).astype(np.float16).astype(np.float32)

    ffn_down, embd = rows("blk.3.ffn_down.weight", 24), rows("token_embd.weight", 48)
    rng = np.random.default_rng(3)
    for x, names in ((ffn_down, ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_TYPES]),
                     (embd, ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])):
        imatrix = rng.gamma(0.8, 1.0, x.shape[1]).astype(np.float32)
        for name in names:
            ours = codec.quantize(x, T[name])
            assert np.array_equal(ours, ggml.quantize(x, name)), f"{name}: {_first_diff(ours, ggml.quantize(x, name))}"
            assert _same_bits(codec.dequantize(ours, T[name], x.shape), ggml.dequantize(ours, name, x.shape))
            if name in IMATRIX_TYPES:
                assert np.array_equal(codec.quantize(x, T[name], imatrix=imatrix), ggml.quantize(x, name, imatrix))


@pytest.mark.llamacpp
def test_unrounded_float32_inputs_match_live_llama_cpp(llama_cpp_bin):
    """Beyond the F16-rounded contract: raw float32 from 1e-40 to 1e36 (squares overflow to inf,
    scales become NaN) still gives llama.cpp's bytes."""
    from tests.tools.make_quant_fixtures import Ggml

    ggml = Ggml(llama_cpp_bin)
    rng = np.random.default_rng(11)
    for scale in (1e-40, 1e-30, 1.0, 3e19, 1e36):
        x = (rng.standard_normal((2, 512)) * scale).astype(np.float32)
        imatrix = rng.gamma(0.7, 1.0, 512).astype(np.float32)
        for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_TYPES, "F16", "BF16"):
            with np.errstate(all="ignore"):
                assert np.array_equal(codec.quantize(x, T[name]), ggml.quantize(x, name)), (scale, name)
                if name in IMATRIX_TYPES:
                    assert np.array_equal(codec.quantize(x, T[name], imatrix=imatrix),
                                          ggml.quantize(x, name, imatrix)), (scale, name, "imatrix")
