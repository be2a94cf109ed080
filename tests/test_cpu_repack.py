"""The C repack of GGUF blocks (``hf2q/kernels/csrc/cpu_repack.c``) against the numpy reference
(``quant_repack._to_affine_rows``): the same codes, scales and biases bit for bit, on blocks llama.cpp's
quantizer layout produces and on arbitrary bytes (every scale, sign and nibble pattern), in bands whose
destination rows are strided views of a larger buffer as the load's are."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from hf2q.engine import quant_repack
from hf2q.ggml import codec
from hf2q.kernels import cpu_repack
from hf2q.kernels.cpu_build import KernelDimsError


@pytest.fixture(autouse=True)
def _built():
    if cpu_repack.LIBRARY.load() is None:
        pytest.skip(f"the repack kernel is not built here: {cpu_repack.LIBRARY.failure or cpu_repack.LIBRARY.off_reason}")


def _arbitrary(qtype, rows: int, n: int, seed: int) -> np.ndarray:
    """Random bytes with every f16 field finite (the scales a real file can hold)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, n // block, size), dtype=np.uint8)
    f16_at = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}[qtype]
    for at in f16_at:
        raw[..., at + 1] &= 0xBB  # exponent bits below all-ones: no inf/nan, subnormals and both signs kept
    return raw.reshape(rows, -1)


def _check(raw: np.ndarray, qtype, n: int, wide: bool = False) -> None:
    rows = raw.shape[0]
    want = quant_repack._to_affine_rows(raw, qtype, rows, n, wide)
    # destinations with room to spare on each row, as the stacked buffers of a load are cut
    packed = np.zeros((rows, want.packed.shape[1] + 3), np.uint32)[:, 1:1 + want.packed.shape[1]]
    scales = np.zeros((rows, n // 32 + 2), np.float32)[:, :n // 32]
    biases = np.zeros((rows, n // 32 + 2), np.float32)[:, 2:]
    assert cpu_repack.repack_band(raw, qtype, n, packed, scales, biases, wide=wide)
    assert np.array_equal(packed, want.packed)
    assert np.array_equal(scales, want.scales) and np.array_equal(biases, want.biases)


@pytest.mark.parametrize("qtype", sorted(cpu_repack.TYPES), ids=lambda t: t.name)
def test_the_c_repack_equals_numpy_on_quantized_weights(qtype):
    n = 512
    w = (np.random.default_rng(1).standard_normal((19, n)) * 0.03).astype(np.float32)
    w[3] = 0.0  # an all-zero row: zero scales
    _check(codec.quantize(w, qtype), qtype, n)


@pytest.mark.parametrize("qtype", sorted(cpu_repack.TYPES), ids=lambda t: t.name)
def test_the_c_repack_equals_numpy_on_arbitrary_blocks(qtype):
    _check(_arbitrary(qtype, 23, 768, seed=int(qtype)), qtype, 768)


def test_a_wide_repack_stores_the_5_bit_codes_one_a_byte():
    """The CPU's load: Q5_K's codes as 8-bit groups of the same values (the C pass and numpy alike); the other
    types are what they are without it."""
    n = 512
    raw = _arbitrary(T.Q5_K, 7, n, seed=3)
    _check(raw, T.Q5_K, n, wide=True)
    wide, narrow = (quant_repack._to_affine_rows(raw, T.Q5_K, 7, n, w) for w in (True, False))
    assert (wide.bits, narrow.bits) == (8, 5)
    assert np.array_equal(quant_repack.affine_dequantize(wide, n), quant_repack.affine_dequantize(narrow, n))
    for qtype in sorted(cpu_repack.TYPES - {T.Q5_K}):
        _check(_arbitrary(qtype, 5, n, seed=int(qtype)), qtype, n, wide=True)


def test_other_types_and_impossible_bands_are_refused_without_a_write():
    raw = _arbitrary(T.Q8_0, 4, 64, 0)
    packed, scales, biases = np.zeros((4, 16), np.uint32), np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)
    assert not cpu_repack.repack_band(raw, T.Q5_1, 64, packed, scales, biases)  # numpy's type
    with pytest.raises(KernelDimsError):
        cpu_repack.repack_band(raw, T.Q8_0, 48, packed, scales, biases)  # not whole blocks
    with pytest.raises(KernelDimsError):
        cpu_repack.repack_band(raw, T.Q8_0, 64, packed[:3], scales, biases)
    assert not packed.any() and not scales.any()
