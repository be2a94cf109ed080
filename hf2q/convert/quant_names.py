"""The ``--quant`` names (README, "Using it") → llama.cpp file type and default tensor type.

A name is a *mix*: ``q4_k_m`` means "Q4_K by default, with the tensors llama.cpp's policy
upgrades" (see ``policy.py``). ``general.file_type`` stores the llama.cpp ftype number.

A *tier* (``dynamic-q*``, ``apex-*``) has no fixed mix: its per-tensor types come from
``tiers.py``. Its ``ftype`` is the llama.cpp mix it is sized against (dynamic) or whose
default type its routed experts mostly take (APEX), so ``general.file_type`` names the
nearest fixed mix (docs/QUALITY.md, "Mixed-bit tiers").
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
    tier: str | None = None  # "dynamic" / "apex": types chosen by tiers.py, not policy.py
    # what to suggest when needs_imatrix and no --imatrix was given
    no_imatrix_hint: str = "try q2_k or q3_k_s"

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

# mixed-bit tiers (tiers.py): dynamic-q* are sized like the llama.cpp mix named in ftype
TIER_QUANTS: dict[str, QuantName] = {q.name: q for q in (
    QuantName("dynamic-q2", F.MOSTLY_Q2_K, T.Q2_K, tier="dynamic"),
    QuantName("dynamic-q3", F.MOSTLY_Q3_K_M, T.Q3_K, tier="dynamic"),
    QuantName("dynamic-q4", F.MOSTLY_Q4_K_M, T.Q4_K, tier="dynamic"),
    QuantName("apex-quality", F.MOSTLY_Q5_K_M, T.Q5_K, tier="apex"),
    QuantName("apex-balanced", F.MOSTLY_Q4_K_M, T.Q4_K, tier="apex"),
    QuantName("apex-compact", F.MOSTLY_Q3_K_M, T.Q3_K, tier="apex"),
    *(QuantName(f"apex-i-{level}", ftype, qtype, needs_imatrix=True, tier="apex",
                no_imatrix_hint=f"try apex-{level}, its table without the importance matrix")
      for level, ftype, qtype in (("quality", F.MOSTLY_Q5_K_M, T.Q5_K), ("balanced", F.MOSTLY_Q4_K_M, T.Q4_K),
                                  ("compact", F.MOSTLY_Q3_K_M, T.Q3_K))),
)}

# names that are close to something real but not a quantization of their own: name → hint
_REFUSED = {
    "apex": "apex needs a level: apex-quality, apex-balanced or apex-compact "
            "(apex-i-* for the importance-weighted variants, with --imatrix FILE)",
    "dwq": "dwq needs its bit width: dwq-4 or dwq-3, with --format mlx (for GGUF: dwq-q4_1 or dwq-q5_1)",
    "tq1_0": "tq1_0 is a ternary type for models trained ternary (BitNet); hf2q does not write it — "
             "for a small file of an ordinary model try dynamic-q2 or q2_k",
    "tq2_0": "tq2_0 is a ternary type for models trained ternary (BitNet); hf2q does not write it — "
             "for a small file of an ordinary model try dynamic-q2 or q2_k",
}

# the GGUF names a parity test checks against llama.cpp (q2_k_s needs an imatrix)
PARITY_GGUF_NAMES = tuple(n for n, q in GGUF_QUANTS.items() if not q.needs_imatrix)


def parse_gguf_quant(name: str | None) -> QuantName:
    if not name:
        raise InputError("--quant is required (e.g. --quant q4_k_m; choices: " + ", ".join(GGUF_QUANTS) + ")")
    key = name.strip().lower()
    if key in GGUF_QUANTS:
        return GGUF_QUANTS[key]
    if key in TIER_QUANTS:
        return TIER_QUANTS[key]
    if key in _REFUSED:
        raise InputError(f"--quant {name}: {_REFUSED[key]}")
    if key.startswith("dwq-q"):  # hf2q.convert.dwq_gguf: fitted on calibration text, one conversion at a time
        raise InputError(f"--quant {name} (distilled GGUF) is a single conversion: hf2q convert SRC -q {key}")
    if key in MLX_QUANTS or key.startswith("dwq-"):
        raise InputError(f"--quant {name} is an mlx quantization; add --format mlx")
    raise InputError(f"unknown quantization {name!r}"
                     + did_you_mean(key, list(GGUF_QUANTS) + list(TIER_QUANTS) + list(MLX_QUANTS)))
