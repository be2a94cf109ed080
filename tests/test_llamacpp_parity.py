"""Whole-model parity with stock llama.cpp: every tensor of our GGUF equals llama.cpp's.

The reference is llama.cpp's own pipeline, built from the llama-cpp-python 0.3.36 sdist:
``convert_hf_to_gguf.py --outtype f16|bf16|f32`` (with the sdist's gguf-py) and, for every
quantized mix, ``llama-quantize F16.gguf OUT.gguf <mix>``. For each GGUF quant name (on SmolLM2 and
MiniLM; on Gemma 3 the mixes whose choices differ per architecture, ``GEMMA3_PARITY_NAMES``) we
compare every tensor — name, type, shape and bytes — and the tokenizer / hyper-parameter
metadata. References are cached under ``<hf2q cache>/llamacpp-ref/`` keyed by the source's
config hash, so a second run only pays for our own conversions.

Also: stock ``llama-completion`` loads our SmolLM2 and Gemma3 outputs and generates text, and its greedy
tokens on our tiny Gemma 4 files (dense, E2B-style, MoE) equal our engine's.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hf2q.convert.quant_names import PARITY_GGUF_NAMES
from tests.tools.gguf_read import read_gguf

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

FLOAT_NAMES = ("f32", "f16", "bf16")
# metadata written by llama.cpp from the model card / directory name, not from the model
_IGNORED_KEYS = ("general.",)
_KEPT_GENERAL = ("general.architecture", "general.file_type", "general.quantization_version")


def _ref_dir() -> Path:
    from hf2q.paths import cache_root

    d = cache_root() / "llamacpp-ref"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _source_key(src: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(src)):
        p = src / name
        if p.is_file():
            h.update(name.encode())
            h.update(str(p.stat().st_size).encode())
            if p.stat().st_size < (1 << 20):
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def llamacpp_reference(src: Path, quant: str, convert_args: tuple[str, ...] = ()) -> Path:
    """llama.cpp's GGUF of ``src`` for ``quant`` (built once, cached); ``convert_args`` go to its
    converter (``--no-mtp``, ``--mtp``)."""
    from tests.tools import llama_cpp

    key = f"{src.name}-{_source_key(src)}" + "".join(a.replace("-", "_") for a in convert_args)
    out = _ref_dir() / f"{key}-{quant}.gguf"
    if out.exists():
        return out
    env = llama_cpp.env()
    env["PYTHONPATH"] = str(llama_cpp.gguf_py_dir())
    if quant in FLOAT_NAMES:
        tmp = out.with_suffix(".tmp.gguf")
        r = subprocess.run([sys.executable, str(llama_cpp.convert_script()), str(src), "--outtype", quant,
                            "--outfile", str(tmp), *convert_args], env=env, capture_output=True, text=True, check=False)
        assert r.returncode == 0, f"llama.cpp convert failed: {r.stderr[-2000:]}"
        tmp.rename(out)
        return out
    f16 = llamacpp_reference(src, "f16", convert_args)
    tmp = out.with_suffix(".tmp.gguf")
    r = subprocess.run([str(llama_cpp.tool("llama-quantize")), str(f16), str(tmp), quant, "2"],
                       env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"llama-quantize {quant} failed: {r.stderr[-2000:]}"
    tmp.rename(out)
    return out


def _model_keys(kv: dict) -> dict:
    return {k: v for k, v in kv.items() if not k.startswith(_IGNORED_KEYS) or k in _KEPT_GENERAL}


def compare_gguf(ours: Path, theirs: Path) -> list[str]:
    """Differences (empty when identical): tensor set, type, shape, bytes, model metadata."""
    ka, ta = read_gguf(ours)
    kb, tb = read_gguf(theirs)
    diffs = []
    if set(ta) != set(tb):
        diffs.append(f"tensor names differ: only ours {sorted(set(ta) - set(tb))[:5]}, "
                     f"only llama.cpp {sorted(set(tb) - set(ta))[:5]}")
    for name in sorted(set(ta) & set(tb)):
        (qa, na, da), (qb, nb, db) = ta[name], tb[name]
        if qa != qb:
            diffs.append(f"{name}: type {qa.name} vs {qb.name}")
        elif na != nb:
            diffs.append(f"{name}: shape {na} vs {nb}")
        elif da != db:
            diffs.append(f"{name}: {qa.name} bytes differ")
    fa, fb = _model_keys(ka), _model_keys(kb)
    for k in sorted(set(fa) | set(fb)):
        if fa.get(k) != fb.get(k):
            diffs.append(f"metadata {k}: ours {str(fa.get(k))[:80]!r} vs llama.cpp {str(fb.get(k))[:80]!r}")
    return diffs


def _convert(src: Path, quant: str, out: Path) -> None:
    from hf2q.cli import main

    code = main(["convert", str(src), "--quant", quant, "-o", str(out), "--no-integrity"])
    assert code == 0, f"hf2q convert {quant} failed"


@pytest.fixture(scope="module")
def oracle(llama_cpp_bin):
    return llama_cpp_bin


REAL_MODELS = ("smollm2_hf", "gemma3_hf", "minilm_hf")

#: Gemma 3 270m checks the mixes whose per-tensor choices differ from SmolLM2's; SmolLM2 and MiniLM check every
#: name, so every codec and every mix's rules are covered. What llama.cpp's policy reads of a model (policy.py) is
#: the GQA ratio, the layer count, the row lengths (through the one fallback rule) and whether the output is tied.
#: Both models tie their output and have rows that are no multiple of 256 (576, 640); Gemma 3 differs in GQA 4
#: (SmolLM2: 3), which takes q2_k's ``n_gqa >= 4`` attn_v branch, and in 18 layers (SmolLM2: 30), which move the
#: more-bits layers of q4_k_m and q5_k_m and q4_k_s's ``n // 8`` first layers. f16 is the float export of Gemma's
#: own tensors (norms +1, four norms per block, Q/K norms kept F32) that every mix starts from.
GEMMA3_PARITY_NAMES = ("f16", "q2_k", "q4_k_s", "q4_k_m", "q5_k_m")


def _parity_names(model: str) -> tuple[str, ...]:
    """The quant names checked on ``model``; ``HF2Q_PARITY_QUANTS=q8_0,q4_k_m`` narrows them for a quick local run."""
    if os.environ.get("HF2Q_PARITY_QUANTS"):
        return tuple(os.environ["HF2Q_PARITY_QUANTS"].split(","))
    return GEMMA3_PARITY_NAMES if model == "gemma3_hf" else PARITY_GGUF_NAMES


def test_gemma3_names_are_parity_names():
    assert set(GEMMA3_PARITY_NAMES) <= set(PARITY_GGUF_NAMES)


@pytest.mark.parametrize("model", REAL_MODELS)
def test_every_quant_matches_llamacpp(model, request, oracle, tmp_path):
    src = request.getfixturevalue(model)
    started = time.perf_counter()
    failures = {}
    names = _parity_names(model)
    for quant in names:
        ours = tmp_path / f"{quant}.gguf"
        _convert(src, quant, ours)
        diffs = compare_gguf(ours, llamacpp_reference(src, quant))
        if diffs:
            failures[quant] = diffs[:5] + ([f"… {len(diffs) - 5} more"] if len(diffs) > 5 else [])
        ours.unlink()
    print(f"{model}: {len(names)} quant names checked in {time.perf_counter() - started:.1f}s")
    assert not failures, failures


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gemma3", "bert"])
@pytest.mark.parametrize("quant", ["f16", "q8_0", "q4_k_m", "q3_k_m"])
def test_tiny_families_match_llamacpp(family, quant, tiny_checkpoint, oracle, tmp_path):
    src = tiny_checkpoint(family)
    ours = tmp_path / "out.gguf"
    _convert(src, quant, ours)
    assert compare_gguf(ours, llamacpp_reference(src, quant)) == []


def _generate(bin_dir: Path, model: Path, prompt: str, n: int = 16) -> str:
    from tests.tools import llama_cpp

    tool = llama_cpp.tool("llama-completion") or llama_cpp.tool("llama-simple")
    assert tool is not None
    args = [str(tool), "-m", str(model), "-p", prompt, "-n", str(n), "-t", "2", "--temp", "0", "-no-cnv"] \
        if tool.name == "llama-completion" else [str(tool), "-m", str(model), "-n", str(n), prompt]
    r = subprocess.run(args, env=llama_cpp.env(), capture_output=True, text=True, timeout=300, check=False,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.parametrize("model,quant,prompt,expect", [
    ("smollm2_hf", "q4_k_m", "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
     "Paris"),
    ("gemma3_hf", "q8_0", "The capital of France is", "France"),  # a 270m base model: it rambles
], ids=["smollm2", "gemma3"])
def test_stock_llamacpp_generates_from_our_gguf(model, quant, prompt, expect, request, oracle, tmp_path):
    """Stock llama.cpp loads our file and generates the same greedy text as from its own conversion."""
    src = request.getfixturevalue(model)
    out = tmp_path / f"{model}.gguf"
    _convert(src, quant, out)
    text = _generate(oracle, out, prompt)
    assert expect in text, text[-500:]
    assert text == _generate(oracle, llamacpp_reference(src, quant), prompt)


# ---- Gemma 4: stock llama.cpp's greedy tokens equal ours ------------------------------------------

# longer than the tiny models' 16-token window, so the sliding layers drop keys in both engines
GEMMA4_PROMPT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each step, "
                 "and lit the great lamp so that the fishing boats could find their way home through the fog.")
GEMMA4_STEPS = 24


def _llamacpp_greedy(model: Path, prompt: str, n: int) -> tuple[list[int], bytes]:
    """``(prompt token ids, generated bytes)`` of stock ``llama-completion`` at T=0 (special tokens printed)."""
    import re

    from tests.tools import llama_cpp

    args = [str(llama_cpp.tool("llama-completion")), "-m", str(model), "-p", prompt, "-n", str(n), "-t", "1",
            "--temp", "0", "-no-cnv", "--ignore-eos", "--special", "--no-display-prompt", "--verbose-prompt"]
    r = subprocess.run(args, env={**llama_cpp.env(), "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=300,
                       check=False, stdin=subprocess.DEVNULL)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err[-2000:]
    prompt_ids = [int(m) for m in re.findall(r"^\S+ I +(\d+) -> '", err, re.MULTILINE)]
    assert r.stdout.endswith(b"\n\n"), r.stdout[-100:]  # llama-completion ends its output with a blank line
    return prompt_ids, r.stdout[:-2]


def _hf2q_greedy(model: Path, prompt: str, n: int) -> tuple[list[int], bytes]:
    """The same through our tokenizer and engine: one prefill, then ``n - 1`` greedy decode steps."""
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(model)
    ids = tok.encode(prompt)
    runner = MlxModelRunner.load(model)
    seq = runner.new_sequence()
    out = [int(np.argmax(runner.prefill(seq, ids)))]
    while len(out) < n:
        out.append(int(np.argmax(runner.decode([seq], [out[-1]])[0])))
    return ids, b"".join(tok.token_bytes(t) for t in out)


@pytest.mark.parametrize("family", ["gemma4", "gemma4_e2b", "gemma4_moe"])
def test_gemma4_greedy_tokens_match_stock_llamacpp(family, tiny_checkpoint, oracle, tmp_path):
    """Stock ``llama-completion`` and our engine read our Gemma 4 GGUF the same way: the same prompt tokens and
    the same greedy continuation, through the sliding window (dense), per-layer embeddings and shared KV (E2B)
    and the routed experts (MoE). F32 weights: llama.cpp's quantized matmuls also round the activations
    (to q8 blocks), which on random weights flips near-tied argmaxes late in the run."""
    model = tmp_path / f"{family}.gguf"
    _convert(tiny_checkpoint(family), "f32", model)
    theirs = _llamacpp_greedy(model, GEMMA4_PROMPT, GEMMA4_STEPS)
    ours = _hf2q_greedy(model, GEMMA4_PROMPT, GEMMA4_STEPS)
    assert len(theirs[0]) > 16
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1], (ours[1], theirs[1])
