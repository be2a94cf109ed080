"""Plan a random-weight GGUF at a real model's shape with hf2q's own converter, without the weights.

A 31 B checkpoint does not fit this machine, but its *plan* does: transformers builds the model on
the meta device (names and shapes, no memory), a header-only safetensors file stands in for the
weights (a sparse file: the data region is a hole), and ``hf2q.convert.pipeline.build_plan`` decides
names, GGML types, layout and every metadata key exactly as a real conversion would. The result
is a *skeleton* — the GGUF header bytes and the tensor list — that ``bench/synth_gguf.py --skeleton``
fills with tiled random quantized rows on the machine that runs the benchmark (which has neither
torch nor the disk for the source checkpoint).

    python bench/synth_plan.py --shape gemma4-31b --quant q4_k_m -o /tmp/g31-skel
    python bench/synth_gguf.py --skeleton /tmp/g31-skel -o /tmp/g31.gguf     # on the GPU machine

Shapes are the published sizes of each release (layer count, widths, heads, experts, window); the
tokenizer comes from a tiny test checkpoint of the same family, which uses the real vocabulary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf2q.convert.gguf_writer import header_bytes  # noqa: E402
from hf2q.convert.pipeline import build_plan  # noqa: E402
from hf2q.convert.quant_names import parse_gguf_quant  # noqa: E402

_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}}


def _gemma4(layers: int, **kw) -> dict:
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "num_hidden_layers": layers,
            "layer_types": types, "head_dim": 256, "global_head_dim": 512, "sliding_window": 1024,
            "attention_k_eq_v": True, "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "vocab_size": 262144, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
            "rope_parameters": _GEMMA4_ROPE, "dtype": "bfloat16", **kw}


_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "intermediate_size": 6144,
              "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False,
              "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16"}

SHAPES = {
    "gemma4-31b": dict(family="gemma4", config=_gemma4(
        60, hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16,
        num_global_key_value_heads=4)),
    "gemma4-26b-a4b": dict(family="gemma4", config=_gemma4(
        30, hidden_size=2816, intermediate_size=2112, num_attention_heads=16, num_key_value_heads=8,
        num_global_key_value_heads=2, enable_moe_block=True, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704)),
    "qwen3-30b-a3b": dict(family="qwen3_moe", config=dict(
        _QWEN3_MOE, num_hidden_layers=48, hidden_size=2048, num_experts=128, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128)),
    # a CPU-sized MoE of each router family (1.5 GB / ~1 GB in Q4_K_M): hf2q against llama.cpp on a desktop
    "qwen3moe-2b-a0.4b": dict(family="qwen3_moe", config=dict(
        _QWEN3_MOE, num_hidden_layers=24, hidden_size=1024, num_experts=64, moe_intermediate_size=384,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64)),
    "qwen35moe-2b-a0.5b": dict(family="qwen35_moe", config={
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "num_hidden_layers": 24,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
        "full_attention_interval": 4, "hidden_size": 1024, "head_dim": 128, "num_attention_heads": 8,
        "num_key_value_heads": 2, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_num_key_heads": 8, "linear_num_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "moe_intermediate_size": 384, "shared_expert_intermediate_size": 384, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False, "vocab_size": 151936,
        "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000.0, "rope_type": "default"}}),
    "gemma4-moe-1b": dict(family="gemma4", config=_gemma4(
        12, hidden_size=1024, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
        global_head_dim=256, num_global_key_value_heads=2, enable_moe_block=True, num_experts=64, top_k_experts=8,
        moe_intermediate_size=384)),
    # the published E2B widths: per-layer embeddings, 20 KV-shared layers, double-wide MLPs there
    "gemma4-e2b": dict(family="gemma4", config=_gemma4(
        35, hidden_size=1536, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=1,
        sliding_window=512, attention_k_eq_v=False, hidden_size_per_layer_input=256, num_kv_shared_layers=20,
        use_double_wide_mlp=True, layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                                for i in range(35)])),
    # small enough to fill and run on a laptop CPU: checks the skeleton path end to end
    "gemma4-moe-small": dict(family="gemma4", config=_gemma4(
        6, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        global_head_dim=128, num_global_key_value_heads=1, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=128, sliding_window=64)),
}


def meta_state_dict(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name → shape of the model transformers would build from ``config`` (no memory)."""
    import torch
    import transformers

    model_cls = getattr(transformers, config["architectures"][0])
    cfg = transformers.AutoConfig.for_model(config["model_type"], **{
        k: v for k, v in config.items()
        if k not in ("architectures", "model_type", "dtype", "torch_dtype", "transformers_version")})
    with torch.device("meta"):
        model = model_cls(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def write_hollow_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> int:
    """A safetensors file whose header is real and whose data region is a hole (sparse, never read)."""
    itemsize = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
    header, off = {}, 0
    for name in sorted(shapes):
        n = itemsize
        for d in shapes[name]:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shapes[name]), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + off)
    return off


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--config", default=None,
                    help="plan this HF config.json instead of a named shape (tokenizer: --tokenizer-dir, else beside it)")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="HF dir with the family's tokenizer files (default: the tiny test checkpoint)")
    ap.add_argument("-o", "--output", required=True, help="skeleton directory (header.bin + tensors.json)")
    a = ap.parse_args()
    if bool(a.shape) == bool(a.config):
        ap.error("give one of --shape or --config")
    if a.config:
        spec = {"config": json.loads(Path(a.config).read_text())}
        tok_dir = Path(a.tokenizer_dir) if a.tokenizer_dir else Path(a.config).parent
        a.shape = Path(a.config).parent.name
    else:
        spec = SHAPES[a.shape]
        tok_dir = Path(a.tokenizer_dir) if a.tokenizer_dir else _tiny_tokenizer_dir(spec["family"])
    quant = parse_gguf_quant(a.quant)
    with tempfile.TemporaryDirectory(prefix="hf2q-synth-") as tmp:
        src = Path(tmp)
        (src / "config.json").write_text(json.dumps(spec["config"]))
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "tokenizer.model"):
            if (tok_dir / name).exists():
                shutil.copy(tok_dir / name, src / name)
        write_hollow_safetensors(src / "model.safetensors", meta_state_dict(spec["config"]))
        plan = build_plan(src, quant)
        try:
            head = header_bytes(plan.metadata.entries, plan.layouts)
            tensors = [{"name": lay.name, "ne": list(lay.ne), "type": lay.qtype.name, "nbytes": lay.nbytes,
                        "offset": lay.offset} for lay in plan.layouts]
        finally:
            plan.checkpoint.close()
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "header.bin").write_bytes(head)
    (out / "tensors.json").write_text(json.dumps({"shape": a.shape, "quant": quant.name, "tensors": tensors}))
    total = sum(t["nbytes"] for t in tensors)
    print(json.dumps({"skeleton": str(out), "shape": a.shape, "quant": quant.name, "tensors": len(tensors),
                      "header_bytes": len(head), "data_bytes": total}))
    return 0


def _tiny_tokenizer_dir(family: str) -> Path:
    from tests.models import tiny

    return tiny.checkpoint(family)


if __name__ == "__main__":
    raise SystemExit(main())
