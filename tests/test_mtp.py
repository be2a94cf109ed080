"""Multi-token-prediction drafts for Qwen 3.5 (``engine/models/qwen35_mtp.py``, ``--speculative mtp``).

The tiny dense and MoE checkpoints carry a hand-made ``mtp.*`` head (``tests/models/tiny.py``);
``hf2q convert`` writes it as the ``nextn`` block. The reference is transformers': the main
model's final-normed hidden rows, and the head's decoder block run by transformers itself (the
checkpoint copied with ``mtp.layers.0.*`` standing in for the last full-attention block, so its
own loader builds the block, MoE experts included), with the head's norms, ``fc`` and chaining
written out here as llama.cpp's MTP driver pairs them: the token at position p with the hidden
row at p − 1, drafts chained on the head's own output row.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hf2q.sched.contracts import SamplingParams
from tests.engine_support import random_tokens
from tests.models.mtp_runners import runner_cache

TOL = 1e-3
PROMPT = 24
FAMILIES = {"dense": "qwen35_parity_mtp", "moe": "qwen35moe_parity_mtp"}


@pytest.fixture(scope="module")
def gguf(tiny_checkpoint, tmp_path_factory):
    from tests.engine_support import convert_f32

    d = tmp_path_factory.mktemp("mtp")
    return lambda kind: convert_f32(tiny_checkpoint(FAMILIES[kind]), d / f"{kind}.gguf")


_runner = runner_cache()  # shared by the tests of this module


@pytest.fixture(scope="module")
def no_mtp_gguf(tiny_checkpoint, tmp_path_factory):
    """The dense checkpoint converted with ``--no-mtp`` (no nextn block)."""
    from hf2q.cli import main

    out = tmp_path_factory.mktemp("no-mtp") / "no-mtp.gguf"
    assert main(["convert", str(tiny_checkpoint(FAMILIES["dense"])), "-q", "f32", "-o", str(out), "--no-integrity",
                 "--no-mtp"]) == 0
    return out


# ---------------------------------------------------------------------------- the head against transformers


def _transformers_head(src, tmp):
    """``(main model, the head's block, its rotary embedding, the checkpoint's tensors, config)``."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    full = max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    main = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    weights = load_file(src / "model.safetensors")
    head_dir = tmp / "head"
    head_dir.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, head_dir / f.name)
    swapped = {n: w for n, w in weights.items() if f"layers.{full}." not in n and not n.startswith("mtp.")}
    swapped.update({f"model.layers.{full}." + n[len("mtp.layers.0."):]: w for n, w in weights.items()
                    if n.startswith("mtp.layers.0.")})
    save_file(swapped, head_dir / "model.safetensors", metadata={"format": "pt"})
    block_model = transformers.AutoModelForCausalLM.from_pretrained(head_dir, dtype=torch.float32).eval()
    return main, block_model.model.layers[full], block_model.model.rotary_emb, weights, cfg


def _reference(head, tokens: list[int], pending: int, k: int) -> np.ndarray:
    """The head's logits of ``k`` chained draft steps after ``tokens`` + ``pending``, by transformers."""
    import torch

    main, block, rotary, weights, cfg = head
    d, eps = cfg["hidden_size"], cfg["rms_norm_eps"]

    def norm(x, name):  # Qwen 3.5's (1 + w) RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weights[name])

    with torch.no_grad():
        hidden = main.model(torch.tensor([tokens])).last_hidden_state[0]  # final-normed rows
        embed = main.model.embed_tokens
        ids = list(tokens) + [pending]
        rows = [torch.zeros(d)] + [hidden[p] for p in range(len(tokens))]  # row p − 1 for each position p
        out = []
        for _ in range(k):
            x = torch.cat([norm(embed(torch.tensor(ids)), "mtp.pre_fc_norm_embedding.weight"),
                           norm(torch.stack(rows), "mtp.pre_fc_norm_hidden.weight")], dim=-1)
            u = x @ weights["mtp.fc.weight"].T
            pos = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
            y = block(u[None], position_embeddings=rotary(u[None], pos), attention_mask=None)[0]
            g = norm(y[-1], "mtp.norm.weight")
            logits = main.lm_head(g)
            out.append(logits.numpy())
            ids.append(int(torch.argmax(logits)))
            rows.append(g)
    return np.stack(out)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_draft_logits_match_transformers(gguf, tiny_checkpoint, tmp_path, kind):
    """Drafts after a prompt fed as two prefill chunks and decode steps (the head's K/V rows and the
    hidden row before each forward carried across forwards), then after a verify cut back."""
    runner = _runner(gguf(kind), mtp=True)
    tokens = random_tokens(PROMPT + 9, seed=11)
    seq = runner.new_sequence()
    runner.prefill(seq, tokens[:10])
    runner.prefill(seq, tokens[10:PROMPT])
    for t in tokens[PROMPT:PROMPT + 3]:
        runner.decode([seq], [t])
    n = PROMPT + 3
    drafts, rows = runner.model.mtp.draft_logits(seq, tokens[n], 3)
    head = _transformers_head(tiny_checkpoint(FAMILIES[kind]), tmp_path)
    ref = _reference(head, tokens[:n], tokens[n], 3)
    assert float(np.std(ref)) > 0.3  # not flat
    np.testing.assert_allclose(rows, ref, atol=TOL, rtol=0)
    assert drafts == [int(np.argmax(r)) for r in ref]
    assert seq.length == n  # drafting leaves the sequence alone
    runner.verify(seq, tokens[n:n + 5])  # five fed, two kept: the state after the second
    seq.trim(n + 2)
    _, rows = runner.model.mtp.draft_logits(seq, tokens[n + 2], 2)
    ref = _reference(head, tokens[:n + 2], tokens[n + 2], 2)
    np.testing.assert_allclose(rows, ref, atol=TOL, rtol=0)


# ---------------------------------------------------------------------------- recurrent rollback


def test_a_verify_keeps_the_state_after_each_token(gguf):
    """Cut back to any position inside a verify, the sequence continues exactly as one fed token by token."""
    runner = _runner(gguf("dense"), mtp=False)
    prompt, fed = random_tokens(12, seed=1), random_tokens(5, seed=2)
    for keep in (1, 3, 5):
        a, b = runner.new_sequence(), runner.new_sequence()
        runner.prefill(a, prompt)
        runner.prefill(b, prompt)
        rows = runner.verify(a, fed)
        steps = np.stack([runner.decode([b], [t])[0] for t in fed[:keep]])
        np.testing.assert_allclose(rows[:keep], steps, atol=1e-4, rtol=0)
        a.trim(len(prompt) + keep)
        assert a.length == b.length
        np.testing.assert_allclose(runner.decode([a], [7])[0], runner.decode([b], [7])[0], atol=1e-4, rtol=0)
    a.trim(len(prompt))  # the state before the verify is still there
    with pytest.raises(ValueError):
        a.trim(len(prompt) + 1)  # the verify states went with the next forward


# ---------------------------------------------------------------------------- generation


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_output_is_identical_with_mtp_ngram_and_plain(gguf, kind):
    from hf2q.engine.generate import generate_once

    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = random_tokens(12, seed=3) * 3
    plain_runner = _runner(gguf(kind), mtp=False)
    plain = generate_once(plain_runner, prompt, params, ignore_eos=True)
    ngram = generate_once(plain_runner, prompt, params, ignore_eos=True, draft_tokens=4)
    mtp = generate_once(_runner(gguf(kind), mtp=True), prompt, params, ignore_eos=True, draft_tokens=3)
    assert ngram["tokens"] == plain["tokens"] == mtp["tokens"]
    assert mtp["drafted_tokens"] > 0  # (n-gram drafts need the output to recur: rare at random weights)
    assert mtp["decode_forwards"] == plain["decode_steps"] - mtp["accepted_tokens"]


class _HeadAsOracle:
    """The MTP drafter with its first draft replaced by the known greedy token on most steps, so verify
    steps accept all, part or none of a draft the head continues (random weights rarely agree)."""

    def __init__(self, runner, seq, answer: list[int], skip: int):
        from hf2q.engine.speculative import MtpDrafter

        self.inner, self.answer, self.seen, self.skip = MtpDrafter(runner, seq), answer, 0, skip

    def append(self, token: int) -> None:
        self.inner.append(token)
        self.seen += 1

    def propose(self, k: int) -> list[int]:
        draft = self.inner.propose(k)
        at = self.seen - self.skip
        if draft and self.seen % 4 and at < len(self.answer):
            draft[0] = self.answer[at]
        return draft


def test_greedy_output_is_identical_whatever_the_head_accepts(gguf):
    from hf2q.engine import generate

    params = SamplingParams(max_tokens=30, temperature=0.0)
    prompt = random_tokens(20, seed=5)
    plain = generate.generate_once(_runner(gguf("dense"), mtp=False), prompt, params, ignore_eos=True)
    runner = _runner(gguf("dense"), mtp=True, fresh=True)
    made = {}
    original = runner.new_sequence

    def new_sequence():
        made["seq"] = original()
        return made["seq"]

    runner.new_sequence = new_sequence

    class Lazy:  # built once generate_once has made its sequence
        def append(self, t):
            if "oracle" not in made:
                made["oracle"] = _HeadAsOracle(runner, made["seq"], plain["tokens"][1:], len(prompt) + 1)
            made["oracle"].append(t)

        def propose(self, k):
            return made["oracle"].propose(k)

    spec = generate.generate_once(runner, prompt, params, ignore_eos=True, draft_tokens=3, drafter=Lazy())
    assert spec["tokens"] == plain["tokens"]
    assert 0 < spec["accepted_tokens"] < spec["drafted_tokens"]


def test_sampled_generation_keeps_the_target_distribution(gguf):
    """At T > 0 the first token after a fixed context, drawn through MTP verify steps, is distributed as
    the target's sampling distribution (the acceptance rule is ``speculative.accept_draft``'s)."""
    from hf2q.engine.sampling import Sampler
    from hf2q.engine.speculative import accept_draft

    runner = _runner(gguf("dense"), mtp=True)
    prompt = random_tokens(16, seed=9)
    seq = runner.new_sequence()
    logits = runner.prefill(seq, prompt)
    params = SamplingParams(temperature=4.0, top_k=4, seed=3)
    pending = int(np.argmax(logits))
    draft = runner.draft(seq, pending, 2)
    rows = runner.verify(seq, [pending] + draft)
    # the columns that matter (the target's top 8 and the draft), so each draw samples a short row
    cols = np.union1d(np.argsort(rows[0])[-8:], draft)
    rows, draft = rows[:, cols], [int(np.searchsorted(cols, d)) for d in draft]
    p = Sampler(params).truncated_probs(Sampler(params).process(rows[0]))
    s, n = Sampler(params), 6000
    counts = np.bincount([accept_draft(s, draft, rows, [])[0] for _ in range(n)], minlength=p.size) / n
    assert p[draft[0]] < 0.9  # the draft is not simply the sure token
    assert np.abs(counts - p).max() < 0.03, (counts[p > 0], p[p > 0])


# ---------------------------------------------------------------------------- command line


def test_generate_cli_mtp_is_byte_identical(gguf, cli):
    path = gguf("dense")
    args = ["generate", "--model", str(path), "--prompt", "hello there", "--raw", "--max-tokens", "12",
            "--ignore-eos"]
    plain = cli(*args)
    mtp = cli(*args, "--speculative", "mtp", "--draft-tokens", "2")
    assert plain.code == 0 and mtp.code == 0, mtp.err
    assert mtp.out == plain.out and mtp.out.strip()


def test_mtp_without_a_nextn_block_is_a_clear_input_error(no_mtp_gguf, cli):
    r = cli("generate", "--model", str(no_mtp_gguf), "--prompt", "hi", "--speculative", "mtp")
    assert r.code == 3
    assert "nextn" in r.err and "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------- serving


def _plain_greedy(runner, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of ``prompt`` decoded one by one, without the end-of-generation token that stops them."""
    from hf2q.engine.generate import generate_once

    out = generate_once(runner, prompt, SamplingParams(max_tokens=n, temperature=0.0))
    return out["tokens"][:-1] if out["finish_reason"] == "stop" else out["tokens"]


@pytest.mark.parametrize("kind", ["dense", "moe"])
async def test_the_runtime_decodes_a_lone_request_with_mtp_drafts(gguf, kind):
    """The server's step loop (slots, bounded prefill, drafts made in the engine thread) with the real
    engine: T=0 tokens are plain greedy decoding's, and the drafts are counted."""
    from hf2q.actors.runtime import open_runtime
    from hf2q.sched.contracts import GenerationRequest, RuntimeConfig, Token

    path = gguf(kind)
    prompt, n = random_tokens(40, seed=13), 20
    config = RuntimeConfig(slots=2, ctx=256, draft_tokens=3, prefill_chunk=16, gpu_deadline_s=300)
    async with open_runtime(lambda: _runner(path, mtp=True, fresh=True), config) as rt:
        assert await rt.wait_ready(), rt.readiness()
        ch = await rt.submit(GenerationRequest("r", tuple(prompt), SamplingParams(max_tokens=n)))
        async with ch:
            events = [e async for e in ch]
        counters = rt.snapshot().counters
    reference = _plain_greedy(_runner(path, mtp=False), prompt, n)  # this thread: MLX streams are per thread
    assert [e.token_id for e in events if isinstance(e, Token)] == reference
    assert counters["drafted_tokens"] > 0
    assert counters["gpu_steps"] < len(reference) + len(prompt) // 16 + 1  # verify forwards, not one per token


def test_a_server_step_verifies_a_listed_draft_on_a_hybrid_model(gguf):
    """The step the server runs for a lone request (``run_step`` with an n-gram-style token list) on the
    qwen35 model: it stops the sequence at the last accepted token, and decoding goes on as plain decoding."""
    from types import SimpleNamespace

    from hf2q.engine.sampling import Sampler
    from hf2q.engine.step import Drafted, run_step

    runner = _runner(gguf("dense"), mtp=False)
    prompt = random_tokens(16, seed=21)
    answer = _plain_greedy(runner, prompt, 12)
    seq = runner.new_sequence()
    runner.prefill(seq, prompt)
    run = SimpleNamespace(slot=0, seq=seq, sampler=Sampler(SamplingParams(temperature=0.0)), history=[])
    out, fed = [answer[0]], 0
    while len(out) < len(answer):
        good = answer[len(out):len(out) + 3]
        draft = good[:1] + [(t + 1) % 1000 for t in good[1:]]  # the first drafted token right, the rest wrong
        res = run_step(runner, [run], [out[-1]], None, draft=draft)[0]
        assert isinstance(res, Drafted) and res.tokens[0] == draft[0]
        fed += len(res.tokens)
        out += list(res.tokens)
        run.history = list(out)
        assert seq.length == len(prompt) + fed
    assert out[:len(answer)] == answer


@pytest.mark.slow  # two real servers (~40 s)
def test_serve_speculative_mtp_over_http_is_byte_identical(gguf, tmp_path):
    import httpx

    from tests.serve_support import hf2q_server

    path = gguf("dense")
    body = {"messages": [{"role": "user", "content": "Write a haiku about rivers."}], "temperature": 0,
            "max_tokens": 16}
    answers, metrics = {}, {}
    for mode in ("off", "mtp"):
        logs = tmp_path / mode
        logs.mkdir()
        with hf2q_server(["--model", str(path), "--slots", "1", "--ctx", "512", "--speculative", mode], logs) as url:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers[mode] = r.json()["choices"][0]["message"]
            metrics[mode] = httpx.get(url + "/metrics", timeout=10).text
    assert answers["mtp"] == answers["off"] and answers["off"].get("content")
    drafted = [line for line in metrics["mtp"].splitlines() if line.startswith("hf2q_drafted_tokens")]
    assert drafted and float(drafted[0].split()[-1]) > 0


def test_serve_refuses_mtp_for_a_file_without_its_head(no_mtp_gguf):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "hf2q", "serve", "--model", str(no_mtp_gguf), "--speculative", "mtp", "--port",
                        "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "nextn" in r.stderr and "Traceback" not in r.stderr
