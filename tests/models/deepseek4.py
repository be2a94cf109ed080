"""A tiny random DeepSeek-V4 checkpoint in the official inference layout, and its transformers twin.

DeepSeek ships V4 in its own layout (``embed``, ``head``, ``layers.N.attn.wq_a`` …, ``hc_*``) with
FP8 E4M3 matrices scaled per 128×128 block by E8M0 exponents and routed experts packed as MXFP4
(two E2M1 codes a byte, one E8M0 exponent per 32 values). llama.cpp's converter reads exactly that
layout, so the fixture is written that way: a transformers ``deepseek_v4`` model is built from a
small config, every weight is snapped onto the grid its official dtype can hold (BF16, FP8 block,
MXFP4, F32), and both copies are saved:

* ``<dir>/`` — the official layout (``model.safetensors``, ``config.json`` as DeepSeek writes it,
  tokenizer files), what converters read;
* ``<dir>/transformers/`` — ``save_pretrained`` of the same model, whose float32 values are exactly
  the dequantized official values, for logit references.

The config keeps the real model's proportions where llama.cpp's loader and kernels care (4 residual
streams, one KV head, rope dims 1/8 of the head, the indexer head 1/4 of it, the 0 / 4 / 128
compress ratios, the first layers hash-routed, a shared expert) with a hidden size of 128. The head
is 256 wide because llama.cpp rotates the indexer's keys with a Hadamard matrix of at least 64
(so the indexer head, a quarter of the attention head, must be a multiple of 64).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.models.cache import build_once
from tests.models.tokenizer_files import copy_tokenizer, vocab_size

VERSION = "v2"
TOKENIZER = "smollm2"
#: the transformers-layout copy inside a fixture folder
TRANSFORMERS_SUBDIR = "transformers"

#: compress ratio per decoder layer (0 sliding window, 4 compressed sparse, 128 heavily compressed), then the MTP block's
COMPRESS_RATIOS = [0, 4, 128, 4]
MTP_COMPRESS_RATIO = 0
N_HASH_LAYERS = 2

# the DeepSeek-V4 config.json keys (official names) of the tiny shape
CONFIG = {
    "hidden_size": 128, "num_hidden_layers": len(COMPRESS_RATIOS), "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 256, "qk_rope_head_dim": 32, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
    "index_n_heads": 8, "index_head_dim": 64, "index_topk": 16, "sliding_window": 128,
    "moe_intermediate_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "num_hash_layers": N_HASH_LAYERS, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "hidden_act": "silu", "num_nextn_predict_layers": 1,
}

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP8_MAX = 448.0
_BLOCK = 128

# transformers names (after ``model.layers.N.``) → official names (after ``layers.N.``)
_LAYER_NAMES = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
}
_ROOT_NAMES = {
    "model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
# official matrices stored as FP8 E4M3 + E8M0 128×128 block exponents (the rest of the 2-D weights are BF16)
_FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
        "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight")
# official tensors kept in F32 (hyper-connection mixing, sinks, router bias, compressor position bias)
_F32 = ("hc_", "attn_sink", "gate.bias", ".ape")


def deepseek4_checkpoint(mtp: bool = False) -> Path:
    """The cached fixture folder (built on first use, then reused)."""
    name = f"tiny-deepseek4{'_mtp' if mtp else ''}-{VERSION}"
    return build_once(name, lambda out: build_deepseek4_checkpoint(out, mtp=mtp))


def with_config(checkpoint: Path, out: Path, **changes) -> Path:
    """A variant of ``checkpoint`` in ``out``: ``changes`` in config.json, and links to the files ``out`` lacks."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**json.loads((Path(checkpoint) / "config.json").read_text()), **changes}
    (out / "config.json").write_text(json.dumps(cfg))
    for f in (p for p in Path(checkpoint).iterdir() if p.is_file() and not (out / p.name).exists()):
        (out / f.name).symlink_to(f)
    return out


def transformers_dir(checkpoint: Path) -> Path:
    """The transformers-layout twin of a fixture folder (same values, float32)."""
    return Path(checkpoint) / TRANSFORMERS_SUBDIR


def load_transformers_model(checkpoint: Path):
    """transformers' ``DeepseekV4ForCausalLM`` holding exactly the official checkpoint's (dequantized) values."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(transformers_dir(checkpoint), dtype=torch.float32)
    return model.eval()


def transformers_config(vocab: int):
    import transformers

    c = dict(CONFIG)
    legacy = {k: c.pop(k) for k in ("qk_rope_head_dim", "num_hash_layers", "rope_scaling")}
    return transformers.DeepseekV4Config(vocab_size=vocab, compress_ratios=list(COMPRESS_RATIOS),
                                         qk_rope_head_dim=legacy["qk_rope_head_dim"],
                                         num_hash_layers=legacy["num_hash_layers"],
                                         rope_parameters=dict(legacy["rope_scaling"]), **c)


def build_deepseek4_checkpoint(out_dir: Path, *, mtp: bool = False, seed: int = 0) -> Path:
    """Write the official-layout checkpoint (+ ``transformers/`` twin) into ``out_dir`` and return it."""
    import torch
    import transformers
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size(TOKENIZER)
    config = transformers_config(vocab)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    official: dict[str, torch.Tensor] = {}
    n_exp, ff = CONFIG["n_routed_experts"], CONFIG["moe_intermediate_size"]
    with torch.no_grad():
        for hf_name, p in sorted(model.state_dict().items()):
            name = official_name(hf_name)
            if name.endswith("ffn.gate.tid2eid"):
                p.copy_(_hash_table(p.shape, n_exp, gen))
                official[name] = p.clone()
                continue
            p.copy_(_random_like(hf_name, p, gen))
            if name.endswith(".experts.gate_up_proj"):
                base = name.removesuffix("gate_up_proj")
                for e in range(n_exp):
                    for w, rows in (("w1", p[e, :ff]), ("w3", p[e, ff:])):
                        rows.copy_(_encode_into(official, f"{base}{e}.{w}", rows, "mxfp4"))
                continue
            if name.endswith(".experts.down_proj"):
                base = name.removesuffix("down_proj")
                for e in range(n_exp):
                    p[e].copy_(_encode_into(official, f"{base}{e}.w2", p[e], "mxfp4"))
                continue
            p.copy_(_encode_into(official, name.removesuffix(".weight"), p, _storage(name)))
        for bid in range(N_HASH_LAYERS):  # the official files carry a router bias the hash layers never read
            official[f"layers.{bid}.ffn.gate.bias"] = (0.1 * torch.randn(n_exp, generator=gen)).contiguous()
    if mtp:
        _add_mtp_block(official, gen)
    model.save_pretrained(out / TRANSFORMERS_SUBDIR)
    copy_tokenizer(TOKENIZER, out / TRANSFORMERS_SUBDIR)
    save_file({k: v.contiguous() for k, v in sorted(official.items())}, out / "model.safetensors",
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(official_config(vocab, mtp), indent=2, sort_keys=True) + "\n")
    copy_tokenizer(TOKENIZER, out)
    _drop_chat_template(out)
    return out


def official_config(vocab: int, mtp: bool) -> dict:
    """config.json as DeepSeek ships V4: flat legacy keys, an FP8 block quantization block, FP4 experts."""
    ratios = list(COMPRESS_RATIOS) + [MTP_COMPRESS_RATIO] * CONFIG["num_nextn_predict_layers"]
    return {**CONFIG, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": vocab, "compress_ratios": ratios, "num_nextn_predict_layers": 1 if mtp else 0,
            "torch_dtype": "bfloat16", "expert_dtype": "fp4",
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": "ue8m0", "weight_block_size": [_BLOCK, _BLOCK]}}


def official_name(hf_name: str) -> str:
    if hf_name in _ROOT_NAMES:
        return _ROOT_NAMES[hf_name]
    if not hf_name.startswith("model.layers."):
        raise ValueError(f"unexpected transformers tensor {hf_name!r}")
    _, _, bid, rest = hf_name.split(".", 3)
    if rest.startswith("mlp.experts."):
        return f"layers.{bid}.ffn.experts.{rest.removeprefix('mlp.experts.')}"
    return f"layers.{bid}.{_LAYER_NAMES[rest]}"


def _storage(official: str) -> str:
    if any(part in official for part in _F32):
        return "f32"
    return "fp8" if official.split(".", 2)[-1] in _FP8 else "bf16"


def _random_like(hf_name: str, p, gen):
    """Seeded values with a useful spread: norms near 1, biases and sinks near 0, matrices ~ 1/sqrt(fan-in)."""
    import torch

    noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
    if p.ndim == 1:
        centre = 1.0 if hf_name.endswith(("norm.weight", "scale")) else 0.0
        return centre + 0.1 * noise
    if "position_bias" in hf_name:
        return 0.1 * noise
    scale = 1.0 if "embed_tokens" in hf_name else 2.0 / math.sqrt(p.shape[-1])
    return noise * scale


def _hash_table(shape, n_exp: int, gen):
    """Each token's distinct experts, as the hash layers' ``tid2eid`` lookup holds them."""
    import torch

    rows, k = shape
    return torch.argsort(torch.rand(rows, n_exp, generator=gen), dim=1)[:, :k].to(torch.int64)


def _encode_into(official: dict, base: str, values, storage: str):
    """Store ``values`` in ``official`` under ``base`` in the given official dtype; return what it decodes to."""
    import torch

    if storage == "f32":
        official[_weight_name(base)] = values.float().clone()
        return values
    if storage == "bf16":
        v = values.to(torch.bfloat16)
        official[_weight_name(base)] = v.clone()
        return v.float()
    if storage == "fp8":
        q, scale, deq = fp8_block_encode(values)
        official[f"{base}.weight"], official[f"{base}.scale"] = q, scale
        return deq
    packed, scale, deq = mxfp4_encode(values)
    official[f"{base}.weight"], official[f"{base}.scale"] = packed, scale
    return deq


def _weight_name(base: str) -> str:
    """Official names: matrices and norms end in ``.weight``; hc_*, attn_sink, ape, gate.bias do not."""
    last = base.rsplit(".", 1)[-1]
    if last.startswith("hc_") or last in ("attn_sink", "ape", "bias"):
        return base
    return f"{base}.weight"


def _e8m0(exponents):
    import torch

    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def fp8_block_encode(w):
    """FP8 E4M3 values and E8M0 exponents per 128×128 block (edge blocks partial); returns (q, scale, dequant)."""
    import torch

    rows, cols = w.shape
    br, bc = -(-rows // _BLOCK), -(-cols // _BLOCK)
    exps = torch.zeros(br, bc, dtype=torch.int32)
    for i in range(br):
        for j in range(bc):
            amax = float(w[i * _BLOCK:(i + 1) * _BLOCK, j * _BLOCK:(j + 1) * _BLOCK].abs().max())
            exps[i, j] = math.ceil(math.log2(amax / _FP8_MAX)) if amax > 0 else 0
    full = torch.exp2(exps.float()).repeat_interleave(_BLOCK, 0)[:rows].repeat_interleave(_BLOCK, 1)[:, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, _e8m0(exps), q.float() * full


def mxfp4_encode(w):
    """MXFP4 as DeepSeek stores it: int8 bytes (value 2i low nibble, 2i+1 high), E8M0 per 32; + dequant."""
    import torch

    rows, cols = w.shape
    g = w.reshape(rows, cols // 32, 32)
    amax = g.abs().amax(-1)
    exps = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).to(torch.int32)
    scale = torch.exp2(exps.float())[..., None]
    mags = torch.tensor(_E2M1)
    idx = (g.abs() / scale)[..., None].sub(mags).abs().argmin(-1)
    sign = ((g < 0) & (idx > 0)).to(torch.int64)
    codes = (idx | (sign << 3)).reshape(rows, cols)
    deq = (mags[idx] * torch.where(sign.bool(), -1.0, 1.0) * scale).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, _e8m0(exps), deq


def _add_mtp_block(official: dict, gen) -> None:
    """One ``mtp.0.*`` block shaped like the last decoder layer without its compressor (ratio 0, routed MoE)."""
    import torch

    last = CONFIG["num_hidden_layers"] - 1
    d = CONFIG["hidden_size"]
    names = {}
    for name in sorted(official):
        if not name.startswith(f"layers.{last}."):
            continue
        rest = name.removeprefix(f"layers.{last}.")
        if rest.startswith(("attn.compressor.", "attn.indexer.")):
            continue
        names[rest] = official[name]
    fresh: dict[str, torch.Tensor] = {}
    for rest, t in names.items():
        if rest.endswith(".scale") and rest.removesuffix(".scale") + ".weight" in names:
            continue
        base = f"mtp.0.{rest}".removesuffix(".weight")
        if ".experts." in rest:
            shape = (t.shape[0], t.shape[1] * 2)
            _encode_into(fresh, base, torch.randn(shape, generator=gen) * 2.0 / math.sqrt(shape[1]), "mxfp4")
        elif t.dtype == torch.float8_e4m3fn:
            _encode_into(fresh, base, torch.randn(t.shape, generator=gen) * 2.0 / math.sqrt(t.shape[1]), "fp8")
        else:
            values = _random_like(rest, torch.empty(t.shape), gen)
            _encode_into(fresh, base, values, "f32" if t.dtype == torch.float32 else "bf16")
    for proj in ("e_proj", "h_proj"):
        _encode_into(fresh, f"mtp.0.{proj}", torch.randn(d, d, generator=gen) * 2.0 / math.sqrt(d), "fp8")
    for norm in ("enorm", "hnorm", "norm"):
        _encode_into(fresh, f"mtp.0.{norm}", 1.0 + 0.1 * torch.randn(d, generator=gen), "bf16")
    hc = CONFIG["hc_mult"]
    fresh["mtp.0.hc_head_fn"] = torch.randn(hc, hc * d, generator=gen) * 2.0 / math.sqrt(hc * d)
    fresh["mtp.0.hc_head_base"] = 0.1 * torch.randn(hc, generator=gen)
    fresh["mtp.0.hc_head_scale"] = 1.0 + 0.1 * torch.randn(1, generator=gen)
    official.update(fresh)


def _drop_chat_template(out: Path) -> None:
    """DeepSeek-V4 repos ship no jinja template (converters embed llama.cpp's own V4 template)."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("chat_template", None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
