"""Write a random-weight GGUF of a real architecture's *shape* (e.g. Qwen3-8B) for speed work.

Speed does not depend on the values, so each tensor is one small block of real quantized
rows (random normal weights quantized by our codecs) tiled to full size: writing an 8 B
model takes seconds instead of the minutes a full quantization would. The tokenizer
metadata is copied from a vocab GGUF (llama.cpp's ggml-vocab-qwen2.gguf) when given.

    python bench/synth_gguf.py --shape qwen3-8b --mix q4_k_m -o /tmp/q8b.gguf [--vocab-gguf V.gguf]
    python bench/synth_gguf.py --skeleton /tmp/g31-skel -o /tmp/g31.gguf   # a plan from bench/synth_plan.py

``--skeleton`` takes the header and tensor list that ``bench/synth_plan.py`` planned with hf2q's own
converter (every family, every metadata key, the converter's type mix) and only fills the data.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from hf2q.formats.gguf_keys import ExtraKeys  # noqa: E402
from hf2q.ggml import codec  # noqa: E402

SHAPES = {
    "qwen3-8b": dict(hidden=4096, layers=36, ffn=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936),
    "qwen3-0.6b": dict(hidden=1024, layers=28, ffn=3072, heads=16, kv_heads=8, head_dim=128, vocab=151936),
    "qwen3-tiny": dict(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, head_dim=64, vocab=151936),
    # hybrid Gated DeltaNet + gated attention (Qwen3.5-9B; vocabulary of the Qwen2 tokenizer llama.cpp ships
    # as ggml-vocab-qwen35, 151,936 rows instead of the release's 248,320): a full-attention block every `interval`
    "qwen35-9b": dict(arch="qwen35", hidden=4096, layers=32, ffn=12288, heads=16, kv_heads=4, head_dim=256,
                      vocab=151936, interval=4, lin_k_heads=16, lin_v_heads=32, lin_dim=128, conv=4, rope_dims=64),
    "qwen35-0.8b": dict(arch="qwen35", hidden=1024, layers=24, ffn=3584, heads=8, kv_heads=2, head_dim=256,
                        vocab=151936, interval=4, lin_k_heads=16, lin_v_heads=16, lin_dim=128, conv=4, rope_dims=64),
    "qwen35-tiny": dict(arch="qwen35", hidden=256, layers=4, ffn=512, heads=4, kv_heads=2, head_dim=64,
                        vocab=151936, interval=2, lin_k_heads=2, lin_v_heads=4, lin_dim=64, conv=4, rope_dims=16),
}

# per-role types for the mixes we time (llama.cpp's q4_k_m gives attn_v / ffn_down Q6_K in about half
# the layers; using Q6_K for all of them is the slower, conservative choice)
MIXES = {
    "q4_k_m": {"default": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q4_K},
    "q8_0": {"default": T.Q8_0, "output": T.Q8_0, "token_embd": T.Q8_0},
    "q4_0": {"default": T.Q4_0, "output": T.Q6_K, "token_embd": T.Q4_0},
}


def tiled_tensor(rows: int, cols: int, qtype, rng) -> np.ndarray:
    tile_rows = min(rows, 64)
    w = (rng.standard_normal((tile_rows, cols)) * 0.02).astype(np.float16).astype(np.float32)
    q = codec.quantize(w, qtype)
    reps = -(-rows // tile_rows)
    return np.tile(q, (reps, 1))[:rows]


FULL_RANDOM_ELEMENTS = 1 << 25  # smaller tensors get distinct rows (no tied logits in correctness checks)


def fill_skeleton(skeleton: Path, output: Path) -> dict:
    """Write ``skeleton``'s header (``header.bin``, or gzipped as ``header.bin.gz`` for transfer), then each tensor as tiled random rows of its planned type.

    Matrices get random values (a router of ones would send every token to the same experts);
    vectors (norms, scales, rope factors) are ones. Big tensors repeat a 64-row tile."""
    plan = json.loads((skeleton / "tensors.json").read_text())
    rng = np.random.default_rng(0)
    align = 32
    with output.open("wb") as f:
        head = skeleton / "header.bin"
        f.write(head.read_bytes() if head.exists() else gzip.decompress((skeleton / "header.bin.gz").read_bytes()))
        for t in plan["tensors"]:
            qt = T[t["type"]]
            ne = t["ne"]
            cols, rows = ne[0], int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
            if rows == 1 and qt in (T.F32, T.F16):
                data = codec.quantize(np.ones((1, cols), dtype=np.float32), qt)
            elif rows * cols <= FULL_RANDOM_ELEMENTS:
                data = codec.quantize((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), qt)
            else:
                data = tiled_tensor(rows, cols, qt, rng)
            buf = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            if buf.nbytes != t["nbytes"]:
                raise SystemExit(f"{t['name']}: {buf.nbytes} bytes, planned {t['nbytes']}")
            f.write(buf)
            f.write(b"\0" * (-buf.nbytes % align))
    return {"output": str(output), "shape": plan["shape"], "mix": plan["quant"], "bytes": output.stat().st_size}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skeleton", default=None, help="fill a skeleton from bench/synth_plan.py instead of --shape")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--mix", default="q4_k_m", choices=sorted(MIXES))
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--vocab-gguf", default=None, help="copy tokenizer.* metadata from this GGUF")
    ap.add_argument("--mtp", action="store_true", help="qwen35: also write a multi-token-prediction (nextn) block")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    if a.skeleton:
        t0 = time.time()
        rep = fill_skeleton(Path(a.skeleton), Path(a.output))
        print(json.dumps({**rep, "seconds": round(time.time() - t0, 1)}))
        return 0
    s = dict(SHAPES[a.shape])
    if a.layers:
        s["layers"] = a.layers
    mix = MIXES[a.mix]
    rng = np.random.default_rng(0)
    t0 = time.time()
    arch = s.get("arch", "qwen3")
    w = gguf.GGUFWriter(a.output, arch)
    w.add_name(f"random {a.shape} {a.mix}")
    mtp = bool(a.mtp and arch == "qwen35")
    w.add_block_count(s["layers"] + mtp)
    if mtp:
        w.add_uint32(gguf.Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch), 1)
    w.add_context_length(40960)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen35":
        recurrent = [(i + 1) % s["interval"] != 0 for i in range(s["layers"])] + [False] * mtp
        w.add_ssm_conv_kernel(s["conv"])
        w.add_ssm_state_size(s["lin_dim"])
        w.add_ssm_group_count(s["lin_k_heads"])
        w.add_ssm_time_step_rank(s["lin_v_heads"])
        w.add_ssm_inner_size(s["lin_v_heads"] * s["lin_dim"])
        w.add_array(ExtraKeys.RECURRENT_LAYERS.format(arch=arch), recurrent)
        w.add_uint32(gguf.Keys.LLM.FULL_ATTENTION_INTERVAL.format(arch=arch), s["interval"])
        w.add_rope_dimension_count(s["rope_dims"])
        pairs = s["rope_dims"] // 2
        third = -(-pairs // 3)
        w.add_rope_dimension_sections([third, third, pairs - 2 * third, 0])
    w.add_file_type(15 if a.mix == "q4_k_m" else 7 if a.mix == "q8_0" else 2)
    if a.vocab_gguf:
        r = gguf.GGUFReader(a.vocab_gguf)
        for field in r.fields.values():
            if not field.name.startswith("tokenizer."):
                continue
            v = field.contents()
            vt = field.types[0]
            if vt == gguf.GGUFValueType.ARRAY:
                w.add_key_value(field.name, v, vt, sub_type=field.types[-1])
            else:
                w.add_key_value(field.name, v, vt)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"<t{i}>" for i in range(s["vocab"])])
        w.add_eos_token_id(s["vocab"] - 1)

    def add(name: str, rows: int, cols: int, role: str):
        qt = mix.get(role, mix["default"])
        data = tiled_tensor(rows, cols, qt, rng)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)

    def norm(name: str, n: int):
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    h, hd = s["hidden"], s["head_dim"]

    def add_qwen35_block(p: str, recurrent: bool):
        norm(p + "post_attention_norm.weight", h)
        if recurrent:
            kd, vd = s["lin_k_heads"] * s["lin_dim"], s["lin_v_heads"] * s["lin_dim"]
            add(p + "attn_qkv.weight", 2 * kd + vd, h, "attn_qkv")
            add(p + "attn_gate.weight", vd, h, "attn_gate")
            add(p + "ssm_alpha.weight", s["lin_v_heads"], h, "ssm_alpha")
            add(p + "ssm_beta.weight", s["lin_v_heads"], h, "ssm_beta")
            add(p + "ssm_out.weight", h, vd, "ssm_out")
            w.add_tensor(p + "ssm_conv1d.weight", (rng.standard_normal((2 * kd + vd, s["conv"])) * 0.2).astype(np.float32))
            w.add_tensor(p + "ssm_dt.bias", np.zeros(s["lin_v_heads"], dtype=np.float32))
            w.add_tensor(p + "ssm_a", -np.exp(rng.uniform(-1, 1, s["lin_v_heads"])).astype(np.float32))
            norm(p + "ssm_norm.weight", s["lin_dim"])
        else:
            add(p + "attn_q.weight", 2 * s["heads"] * hd, h, "attn_q")
            add(p + "attn_k.weight", s["kv_heads"] * hd, h, "attn_k")
            add(p + "attn_v.weight", s["kv_heads"] * hd, h, "attn_v")
            add(p + "attn_output.weight", h, s["heads"] * hd, "attn_output")
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
        add(p + "ffn_gate.weight", s["ffn"], h, "ffn_gate")
        add(p + "ffn_up.weight", s["ffn"], h, "ffn_up")
        add(p + "ffn_down.weight", h, s["ffn"], "ffn_down")
    add("token_embd.weight", s["vocab"], h, "token_embd")
    for i in range(s["layers"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", h)
        if arch == "qwen35":
            add_qwen35_block(p, (i + 1) % s["interval"] != 0)
            continue
        add(p + "attn_q.weight", s["heads"] * hd, h, "attn_q")
        add(p + "attn_k.weight", s["kv_heads"] * hd, h, "attn_k")
        add(p + "attn_v.weight", s["kv_heads"] * hd, h, "attn_v")
        add(p + "attn_output.weight", h, s["heads"] * hd, "attn_output")
        norm(p + "attn_q_norm.weight", hd)
        norm(p + "attn_k_norm.weight", hd)
        norm(p + "ffn_norm.weight", h)
        add(p + "ffn_gate.weight", s["ffn"], h, "ffn_gate")
        add(p + "ffn_up.weight", s["ffn"], h, "ffn_up")
        add(p + "ffn_down.weight", h, s["ffn"], "ffn_down")
    if mtp:  # a full-attention block after the main ones, with the head's own norms and projection
        p = f"blk.{s['layers']}."
        norm(p + "attn_norm.weight", h)
        add_qwen35_block(p, False)
        add(p + "nextn.eh_proj.weight", h, 2 * h, "attn_output")
        for n in ("enorm", "hnorm", "shared_head_norm"):
            norm(p + f"nextn.{n}.weight", h)
    norm("output_norm.weight", h)
    add("output.weight", s["vocab"], h, "output")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = Path(a.output).stat().st_size
    print(json.dumps({"output": a.output, "shape": a.shape, "mix": a.mix, "bytes": size,
                      "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
