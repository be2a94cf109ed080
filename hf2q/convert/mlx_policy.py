"""What an mlx-lm directory holds: tensor names, which tensors are quantized and with how many bits.

Pure logic (no MLX, no I/O) so every decision is testable on names and shapes alone.
It mirrors what ``mlx_lm.convert`` would produce for the same model, because the output
must load with ``mlx_lm.load``:

* names are the HF names after mlx-lm's ``sanitize`` (tied ``lm_head`` dropped, rotary
  buffers dropped, Qwen3-MoE experts stacked into ``mlp.switch_mlp.*`` 3-D tensors);
* a weight is quantized when its module is a Linear / Embedding / SwitchLinear (2-D or
  stacked 3-D ``.weight``) whose last axis is a multiple of the group size;
* ``mlx-N`` quantizes all of them with N bits, except a Qwen3-MoE router (``mlp.gate``)
  which mlx-lm keeps at 8 bits / group 64;
* ``mlx-mixed-L-H`` is mlx-lm's mixed recipe (after llama.cpp's Q4_K_M idea): ``v_proj`` and
  ``down_proj`` of the first and last eighth of the layers and of every third layer in
  between, plus ``lm_head``, get H bits; everything else L bits.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from hf2q.errors import InputError, did_you_mean

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
MIXED = {"2-6": (2, 6), "3-4": (3, 4), "3-6": (3, 6), "4-6": (4, 6)}
MLX_QUANT_NAMES = tuple([f"mlx-{b}" for b in BITS] + [f"mlx-mixed-{m}" for m in MIXED])
# distilled weight quantization (hf2q.convert.dwq_fit): mlx-N's layout with fitted scales and biases
DWQ_BITS = (3, 4)
DWQ_QUANT_NAMES = tuple(f"dwq-{b}" for b in DWQ_BITS)

# HF model_type → does mlx-lm have a graph for it (among the families hf2q converts)
MLX_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "gemma3_text")

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@attrs.frozen
class MlxQuant:
    name: str
    bits: int  # the default (low) bits
    high_bits: int | None = None  # set for the mixed recipes

    @property
    def mixed(self) -> bool:
        return self.high_bits is not None


@attrs.frozen
class TensorPlan:
    """One output tensor: where its data comes from and how it is stored."""

    name: str  # mlx-lm name, e.g. model.layers.0.mlp.switch_mlp.up_proj.weight
    sources: tuple[str, ...]  # HF tensor names; several = stacked along a new first axis
    shape: tuple[int, ...]
    bits: int | None  # None = kept as float
    group_size: int | None

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


def parse_mlx_quant(name: str | None) -> MlxQuant:
    """``mlx-4`` / ``mlx-mixed-3-6`` → MlxQuant; anything else is a one-line InputError."""
    n = (name or "").strip().lower()
    choices = MLX_QUANT_NAMES + DWQ_QUANT_NAMES
    if not n:
        raise InputError("--quant is required for --format mlx (choices: " + ", ".join(choices) + ")")
    if n in DWQ_QUANT_NAMES:
        return MlxQuant(n, int(n.removeprefix("dwq-")))
    if n == "dwq":
        raise InputError("--quant dwq needs a bit width: dwq-4 or dwq-3")
    if n.startswith("mlx-mixed-") and n.removeprefix("mlx-mixed-") in MIXED:
        low, high = MIXED[n.removeprefix("mlx-mixed-")]
        return MlxQuant(n, low, high)
    if n.startswith("mlx-") and n.removeprefix("mlx-").isdigit() and int(n.removeprefix("mlx-")) in BITS:
        return MlxQuant(n, int(n.removeprefix("mlx-")))
    raise InputError(f"unknown mlx quantization {name!r} (choices: {', '.join(choices)})"
                     + did_you_mean(n, choices))


def check_group_size(group_size: int | None) -> int:
    g = 64 if group_size is None else int(group_size)
    if g not in GROUP_SIZES:
        raise InputError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))} (got {g})")
    return g


def model_type(cfg: dict[str, Any]) -> str:
    mt = cfg.get("model_type")
    if mt not in MLX_MODEL_TYPES:
        raise InputError(f"--format mlx supports model types {', '.join(MLX_MODEL_TYPES)}; "
                         f"this model is {mt!r} (convert it to GGUF instead)")
    return mt


def mlx_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json for mlx-lm: the source config plus the flat keys mlx-lm reads.

    transformers 5 writes ``rope_parameters`` and ``num_local_experts`` where mlx-lm (and the
    older Hub configs) expect ``rope_theta`` / ``rope_local_base_freq`` / ``num_experts``, and
    Gemma 3's layer pattern as ``layer_types`` where mlx-lm wants ``sliding_window_pattern``.
    """
    out = {k: v for k, v in cfg.items() if k not in ("quantization", "quantization_config")}
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" in rp:
            out.setdefault("rope_theta", rp["rope_theta"])
        elif isinstance(rp.get("full_attention"), dict):
            out.setdefault("rope_theta", rp["full_attention"].get("rope_theta", 1000000.0))
            if isinstance(rp.get("sliding_attention"), dict):
                out.setdefault("rope_local_base_freq", rp["sliding_attention"].get("rope_theta", 10000.0))
    if "num_local_experts" in cfg:
        out.setdefault("num_experts", cfg["num_local_experts"])
    types = cfg.get("layer_types")
    if cfg.get("model_type") == "gemma3_text" and isinstance(types, list) and "full_attention" in types:
        out.setdefault("sliding_window_pattern", types.index("full_attention") + 1)
    return out


def _out_names(mt: str, cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]]):
    """Yield (mlx name, source names) after mlx-lm's sanitize for this family."""
    tied = bool(cfg.get("tie_word_embeddings", mt == "gemma3_text"))
    experts: dict[tuple[str, str], dict[int, str]] = {}
    for name in shapes:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and tied:
            continue
        m = re.fullmatch(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m and mt == "qwen3_moe":
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = name
            continue
        yield name, (name,)
    for (prefix, proj), by_index in sorted(experts.items()):
        n = len(by_index)
        if sorted(by_index) != list(range(n)):
            raise InputError(f"{prefix}: experts {sorted(by_index)} are not numbered 0..{n - 1}")
        yield f"{prefix}.switch_mlp.{proj}.weight", tuple(by_index[i] for i in range(n))


def _use_more_bits(layer: int, n_layers: int) -> bool:
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def choose_bits(module: str, shape: tuple[int, ...], quant: MlxQuant, group_size: int,
                n_layers: int, mt: str) -> tuple[int, int] | None:
    """(bits, group_size) for a weight, or None to keep it as float."""
    if len(shape) < 2 or shape[-1] % group_size:
        return None
    if quant.mixed:
        m = _LAYER.search(module + ".")
        layer = int(m.group(1)) if m else 0
        more = _use_more_bits(layer, n_layers)
        if ("v_proj" in module or "down_proj" in module) and more or "lm_head" in module:
            return quant.high_bits, group_size  # type: ignore[return-value]
        return quant.bits, group_size
    if mt == "qwen3_moe" and module.endswith("mlp.gate"):
        return (8, 64) if shape[-1] % 64 == 0 else None
    return quant.bits, group_size


def plan_tensors(cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]], quant: MlxQuant,
                 group_size: int) -> list[TensorPlan]:
    """Every output tensor of the mlx-lm directory, in name order."""
    mt = model_type(cfg)
    n_layers = int(cfg.get("num_hidden_layers") or 0)
    plans = []
    for name, sources in _out_names(mt, cfg, shapes):
        first = shapes[sources[0]]
        if any(shapes[s] != first for s in sources):
            raise InputError(f"{name}: stacked tensors have different shapes")
        shape = (len(sources), *first) if len(sources) > 1 else first
        # only weights of Linear / Embedding / SwitchLinear modules are quantizable: all our
        # families keep every such weight in a >= 2-D ".weight" and everything else 1-D
        choice = choose_bits(name.removesuffix(".weight"), shape, quant, group_size, n_layers, mt) \
            if name.endswith(".weight") else None
        bits, gs = choice if choice else (None, None)
        plans.append(TensorPlan(name, sources, shape, bits, gs))
    return sorted(plans, key=lambda p: p.name)


def quantization_config(plans: list[TensorPlan], quant: MlxQuant, group_size: int) -> dict[str, Any]:
    """config.json ``quantization``: the defaults plus per-module overrides where they differ."""
    q: dict[str, Any] = {"group_size": group_size, "bits": quant.bits, "mode": "affine"}
    for p in plans:
        if p.bits is None:
            continue
        if quant.mixed or (p.bits, p.group_size) != (quant.bits, group_size):
            q[p.module] = {"group_size": p.group_size, "bits": p.bits, "mode": "affine"}
    return q


def quantized_bytes(shape: tuple[int, ...], bits: int, group_size: int, float_bytes: int) -> int:
    """Bytes of packed weight (uint32 words) + per-group scales and biases."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    n = shape[-1]
    return rows * (n * bits // 32) * 4 + 2 * rows * (n // group_size) * float_bytes
