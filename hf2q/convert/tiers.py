"""Mixed-bit tiers: per-tensor GGML types chosen by a plan instead of a fixed llama.cpp mix.

Two kinds (docs/QUALITY.md, "Mixed-bit tiers"):

* **dynamic** (``dynamic-q2|q3|q4``): a *budget* — the bytes llama.cpp's own mix of the same
  size class (``q2_k`` / ``q3_k_m`` / ``q4_k_m``) spends on this model's quantized tensors —
  and a *distortion* per tensor and candidate type: the measured relative quantization error
  of that tensor at that type (``sensitivity.py``) times how much the tensor matters
  (``importance``). ``allocate`` spends the budget where a bit buys the most distortion
  reduction (a Lagrangian sweep, then a greedy fill of what is left).
* **apex** (``apex-quality|balanced|compact``, ``apex-i-*``; MoE only): tables by tensor *role*
  (routed experts, shared experts, attention, embeddings; the router stays F32 as in llama.cpp)
  and *layer band* (edge layers above the middle ones), after the published APEX idea that routed
  experts tolerate fewer bits than everything they feed. The table fixes the budget (its bytes)
  and a window of types around each entry (``apex_candidates``); within those the measured
  distortion decides, as for the dynamic tiers.

Everything here is pure and deterministic: the same facts and measurements give the same
plan. llama.cpp's hard rules still hold — only tensors it would quantize are planned, a type
is a candidate only if the row length is a multiple of its block, and a row length no block
divides stays F16.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import attrs
import gguf

from hf2q.errors import InputError

T = gguf.GGMLQuantizationType

BLOCK32_CANDIDATES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # any row a multiple of 32
# rows a multiple of 256 add the K-quants; the 32-block types stay in: which is better is measured
K_CANDIDATES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K) + BLOCK32_CANDIDATES
# the logits matrix (and a tied embedding that serves as one) never goes below this many bits/weight
OUTPUT_MIN_BPW = 5.5


def bits_per_weight(qtype: T) -> float:
    blk, size = gguf.GGML_QUANT_SIZES[qtype]
    return 8.0 * size / blk


def tensor_bytes(qtype: T, n_elements: int) -> int:
    blk, size = gguf.GGML_QUANT_SIZES[qtype]
    return n_elements // blk * size


# ----------------------------------------------------------------------------- roles
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def layer_of(name: str) -> int | None:
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def role(name: str) -> str:
    """What a quantizable tensor does: the unit both the importance model and the APEX tables use."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    if "_exps." in name:
        return "expert"
    if "_shexp." in name:
        return "shared"
    for key in ("attn_v", "attn_qkv", "attn_kv_b", "attn_k", "attn_q", "attn_output", "attn_gate",
                "ffn_down", "ffn_up", "ffn_gate"):
        if f".{key}." in name:
            return key
    if ".ssm_" in name:
        return "ssm"
    return "other"


def position_band(layer: int | None, n_layer: int) -> str:
    """``edge`` (first / last eighth of the blocks, at least one each side), ``near`` (the next
    eighth inwards) or ``middle``; tensors outside the blocks count as ``edge``."""
    if layer is None or n_layer <= 0:
        return "edge"
    eighth = max(1, n_layer // 8)
    d = min(layer, n_layer - 1 - layer)
    return "edge" if d < eighth else "near" if d < 2 * eighth else "middle"


# ------------------------------------------------------------------------ importance
# Relative weight of one unit of relative error in a block tensor, by role. Errors of the
# tensors that write into the residual stream (attn_v → attn_output, ffn_down) reach the
# logits undamped; q/k errors are squashed by the softmax; gate/up errors pass through the
# activation. Set from that reasoning, not fitted; docs/QUALITY.md has the KL it gives.
ROLE_WEIGHT: Mapping[str, float] = {
    "attn_q": 0.5, "attn_k": 0.5, "attn_v": 1.5, "attn_qkv": 1.0, "attn_kv_b": 1.0, "attn_output": 1.0,
    "attn_gate": 0.5, "ffn_gate": 0.75, "ffn_up": 1.0, "ffn_down": 1.5, "expert": 1.0, "shared": 1.5,
    "ssm": 1.0, "other": 1.0,
}
BAND_WEIGHT: Mapping[str, float] = {"edge": 2.0, "near": 1.25, "middle": 1.0}
# the embedding / logits matrices against one block tensor: each block tensor is one of n_layer
# contributions to the residual, the logits matrix acts alone on it
EMBED_WEIGHT_PER_LAYER = 0.25
OUTPUT_WEIGHT_PER_LAYER = 1.0


def importance(name: str, n_layer: int, tied_output: bool) -> float:
    """How much a unit of relative quantization error of tensor ``name`` costs (the model in
    docs/QUALITY.md): role × layer band, and for the embedding / logits matrices a weight that
    grows with depth, since a block tensor's error is one of ``n_layer`` in the residual."""
    r = role(name)
    n = max(1, n_layer)
    if r == "output" or (r == "token_embd" and tied_output):
        return OUTPUT_WEIGHT_PER_LAYER * n
    if r == "token_embd":
        return EMBED_WEIGHT_PER_LAYER * n
    return ROLE_WEIGHT.get(r, 1.0) * BAND_WEIGHT[position_band(layer_of(name), n_layer)]


def candidates(name: str, ncols: int, tied_output: bool) -> tuple[T, ...]:
    """The types a dynamic tier may give this tensor: those whose block divides the row, and for
    the logits matrix only those of at least ``OUTPUT_MIN_BPW`` bits; F16 when no block fits."""
    if ncols % 256 == 0:
        out = K_CANDIDATES
    elif ncols % 32 == 0:
        out = BLOCK32_CANDIDATES
    else:
        return (T.F16,)
    r = role(name)
    if r == "output" or (r == "token_embd" and tied_output):
        out = tuple(q for q in out if bits_per_weight(q) >= OUTPUT_MIN_BPW)
    return out


# ------------------------------------------------------------------------ allocation
@attrs.frozen
class Choice:
    """One planned tensor: its size, how much it matters, and its measured error per candidate."""

    name: str
    n_elements: int
    importance: float
    errors: Mapping[T, float]  # candidate type → relative (importance-weighted) error

    def cost(self, q: T) -> int:
        return tensor_bytes(q, self.n_elements)

    def distortion(self, q: T) -> float:
        return self.importance * self.errors[q]

    def options(self) -> list[T]:
        """Candidates by size, then by error; a candidate no cheaper and no better than another is dropped."""
        opts = sorted(self.errors, key=lambda q: (self.cost(q), self.errors[q], int(q)))
        kept: list[T] = []
        for q in opts:
            if kept and self.errors[q] >= self.errors[kept[-1]]:
                continue
            kept.append(q)
        return kept


def _pick(c: Choice, opts: list[T], lam: float) -> T:
    return min(opts, key=lambda q: (c.distortion(q) + lam * c.cost(q), c.cost(q)))


def allocate(choices: Sequence[Choice], budget_bytes: int) -> list[T]:
    """A type per choice minimising Σ distortion with Σ bytes ≤ ``budget_bytes``.

    Lagrangian relaxation: for a price λ per byte each tensor takes the candidate minimising
    distortion + λ·bytes; λ is bisected to the cheapest price that fits. The leftover bytes then
    go, one upgrade at a time, to the upgrade with the best distortion drop per byte. When even
    the smallest candidates do not fit, those are returned (the caller reports the overrun)."""
    if not choices:
        return []
    opts = [c.options() for c in choices]
    smallest = [o[0] for o in opts]
    if sum(c.cost(q) for c, q in zip(choices, smallest)) >= budget_bytes:
        return smallest

    def plan_at(lam: float) -> list[T]:
        return [_pick(c, o, lam) for c, o in zip(choices, opts)]

    def size(plan: list[T]) -> int:
        return sum(c.cost(q) for c, q in zip(choices, plan))

    best = plan_at(0.0)
    if size(best) > budget_bytes:
        hi = 1.0
        while size(plan_at(hi)) > budget_bytes:
            hi *= 16.0
        lo = hi
        while size(plan_at(lo)) <= budget_bytes:
            lo /= 16.0
        for _ in range(64):  # geometric bisection: lo too big, hi fits
            mid = math.sqrt(lo * hi)
            if size(plan_at(mid)) > budget_bytes:
                lo = mid
            else:
                hi = mid
        best = plan_at(hi)
    return _fill(choices, opts, best, budget_bytes - size(best))


def _fill(choices: Sequence[Choice], opts: list[list[T]], plan: list[T], left: int) -> list[T]:
    plan = list(plan)
    while True:
        best: tuple[float, int, T] | None = None
        for i, (c, o) in enumerate(zip(choices, opts)):
            cur = plan[i]
            for q in o:
                extra = c.cost(q) - c.cost(cur)
                gain = c.distortion(cur) - c.distortion(q)
                if extra <= 0 or extra > left or gain <= 0:
                    continue
                ratio = gain / extra
                if best is None or ratio > best[0]:
                    best = (ratio, i, q)
        if best is None:
            return plan
        _, i, q = best
        left -= choices[i].cost(q) - choices[i].cost(plan[i])
        plan[i] = q


# ------------------------------------------------------------------------------ APEX
@attrs.frozen
class ApexTable:
    """Types by role and layer band; ``expert`` is keyed by band, the rest take one type."""

    expert: Mapping[str, T]
    shared: T
    attention: T
    token_embd: T
    output: T


APEX_TABLES: Mapping[str, ApexTable] = {
    "quality": ApexTable({"edge": T.Q6_K, "near": T.Q5_K, "middle": T.Q5_K}, T.Q8_0, T.Q6_K, T.Q6_K, T.Q8_0),
    "balanced": ApexTable({"edge": T.Q5_K, "near": T.Q5_K, "middle": T.Q4_K}, T.Q6_K, T.Q5_K, T.Q5_K, T.Q6_K),
    "compact": ApexTable({"edge": T.Q4_K, "near": T.Q4_K, "middle": T.Q3_K}, T.Q5_K, T.Q4_K, T.Q4_K, T.Q6_K),
}
_ATTENTION_ROLES = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_kv_b", "attn_output", "attn_gate", "ssm")


def apex_level(tier_name: str) -> str:
    return tier_name.removeprefix("apex-").removeprefix("i-")


def apex_type(table: ApexTable, name: str, n_layer: int, tied_output: bool = False) -> T:
    """The table's type for ``name`` before the row-length fallback; dense FFNs beside the experts
    (Gemma 4's MLP) and anything unclassified take the shared experts' type, and a tied embedding,
    being the logits matrix too, takes the output's."""
    r = role(name)
    if r == "token_embd" and tied_output and name == "token_embd.weight":
        return table.output
    if r == "expert":
        return table.expert[position_band(layer_of(name), n_layer)]
    if r in _ATTENTION_ROLES:
        return table.attention
    if r == "token_embd":
        return table.token_embd
    if r == "output":
        return table.output
    return table.shared


# an APEX tensor may move this far (bits/weight) from its table type, so the roles keep their tiers;
# 3 reaches Q8_0 from the 5-bit types, the step llama.cpp's own mixes take for attn_v and the logits
APEX_WINDOW_BPW = 3.0


def apex_candidates(table_type: T, name: str, ncols: int, tied_output: bool) -> tuple[T, ...]:
    """The types an APEX tier may give this tensor: the dynamic candidates within ``APEX_WINDOW_BPW`` of
    the table's type (the table's type among them), or the table's type alone where the dynamic tiers
    would not take it (F16, or a type the row's width omits)."""
    cands = candidates(name, ncols, tied_output)
    if table_type not in cands:
        return (table_type,)
    return tuple(q for q in cands if abs(bits_per_weight(q) - bits_per_weight(table_type)) <= APEX_WINDOW_BPW)


def check_apex_model(tier_name: str, arch: str, n_expert: int) -> None:
    if n_expert <= 1:
        raise InputError(f"--quant {tier_name} is for mixture-of-experts models and {arch} has no experts; "
                         "use dynamic-q2, dynamic-q3 or dynamic-q4")
