"""DeepSeek-V4 multi-token prediction from llama.cpp's ``--mtp`` companion GGUF.

The trunk is llama.cpp's f32 conversion of the tiny checkpoint (``test_engine_deepseek4``); the head
is ``hf2q convert --mtp`` of the same checkpoint with its hand-made ``mtp.0.*`` block (byte-identical
to llama.cpp's ``--mtp`` export: ``test_convert_deepseek4``). The stock llama.cpp build has no driver
that prints MTP drafts, so the head's forward is checked against a torch reference written here from
llama.cpp's ``graph_mtp`` (``src/models/deepseek4.cpp``), reading the companion file with the PyPI
``gguf`` reader: per-stream enorm/hnorm + ``eh_proj``, the hyper-connection pre/post mixes with
Sinkhorn, sliding-window shared-KV attention with sinks, the grouped low-rank output, the
sqrt-softplus MoE with its shared expert, the file's own hyper-connection head and the LM head.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from hf2q.actors.runtime import open_runtime
from hf2q.engine.runner import MlxModelRunner
from hf2q.engine.speculative import keep_accepted
from hf2q.sched.contracts import GenerationRequest, RuntimeConfig, SamplingParams, Token
from tests.engine_support import random_tokens, speculative_greedy
from tests.test_deepseek4_speculative import _greedy
from tests.test_engine_deepseek4 import deepseek4_gguf

CTX = 512
PROMPT = 150  # past the 128-position window, so the head's attention drops rows too
K = 3


def companion_gguf():
    """``hf2q convert --mtp`` of the tiny checkpoint with its MTP block (kept beside it)."""
    from hf2q.cli import main
    from tests.models.cache import build_once
    from tests.models.deepseek4 import deepseek4_checkpoint

    src = deepseek4_checkpoint(mtp=True)

    def build(out):
        assert main(["convert", str(src), "--quant", "f16", "--mtp", "-o", str(out / "mtp.gguf")]) == 0

    return build_once(f"{src.name}-hf2q-mtp-v1", build) / "mtp.gguf"


@pytest.fixture(scope="module")
def files():
    return deepseek4_gguf(), companion_gguf()


@pytest.fixture(scope="module")
def runners(files):
    trunk, head = files
    plain = MlxModelRunner.load(trunk, ctx=CTX)
    drafting = MlxModelRunner.load(trunk, ctx=CTX)
    drafting.enable_mtp(head)
    return plain, drafting


# --------------------------------------------------------------------------- the torch reference

class TorchMtpHead:
    """llama.cpp's ``graph_mtp`` of DeepSeek-V4 over the companion file's tensors, in float64."""

    def __init__(self, path):
        import gguf
        import torch
        from gguf import quants

        r = gguf.GGUFReader(str(path))
        field = lambda k: r.fields[f"deepseek4.{k}"].contents()  # noqa: E731
        self.w = {t.name: torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), np.float64))
                  for t in r.tensors}
        self.n = int(field("block_count")) - 1
        self.eps = float(field("attention.layer_norm_rms_epsilon"))
        self.hc_eps = float(field("hyper_connection.epsilon"))
        self.iters = int(field("hyper_connection.sinkhorn_iterations"))
        self.heads = int(field("attention.head_count"))
        self.head_dim = int(field("attention.key_length"))
        self.rope = int(field("rope.dimension_count"))
        self.base = float(field("rope.freq_base"))
        self.window = int(field("attention.sliding_window"))
        self.groups = int(field("attention.output_group_count"))
        self.top_k = int(field("expert_used_count"))
        self.scale = float(field("expert_weights_scale"))
        self.clamp = float(field("swiglu_clamp_exp")[self.n])
        self.torch = torch

    def t(self, name):
        return self.w[name.format(i=self.n)]

    def rms(self, x, w=None):
        y = x / self.torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps)
        return y * w if w is not None else y

    def rope_rows(self, x, pos, sign=1.0):
        """NORM RoPE (adjacent pairs) on the last ``rope`` channels of ``x [T, ..., D]``."""
        torch, r = self.torch, self.rope
        freq = self.base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
        ang = sign * pos.to(torch.float64)[:, None] * freq[None]  # [T, r/2]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
        cos, sin = torch.cos(ang).reshape(shape), torch.sin(ang).reshape(shape)
        a, b = x[..., -r:][..., 0::2], x[..., -r:][..., 1::2]
        rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([x[..., :-r], rot], dim=-1)

    def hc_pre(self, x, site):
        """``x [T, hc, d]`` → (mixed input [T, d], post [T, hc], comb [T, dst, src])."""
        torch = self.torch
        T, hc, _ = x.shape
        fn, base, scale = (self.t(f"blk.{{i}}.hc_{site}_{p}.weight") for p in ("fn", "base", "scale"))
        mixes = self.rms(x.reshape(T, -1)) @ fn.T
        pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + self.hc_eps
        post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        # ggml's comb is [dst (fastest), src]: element (dst, src) = mixes[2hc + src·hc + dst]
        comb = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(T, hc, hc)  # [T, src, dst]
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(1, self.iters):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return (pre[..., None] * x).sum(1), post, comb

    def hc_post(self, out, residual, post, comb):
        return post[..., None] * out[:, None, :] + self.torch.einsum("tsd,tsh->tdh", comb, residual)

    def attention(self, x, pos):
        torch, H, D = self.torch, self.heads, self.head_dim
        T = x.shape[0]
        q = self.rms(x @ self.t("blk.{i}.attn_q_a.weight").T, self.t("blk.{i}.attn_q_a_norm.weight"))
        q = self.rope_rows(self.rms((q @ self.t("blk.{i}.attn_q_b.weight").T).reshape(T, H, D)), pos)
        kv = self.rope_rows(self.rms(x @ self.t("blk.{i}.attn_kv.weight").T, self.t("blk.{i}.attn_kv_a_norm.weight")),
                            pos)
        logits = torch.einsum("thd,sd->hts", q, kv) / D ** 0.5
        allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
        logits = logits.masked_fill(~allowed[None], float("-inf"))
        sinks = self.t("blk.{i}.attn_sinks.weight")[:, None, None].expand(H, T, 1)
        probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]
        out = self.rope_rows(torch.einsum("hts,sd->thd", probs, kv), pos, sign=-1.0)  # [T, H, D]
        G = self.groups
        wo_a = self.t("blk.{i}.attn_output_a.weight")
        wo_a = wo_a.reshape(G, wo_a.shape[0] // G, -1)  # [G, o_lora, in_group]
        low = torch.einsum("tgi,goi->tgo", out.reshape(T, G, -1), wo_a).reshape(T, -1)
        return low @ self.t("blk.{i}.attn_output_b.weight").T

    def moe(self, x):
        torch, lim = self.torch, self.clamp
        scores = torch.sqrt(torch.nn.functional.softplus(x @ self.t("blk.{i}.ffn_gate_inp.weight").T))
        idx = torch.topk(scores + self.t("blk.{i}.exp_probs_b.bias"), self.top_k, dim=-1).indices
        weights = torch.gather(scores, -1, idx)
        weights = weights / weights.sum(-1, keepdim=True) * self.scale

        def swiglu(g, u):
            g, u = g.clamp(max=lim), u.clamp(-lim, lim)
            return torch.nn.functional.silu(g) * u

        gate, up, down = (self.t(f"blk.{{i}}.ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for e, w in zip(idx[t].tolist(), weights[t]):
                out[t] += w * (down[e] @ swiglu(gate[e] @ x[t], up[e] @ x[t]))
        sg, su, sd = (self.t(f"blk.{{i}}.ffn_{p}_shexp.weight") for p in ("gate", "up", "down"))
        return out + swiglu(x @ sg.T, x @ su.T) @ sd.T

    def block(self, tokens, hidden):
        """The head over ``tokens [T]`` at positions 0.. paired with ``hidden [T, hc, d]``: output streams
        and logits of every position."""
        torch = self.torch
        e = self.rms(self.t("token_embd.weight")[torch.tensor(tokens)], self.t("blk.{i}.nextn.enorm.weight"))
        h = self.rms(hidden, self.t("blk.{i}.nextn.hnorm.weight"))
        u = torch.cat([e[:, None, :].expand_as(h), h], dim=-1) @ self.t("blk.{i}.nextn.eh_proj.weight").T
        pos = torch.arange(len(tokens))
        x, post, comb = self.hc_pre(u, "attn")
        u = self.hc_post(self.attention(self.rms(x, self.t("blk.{i}.attn_norm.weight")), pos), u, post, comb)
        x, post, comb = self.hc_pre(u, "ffn")
        v = self.hc_post(self.moe(self.rms(x, self.t("blk.{i}.ffn_norm.weight"))), u, post, comb)
        T, hc, _ = v.shape
        pre = torch.sigmoid((self.rms(v.reshape(T, -1)) @ self.t("output_hc_fn.weight").T)
                            * self.t("output_hc_scale.weight")[0] + self.t("output_hc_base.weight")) + self.hc_eps
        g = self.rms((pre[..., None] * v).sum(1), self.t("blk.{i}.nextn.shared_head_norm.weight"))
        return v, g @ self.t("output.weight").T


def test_drafts_match_the_torch_reference(files, runners):
    """The head's k chained drafts after a prompt longer than its window: its cache rows written by the
    trunk's forward, its own output streams fed back, logits within float32 noise of the reference."""
    import torch

    _, drafting = runners
    prompt = random_tokens(PROMPT, low=3, high=49152, seed=21)
    seq = drafting.new_sequence()
    pending = int(np.argmax(drafting.verify(seq, prompt)[-1]))  # a verify keeps every position's streams
    streams = np.array(seq.mtp_hidden[1])[1:]  # positions 0 … PROMPT − 1
    tokens, logits = drafting.model.mtp.draft_logits(seq, pending, K)
    assert seq.length == PROMPT

    ref = TorchMtpHead(files[1])
    hidden = torch.from_numpy(np.concatenate([np.zeros_like(streams[:1]), streams]).astype(np.float64))
    # token p pairs with the trunk's streams at p − 1 (llama.cpp's driver: (h_p, x_{p+1}) at position p + 1);
    # position 0 pairs with zeros (the driver's initial pending row)
    seq_tokens = list(prompt) + [pending]
    want_tokens, want_rows = [], []
    for _ in range(K):
        v, rows = ref.block(seq_tokens, hidden)
        want_rows.append(rows[-1].numpy())
        want_tokens.append(int(rows[-1].argmax()))
        seq_tokens.append(want_tokens[-1])
        hidden = torch.cat([hidden, v[-1:]])
    want = np.stack(want_rows)
    assert tokens == want_tokens
    assert float(np.abs(logits - want).max()) < 1e-3 * max(1.0, float(np.abs(want).max()))


def test_a_forward_looks_up_its_embedding_rows_once(runners, monkeypatch):
    """The head's cache rows of a trunk forward reuse the trunk's embedding rows (the companion shares them)."""
    _, drafting = runners
    embed, calls = drafting.model.embed, []
    real = embed.rows

    def counted(tokens):
        calls.append(tokens.shape)
        return real(tokens)
    monkeypatch.setattr(embed, "rows", counted)
    assert drafting.model.mtp.embed is embed
    drafting.prefill(drafting.new_sequence(), random_tokens(20, low=3, high=49152, seed=2))
    assert len(calls) == 1, calls


def test_a_partial_accept_rolls_the_head_back(runners):
    """After a verify trimmed to its accepted length the head drafts what it drafts after a cold prefill
    of the same text: its rows and streams inside the verify are the ones kept."""
    plain, drafting = runners
    prompt = random_tokens(60, low=3, high=49152, seed=4)
    first, right = _greedy(plain, prompt, 2)
    seq = drafting.new_sequence()
    assert int(np.argmax(drafting.prefill(seq, prompt))) == first
    start = seq.length
    draft = [right, (right + 1) % 49152, (right + 2) % 49152]  # the first draft token right, then wrong
    rows = drafting.verify(seq, [first] + draft)
    nxt = int(np.argmax(rows[1]))
    keep_accepted(drafting, seq, start, [first, right])
    assert seq.length == start + 2
    cold = drafting.new_sequence()
    drafting.prefill(cold, prompt + [first, right])
    got, got_logits = drafting.model.mtp.draft_logits(seq, nxt, K)
    want, want_logits = drafting.model.mtp.draft_logits(cold, nxt, K)
    assert got == want
    assert float(np.abs(got_logits - want_logits).max()) < 1e-4 * max(1.0, float(np.abs(want_logits).max()))
    # and the trunk goes on as the plain model does
    assert np.allclose(drafting.decode([seq], [nxt])[0], plain.decode(*_cold(plain, prompt + [first, right], nxt))[0],
                       atol=1e-4)


def _cold(runner, tokens, nxt):
    s = runner.new_sequence()
    runner.prefill(s, tokens)
    return [s], [nxt]


N_NEW = 12


async def test_runtime_greedy_output_is_the_same_with_mtp(runners):
    """Through the serving runtime (slots decoding batched while several requests run, drafting and
    verifying when one runs alone), T=0 output is the plain model's token for token."""
    plain, drafting = runners
    prompts = [random_tokens(n, low=3, high=49152, seed=30 + n) for n in (40, 70, 140)]
    reference = [_greedy(plain, p, N_NEW) for p in prompts]

    out: dict[int, list[int]] = {}

    async def run(rt, i, p):
        ch = await rt.submit(GenerationRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=N_NEW)))
        async with ch:
            out[i] = [e.token_id for e in [e async for e in ch] if isinstance(e, Token)]

    async with open_runtime(lambda: drafting, RuntimeConfig(slots=3, ctx=CTX, draft_tokens=K,
                                                            gpu_deadline_s=300)) as rt:
        assert await rt.wait_ready(), rt.readiness()
        async with trio.open_nursery() as n:
            for i, p in enumerate(prompts):
                n.start_soon(run, rt, i, p)
        await run(rt, 9, prompts[2])
        counters = rt.snapshot().counters
    assert [out[i] for i in range(len(prompts))] == reference
    assert out[9] == reference[2]
    assert counters["drafted_tokens"] > 0  # the request alone verified the head's drafts


def test_accepting_the_heads_drafts_keeps_greedy_output(runners):
    """Speculative greedy decoding on the engine with the head's drafts gives the plain greedy tokens."""
    plain, drafting = runners
    prompt = random_tokens(90, low=3, high=49152, seed=8)
    reference = _greedy(plain, prompt, N_NEW)
    seq = drafting.new_sequence()
    out, _, _ = speculative_greedy(drafting, seq, int(np.argmax(drafting.prefill(seq, prompt))), prompt, N_NEW, K)
    assert out == reference


def test_cli_checks_the_companion(cli, files):
    trunk, head = files
    base = ("generate", "--model", trunk, "--prompt", "hi", "--raw", "--max-tokens", "2")
    r = cli(*base, "--speculative", "mtp")
    assert r.code == 3 and "--model-draft" in r.err
    r = cli(*base, "--model-draft", head)
    assert r.code == 2 and "--speculative mtp" in r.err
    r = cli(*base, "--speculative", "mtp", "--model-draft", trunk)
    assert r.code == 3 and "no MTP block" in r.err
    r = cli("serve", "--model", trunk, "--speculative", "mtp", "--model-draft", head, "--tensor-parallel", "3")
    assert r.code == 3 and "do not split over 3 ranks" in r.err  # refused before any rank starts


def test_tensor_parallel_start_up_check_cuts_the_companion(files):
    """At ``--tensor-parallel`` the companion's block must split as the trunk's does (header views only)."""
    from argparse import Namespace

    from hf2q.engine.speculative import check_speculative
    from hf2q.formats.gguf_file import open_gguf

    trunk, head = files
    check_speculative(open_gguf(trunk), Namespace(speculative="mtp", model_draft=head, tensor_parallel=2))


def test_memory_plan_and_info_count_the_head(files, runners):
    """``info`` of the companion names what ``--speculative mtp --model-draft`` adds: at least the weights the
    engine loads for it, and a per-slot bound on its window layer that a long sequence stays under; the
    serve memory check and the KV plan count both."""
    from hf2q.engine.device_probe import probe
    from hf2q.engine.memory_plan import check_model, kv_need
    from hf2q.formats.gguf_file import open_gguf
    from hf2q.info import inspect

    trunk, head = files
    plain, drafting = runners
    info = inspect(head, slots=2)
    assert info["kind"] == "mtp" and info["serve_support"] == "rejected" and "--model-draft" in info["reject_reason"]
    loaded = drafting.model.weights_nbytes() - plain.model.weights_nbytes()
    assert 0 < loaded <= info["mtp_weight_bytes"] < 2 * loaded
    prompt = random_tokens(300, low=3, high=49152, seed=1)
    with_head, without = drafting.new_sequence(), plain.new_sequence()
    drafting.prefill(with_head, prompt)
    plain.prefill(without, prompt)
    assert 0 < with_head.nbytes - without.nbytes <= info["mtp_kv_bytes_per_slot"]
    hp, elem = open_gguf(trunk).hparams, probe().activation_bytes()
    assert (kv_need(hp, elem, mtp=True).slot_bytes(CTX) - kv_need(hp, elem).slot_bytes(CTX)
            == info["mtp_kv_bytes_per_slot"])
    args = dict(ctx=CTX, slots=2, kv_budget=1 << 20, limit=1 << 40)
    assert (check_model(trunk, 1, mtp=True, draft=head, **args).weights - check_model(trunk, 1, **args).weights
            == info["mtp_weight_bytes"])


def test_the_companion_is_opened_once(cli, files, monkeypatch):
    """``generate --speculative mtp --model-draft``: the start-up check's header is the one the engine loads."""
    from pathlib import Path

    import hf2q.formats.gguf_file as gguf_file

    trunk, head = files
    real, opened = gguf_file.open_gguf, []

    def counting(path, *a, **kw):
        opened.append(Path(path).resolve())
        return real(path, *a, **kw)
    monkeypatch.setattr(gguf_file, "open_gguf", counting)
    r = cli("generate", "--model", trunk, "--prompt", "hi", "--raw", "--max-tokens", "2", "--speculative", "mtp",
            "--model-draft", head)
    assert r.code == 0, r.err
    assert opened.count(Path(head).resolve()) == 1, opened


def test_generate_prints_the_same_text_with_the_head(cli, files):
    trunk, head = files
    base = ("generate", "--model", trunk, "--prompt", "The capital of France is", "--raw", "--max-tokens", "10",
            "--temperature", "0", "--ignore-eos")
    plain = cli(*base)
    drafted = cli(*base, "--speculative", "mtp", "--model-draft", head, "--draft-tokens", "2")
    assert plain.code == 0 and drafted.code == 0, drafted.err
    assert plain.out and drafted.out == plain.out


def _draft_without_position_0(runner, seq, token: int) -> np.ndarray:
    """The head's first draft after ``token`` with its cache row of position 0 (token 0 paired with the zero
    streams) left out of the draft's attention: what llama-server's first draft after a prompt reads."""
    from hf2q.engine.models import deepseek4_mtp
    from hf2q.engine.models.deepseek4_cache import Rows

    lane = deepseek4_mtp._DraftLane

    class _Without0(lane):
        def __init__(self, raw):
            cut = max(0, 1 - raw.start)
            super().__init__(Rows(raw.start + cut, raw.data[cut:]))

    deepseek4_mtp._DraftLane = _Without0
    try:
        return runner.draft_logits(seq, token, 1)[1][0]
    finally:
        deepseek4_mtp._DraftLane = lane


def _top_up_to_a_tie(logits: np.ndarray, token: int) -> bool:
    """Whether ``token`` is the argmax of ``logits``, or within float32 rounding of it (the random head's
    vocabulary of 49,152 leaves near-ties that another build's summation order can flip)."""
    return float(logits.max() - logits[token]) <= 1e-4 * float(np.abs(logits).max())


def test_llama_server_drafts_with_our_companion_as_we_do(files, runners, tmp_path):
    """Stock ``llama-server -m trunk -md companion --spec-type draft-mtp`` loads the file ``convert --mtp`` wrote
    and drafts with it; at every decode step after the first its first draft token (its debug log's
    ``draft candidate 0, pos 0``) is ours. Its first draft right after the prompt may leave the head's row of
    position 0 out (a llama.cpp quirk, docs/ENGINE.md): it is ours without that row or ours with it."""
    import json
    import re
    import subprocess
    import time
    import urllib.request

    from hf2q.engine.tp_launch import free_ports
    from tests.tools import llama_cpp

    server = llama_cpp.tool("llama-server")
    if server is None:
        pytest.skip("the llama.cpp oracle build has no llama-server")
    trunk, head = files
    prompt = random_tokens(40, low=3, high=49152, seed=7)
    port = free_ports(1)[0]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(server), "-m", str(trunk), "-md", str(head), "--spec-type", "draft-mtp",
                                 "--spec-draft-n-max", str(K), "-t", "1", "-c", "512", "-np", "1", "--port", str(port),
                                 "-v"], stdout=out, stderr=subprocess.STDOUT, env=llama_cpp.env())
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"prompt": prompt, "n_predict": 6, "temperature": 0, "top_k": 1, "return_tokens": True,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            theirs = json.load(r)["tokens"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text(errors="replace")  # (token pieces may split a UTF-8 character)
    firsts = [int(m) for m in re.findall(r"draft candidate +0, pos +0: +(\d+)", text)]
    assert len(firsts) >= 3, text[-2000:]

    plain, drafting = runners
    assert _greedy(plain, prompt, 6) == theirs  # the same trunk text
    seq, ours = drafting.new_sequence(), []
    drafting.prefill(seq, prompt)
    without_0 = _draft_without_position_0(drafting, seq, theirs[0])
    with_0 = drafting.draft_logits(seq, theirs[0], 1)[1][0]
    for t in theirs[:len(firsts)]:
        ours.append(drafting.draft(seq, t, 1)[0])
        drafting.decode([seq], [t])
    assert ours[1:] == firsts[1:len(ours)]
    margins = {"without row 0": float(without_0.max() - without_0[firsts[0]]),
               "with row 0": float(with_0.max() - with_0[firsts[0]]), "scale": float(np.abs(with_0).max())}
    # llama.cpp's first draft after the prompt: ours without the row of position 0 with an AVX-512 build,
    # ours with it (our own first draft) with an AVX2-only one (docs/ENGINE.md); nothing else
    assert _top_up_to_a_tie(without_0, firsts[0]) or _top_up_to_a_tie(with_0, firsts[0]), \
        (firsts[0], int(without_0.argmax()), ours[0], margins)
    assert int(without_0.argmax()) != ours[0], margins  # the row matters on this prompt: the check can tell
