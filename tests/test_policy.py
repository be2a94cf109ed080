"""The per-tensor type policy agrees with stock ``llama-quantize --dry-run`` for every mix.

Synthetic F16 GGUFs (zero data, written by our own writer) shaped to hit the policy's
branches — 16 layers (``use_more_bits`` positions), GQA ≥ 4 and < 4, tied and untied output,
8 experts, rows not divisible by 256 (K-quant fallbacks) and not even by 32 (F16 fallback) —
are given to llama.cpp's quantizer in dry-run mode; its chosen type for each tensor must
equal ``plan_types``. Dry runs read no tensor data, so the test takes seconds.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import gguf
import pytest

from hf2q.arch.base import Metadata, quantize_order_key
from hf2q.convert.gguf_writer import GGUFStream, layout
from hf2q.convert.policy import ModelFacts, TensorFacts, allows_quantization, plan_types
from hf2q.convert.quant_names import GGUF_QUANTS, parse_gguf_quant

T = gguf.GGMLQuantizationType
MIXES = [n for n, q in GGUF_QUANTS.items() if not q.is_float and not q.needs_imatrix]


def _model(arch: str, n_layer: int, d: int, ff: int, n_head: int, n_kv: int, head_dim: int,
           tied: bool, n_expert: int = 0, vocab: int = 512):
    """(metadata, [(name, ne)]) of a minimal model that llama.cpp's quantizer accepts."""
    md = Metadata()
    md.string("general.architecture", arch)
    for k, v in (("block_count", n_layer), ("context_length", 256), ("embedding_length", d),
                 ("feed_forward_length", ff), ("attention.head_count", n_head),
                 ("attention.head_count_kv", n_kv), ("attention.key_length", head_dim),
                 ("attention.value_length", head_dim), ("rope.dimension_count", head_dim)):
        md.u32(f"{arch}.{k}", v)
    md.f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    md.f32(f"{arch}.rope.freq_base", 10000.0)
    if n_expert:
        md.u32(f"{arch}.expert_count", n_expert)
        md.u32(f"{arch}.expert_used_count", 2)
        md.u32(f"{arch}.expert_feed_forward_length", ff)
    md.u32("general.file_type", 1)
    tensors = [("token_embd.weight", (d, vocab)), ("output_norm.weight", (d,))]
    if not tied:
        tensors.append(("output.weight", (d, vocab)))
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d,)), (b + "ffn_norm.weight", (d,)),
                    (b + "attn_q.weight", (d, n_head * head_dim)), (b + "attn_k.weight", (d, n_kv * head_dim)),
                    (b + "attn_v.weight", (d, n_kv * head_dim)), (b + "attn_output.weight", (n_head * head_dim, d))]
        if n_expert:
            tensors += [(b + "ffn_gate_inp.weight", (d, n_expert)),
                        (b + "ffn_gate_exps.weight", (d, ff, n_expert)), (b + "ffn_up_exps.weight", (d, ff, n_expert)),
                        (b + "ffn_down_exps.weight", (ff, d, n_expert))]
        else:
            tensors += [(b + "ffn_gate.weight", (d, ff)), (b + "ffn_up.weight", (d, ff)),
                        (b + "ffn_down.weight", (ff, d))]
    tensors.sort(key=lambda t: quantize_order_key(t[0]))
    facts = ModelFacts(arch, n_layer, n_head, n_kv, n_expert)
    return md, tensors, facts


def _is_f32(name: str, ne) -> bool:
    return len(ne) == 1 or name.endswith("_norm.weight") or "ffn_gate_inp" in name


def _write_f16(path: Path, md: Metadata, tensors) -> None:
    lay = layout([(n, ne, T.F32 if _is_f32(n, ne) else T.F16) for n, ne in tensors])
    with open(path, "wb") as f:
        s = GGUFStream(f, md.entries, lay)
        for t in lay:
            s.write(bytes(t.nbytes))


_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[.*?\], type =\s+(\w+), size =.*?(?:\((\w+)\))?\s*$")


def _llamacpp_types(bin_dir: Path, model: Path, mix: str) -> dict[str, str]:
    from tests.tools import llama_cpp

    r = subprocess.run([str(bin_dir / "llama-quantize"), "--dry-run", str(model), mix, "1"],
                       env=llama_cpp.env(), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    out = {}
    for line in (r.stdout + r.stderr).splitlines():
        if m := _LINE.match(line.strip()):
            out[m[1]] = (m[3] or m[2]).upper()
    return out


CASES = {
    # GQA 4, untied output, rows multiple of 256
    "gqa4-untied": ("llama", 16, 256, 512, 8, 2, 32, False, 0),
    # GQA 1, tied embeddings, 160-wide rows (K-quants fall back), ffn 336 (not /32 → F16)
    "odd-shapes-tied": ("llama", 16, 160, 336, 4, 4, 40, True, 0),
    # 8 experts (the n_expert == 8 upgrades), per-layer expert tensors
    "moe-8-experts": ("qwen3moe", 8, 256, 256, 4, 2, 64, False, 8),
    # a 70B-like llama: 80 layers with GQA (attn_v bumped to Q5_K)
    "llama-80-layers": ("llama", 80, 256, 256, 8, 1, 32, True, 0),
}


@pytest.fixture(scope="module")
def synthetic_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    out = {}
    for name, args in CASES.items():
        md, tensors, facts = _model(*args)
        path = root / f"{name}.gguf"
        _write_f16(path, md, tensors)
        out[name] = (path, tensors, facts)
    return out


@pytest.mark.llamacpp
@pytest.mark.parametrize("case", list(CASES))
def test_policy_matches_llama_quantize_dry_run(case, synthetic_models, llama_cpp_bin):
    path, tensors, facts = synthetic_models[case]
    mismatches = {}
    for mix in MIXES:
        theirs = _llamacpp_types(llama_cpp_bin, path, mix)
        assert len(theirs) == len(tensors), f"parsed {len(theirs)} of {len(tensors)} dry-run lines"
        ours = plan_types(parse_gguf_quant(mix), facts,
                          [TensorFacts(n, ne, _is_f32(n, ne)) for n, ne in tensors])
        bad = [(n, q.name, theirs[n]) for (n, _), q in zip(tensors, ours) if q.name != theirs[n]]
        if bad:
            mismatches[mix] = bad[:4]
    assert not mismatches, mismatches


def test_only_weight_matrices_are_quantizable():
    """Sanity of the filter that stage 2 applies (independent of any mix)."""
    f = lambda n, ne: allows_quantization(TensorFacts(n, ne, False))
    assert f("blk.0.attn_q.weight", (64, 64))
    assert not f("blk.0.attn_norm.weight", (64,))
    assert not f("blk.0.attn_q_norm.weight", (64, 1))
    assert not f("blk.0.ffn_gate_inp.weight", (64, 8))
    assert not f("position_embd.weight", (64, 512))
    assert not f("blk.0.attn_q.bias", (64, 64))
