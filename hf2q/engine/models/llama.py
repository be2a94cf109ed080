"""Llama family (SmolLM2, Llama 2/3 shapes): SwiGLU, RMSNorm, GGUF "normal" RoPE.

llama.cpp's converter permutes the q/k rows of Llama checkpoints so that rotary pairs
are adjacent; on GGUF weights that is MLX's ``traditional=True`` RoPE.

RoPE scaling (shared with the families built on :func:`common_config`) follows llama.cpp's
``ggml_rope_ext``: the angle of pair ``i`` at position ``p`` is
``p · freq_scale · base^(-2i/d) / ff[i]``, blended towards the unscaled angle by YaRN's ramp.

* ``rope.scaling.type linear`` → ``freq_scale = 1/factor`` (MLX ``scale``).
* ``rope_freqs.weight`` (Llama 3.x, written by the converter for ``rope_type: llama3``) →
  the per-pair divisors ``ff``.
* ``rope.scaling.type yarn`` → YaRN's per-pair blend of interpolated and extrapolated
  frequencies, and its attention temperature folded into the softmax scale.

The last two become a custom period per pair, ``mx.fast.rope(..., base=None, freqs=periods)``
(MLX rotates pair ``i`` by ``p · scale / periods[i]``); ``DecoderConfig.rope_freqs`` holds them.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from hf2q.engine.layers import GatedMLP, float_array
from hf2q.engine.models.decoder import DecoderConfig, DecoderModel
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile

_KNOWN_SCALING = (None, "none", "linear", "yarn")


def common_config(g: GGUFFile, *, traditional: bool) -> DecoderConfig:
    hp = g.hparams
    n_heads, n_kv = hp.uniform_heads()
    embd = g.tensor("token_embd.weight")
    cfg = DecoderConfig(
        n_layers=hp.n_layers, hidden=hp.hidden, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=hp.key_length, vocab=int(embd.shape[0]), n_ctx_train=hp.n_ctx_train,
        norm_eps=hp.rms_eps, rope_base=hp.rope_base, rope_dims=hp.rope_dims,
        rope_traditional=traditional,
    )
    apply_rope_scaling(g, cfg)
    return cfg


def apply_rope_scaling(g: GGUFFile, cfg: DecoderConfig) -> None:
    """Set ``rope_scale`` / ``rope_freqs`` / ``attn_scale`` from the GGUF's rope scaling, or refuse it."""
    hp = g.hparams
    scaling = hp.rope_scaling
    if scaling not in _KNOWN_SCALING:
        raise InputError(f"{g.path.name}: rope scaling {scaling!r} is not supported "
                         "(supported: linear, yarn, Llama 3 rope_freqs)")
    factor = hp.rope_scaling_factor
    d = cfg.rope_dims
    exponents = np.arange(0, d // 2, dtype=np.float64) * 2.0 / d
    periods = cfg.rope_base ** exponents  # MLX's default periods: base^(2i/d)
    custom = False
    if scaling == "linear" and factor != 1.0:
        cfg.rope_scale = 1.0 / factor
    if scaling == "yarn" and factor > 1.0:
        periods, mscale = _yarn_periods(g, cfg, factor, periods)
        cfg.attn_scale = cfg.head_dim ** -0.5 * mscale * mscale  # q and k both carry the temperature
        custom = True
    if "rope_freqs.weight" in g.tensors:
        divisors = np.asarray(float_array(g.tensor("rope_freqs.weight"), mx.float32), dtype=np.float64).reshape(-1)
        if divisors.shape != (d // 2,):
            raise InputError(f"{g.path.name}: rope_freqs.weight has {divisors.size} values, expected {d // 2} "
                             f"(rope dimension {d} / 2)")
        if not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
            raise InputError(f"{g.path.name}: rope_freqs.weight holds non-positive or non-finite values")
        periods = periods * divisors
        custom = True
    if custom:
        cfg.rope_freqs = mx.array(periods.astype(np.float32))


def _yarn_periods(g: GGUFFile, cfg: DecoderConfig, factor: float, periods: np.ndarray) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023) as llama.cpp applies it: a per-pair ramp between the interpolated
    (``p / factor``) and extrapolated (``p``) angle, and the temperature ``0.1·ln(factor) + 1``.

    Pairs that turn more than ``beta_fast`` times over the original context keep their
    frequency, pairs that turn fewer than ``beta_slow`` times are interpolated, linear in
    between (bounds floored/ceiled to whole pairs, as ggml's ``rope_yarn_corr_dims``).
    """
    name, hp = g.path.name, g.hparams
    ext = hp.yarn_ext_factor
    if ext != 1.0:
        raise InputError(f"{name}: YaRN with yarn_ext_factor {ext} is not supported (only 1.0)")
    if hp.yarn_log_multiplier != 0.0:
        raise InputError(f"{name}: YaRN with yarn_log_multiplier (DeepSeek-style mscale) is not supported")
    n_orig = hp.rope_original_context
    if not n_orig:
        raise InputError(f"{name}: YaRN rope scaling without rope.scaling.original_context_length")
    beta_fast, beta_slow = hp.yarn_beta_fast, hp.yarn_beta_slow
    d, base = cfg.rope_dims, cfg.rope_base
    if cfg.rope_dims != cfg.head_dim:
        raise InputError(f"{name}: YaRN with partial rotary dimensions is not supported")
    if g.arch == "gemma3":  # its own attention scale and local layers: not wired for YaRN's temperature
        raise InputError(f"{name}: YaRN rope scaling on gemma3 is not supported")

    def corr_dim(n_rot: float) -> float:
        return d * math.log(float(n_orig) / (n_rot * 2.0 * math.pi)) / (2.0 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(d - 1.0, math.ceil(corr_dim(beta_slow)))
    i = np.arange(d // 2, dtype=np.float64)
    ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # 1 → keep, 0 → interpolate
    inv = (1.0 / periods) * (ramp + (1.0 - ramp) / factor)
    mscale = (0.1 * math.log(factor) + 1.0) * hp.rope_attn_factor
    return 1.0 / inv, mscale


def gated_mlp(g: GGUFFile, i: int, dtype, act=None) -> GatedMLP:
    p = f"blk.{i}."
    kw = {"act": act} if act else {}
    return GatedMLP.load(*(g.tensor(p + f"ffn_{n}.weight") for n in ("gate", "up", "down")), dtype, **kw)


def build(g: GGUFFile, dtype) -> DecoderModel:
    cfg = common_config(g, traditional=True)
    return DecoderModel(cfg, g, dtype, lambda i: gated_mlp(g, i, dtype))
