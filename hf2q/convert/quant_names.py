"""The ``--quant`` names (README, "Using it") → llama.cpp file type and default tensor type.

A name is a *mix*: ``q4_k_m`` means "Q4_K by default, with the tensors llama.cpp's policy
upgrades" (see ``policy.py``). ``general.file_type`` stores the llama.cpp ftype number.
"""

from __future__ import annotations

import attrs
import gguf

from hf2q.errors import InputError, did_you_mean

T = gguf.GGMLQuantizationType
F = gguf.LlamaFileType


@attrs.frozen
class QuantName:
    name: str
    ftype: gguf.LlamaFileType
    default_type: gguf.GGMLQuantizationType
    needs_imatrix: bool = False

    @property
    def is_float(self) -> bool:
        return self.default_type in (T.F32, T.F16, T.BF16)


GGUF_QUANTS: dict[str, QuantName] = {q.name: q for q in (
    QuantName("f32", F.ALL_F32, T.F32),
    QuantName("f16", F.MOSTLY_F16, T.F16),
    QuantName("bf16", F.MOSTLY_BF16, T.BF16),
    QuantName("q4_0", F.MOSTLY_Q4_0, T.Q4_0),
    QuantName("q4_1", F.MOSTLY_Q4_1, T.Q4_1),
    QuantName("q5_0", F.MOSTLY_Q5_0, T.Q5_0),
    QuantName("q5_1", F.MOSTLY_Q5_1, T.Q5_1),
    QuantName("q8_0", F.MOSTLY_Q8_0, T.Q8_0),
    QuantName("q2_k", F.MOSTLY_Q2_K, T.Q2_K),
    QuantName("q2_k_s", F.MOSTLY_Q2_K_S, T.Q2_K, needs_imatrix=True),
    QuantName("q3_k_s", F.MOSTLY_Q3_K_S, T.Q3_K),
    QuantName("q3_k_m", F.MOSTLY_Q3_K_M, T.Q3_K),
    QuantName("q3_k_l", F.MOSTLY_Q3_K_L, T.Q3_K),
    QuantName("q4_k_s", F.MOSTLY_Q4_K_S, T.Q4_K),
    QuantName("q4_k_m", F.MOSTLY_Q4_K_M, T.Q4_K),
    QuantName("q5_k_s", F.MOSTLY_Q5_K_S, T.Q5_K),
    QuantName("q5_k_m", F.MOSTLY_Q5_K_M, T.Q5_K),
    QuantName("q6_k", F.MOSTLY_Q6_K, T.Q6_K),
)}

MLX_QUANTS = tuple([f"mlx-{b}" for b in (2, 3, 4, 5, 6, 8)]
                   + [f"mlx-mixed-{m}" for m in ("2-6", "3-4", "3-6", "4-6")])

# the GGUF names a parity test checks against llama.cpp (q2_k_s needs an imatrix)
PARITY_GGUF_NAMES = tuple(n for n, q in GGUF_QUANTS.items() if not q.needs_imatrix)


def parse_gguf_quant(name: str | None) -> QuantName:
    if not name:
        raise InputError("--quant is required (e.g. --quant q4_k_m; choices: " + ", ".join(GGUF_QUANTS) + ")")
    key = name.strip().lower()
    if key in GGUF_QUANTS:
        return GGUF_QUANTS[key]
    if key in MLX_QUANTS or key.startswith("dwq"):
        raise InputError(f"--quant {name} is an mlx quantization; add --format mlx")
    raise InputError(f"unknown quantization {name!r}" + did_you_mean(key, list(GGUF_QUANTS) + list(MLX_QUANTS)))
