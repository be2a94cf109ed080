"""Speculative decoding with n-gram (prompt-lookup) or MTP drafts: hf2q with and without, and llama.cpp's peer.

Workload: an agentic edit — the prompt holds a source file and asks for the whole file back with one
small change, so most of the answer is already in the context and drafts should hit. Greedy
(temperature 0); hf2q's two runs must produce the same tokens (checked, reported as ``identical``).

* hf2q — ``generate_once`` in-process, plain decode vs ``--speculative ngram`` at each
  ``--draft-tokens``; decode tokens/s (after the first token), acceptance rate, tokens per forward.
* llama.cpp — ``llama-server --spec-type ngram-simple`` (its n-gram drafting; ``llama-completion``
  has no speculative mode here and ``llama-lookup`` / ``llama-speculative`` are not built) vs the
  same server without drafting, through ``/v1/chat/completions`` with the same messages (rendered by
  its own ``--jinja``); its
  ``timings`` give tokens/s and drafted / accepted counts. Skipped, with the reason, when absent.

* ``--mode mtp`` (a Qwen 3.5 / 3.6 GGUF with its ``nextn`` block): the drafts come from the model's
  multi-token-prediction head (``--speculative mtp``), against plain decoding of a runner without the
  head; and ``rollback`` times the two ways a hybrid-recurrent sequence can stop inside a verify
  forward: the recurrent state kept after each verified token (what the engine does) against going
  back to the state before the forward and feeding the accepted tokens again; and ``draft`` times
  ``runner.draft`` alone after the prompt (the head's cost per call of k tokens). With random weights
  (``bench/synth_gguf.py``, the tiny test checkpoints) the head's acceptance means nothing: only the
  costs do.

    python bench/speculative.py --out bench-speculative.json
    python bench/speculative.py --model some.gguf --draft-tokens 4,8,16 --max-tokens 384
    python bench/speculative.py --mode mtp --model qwen35.gguf --draft-tokens 1,2,3 --skip-llama-cpp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import chat_model, emit  # noqa: E402

#: the file the edit prompt carries (a real module of this repository, so the text is natural code)
EDIT_SOURCE = ROOT / "hf2q" / "atomic.py"
EDIT_ASK = ("Rewrite the following Python file with the function `{old}` renamed to `{new}` everywhere. "
            "Reply with the complete updated file only, in one code block.\n\n```python\n{source}```\n")


def edit_prompt() -> str:
    source = EDIT_SOURCE.read_text(encoding="utf-8")
    import re

    names = re.findall(r"^def (\w+)\(", source, flags=re.M)
    old = names[0] if names else "main"
    return EDIT_ASK.format(old=old, new=old + "_v2", source=source)


def bench_hf2q(model: Path, text: str, draft_list: list[int], max_tokens: int, reps: int, mode: str = "ngram") -> dict:
    from hf2q.engine.factory import load_runner
    from hf2q.engine.generate import generate_once, render_prompt
    from hf2q.sched.contracts import SamplingParams
    from hf2q.text.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer.from_gguf(model)
    prompt = render_prompt(argparse.Namespace(prompt=text, prompt_file=None, raw=False, chat_template=None,
                                              chat_template_file=None, no_thinking=False), model, tokenizer)
    runner = load_runner(model)
    drafting = runner
    if mode == "mtp":  # the head writes K/V rows in every forward: the plain runs keep a runner without it
        drafting = load_runner(model)
        drafting.enable_mtp()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for r in {id(runner): runner, id(drafting): drafting}.values():
        generate_once(r, prompt, SamplingParams(max_tokens=4, temperature=0.0), draft_tokens=2)  # warm kernels

    configs = [0] + draft_list
    got: dict[int, list[dict]] = {k: [] for k in configs}
    for _ in range(reps):  # interleaved, so a load change on a shared machine hits every config alike
        for k in configs:
            got[k].append(generate_once(drafting if k else runner, prompt, params, draft_tokens=k))

    def row(k: int) -> dict:
        r = got[k][-1]
        out = {"decode_tokens_per_sec": round(statistics.median(x["decode_tokens_per_sec"] for x in got[k]), 2),
               "generated_tokens": r["generated_tokens"], "finish_reason": r["finish_reason"]}
        if k:
            out.update(draft_tokens=k, drafted=r["drafted_tokens"], accepted=r["accepted_tokens"],
                       acceptance_rate=round(r["accepted_tokens"] / max(r["drafted_tokens"], 1), 4),
                       tokens_per_forward=round(r["decode_steps"] / max(r["decode_forwards"], 1), 3),
                       identical=r["tokens"] == got[0][-1]["tokens"])
        return out

    plain = row(0)
    out = {"prompt_tokens": len(prompt), "plain": plain, mode: []}
    for k in draft_list:
        r = row(k)
        r["speedup"] = round(r["decode_tokens_per_sec"] / plain["decode_tokens_per_sec"], 3)
        out[mode].append(r)
    if mode == "mtp":
        out["rollback"] = bench_rollback(runner, prompt, max(draft_list), reps)
        out["draft"] = bench_draft(drafting, prompt, draft_list, reps)
    return out


def bench_draft(runner, prompt: list[int], draft_list: list[int], reps: int, calls: int = 16) -> dict:
    """Milliseconds per ``runner.draft`` call of ``k`` tokens after the whole prompt (the head attends over
    its K/V rows of every prompt position), each ``k`` of ``draft_list``: the drafting cost alone."""
    seq = runner.new_sequence()
    logits = runner.prefill(seq, prompt)
    pending = int(logits.argmax())
    runner.draft(seq, pending, max(draft_list))  # warm
    out = {"context_tokens": seq.length}
    for k in draft_list:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(calls):
                runner.draft(seq, pending, k)
            times.append((time.perf_counter() - t0) * 1000 / calls)
        out[f"k{k}_ms"] = round(statistics.median(times), 3)
    return out


def bench_rollback(runner, prompt: list[int], k: int, reps: int, steps: int = 24) -> dict:
    """Milliseconds per verify step of ``1 + k`` tokens that keeps ``j`` of them (``j`` cycling through
    ``1 … k``): the recurrent state kept after each token vs the state before the forward + a re-feed."""
    from hf2q.engine import kv_cache
    from hf2q.engine.speculative import keep_accepted

    fed = [(prompt[i % len(prompt)] + 1) % runner.vocab_size for i in range(k + 1)]

    def run(per_position: bool) -> float:
        kept = kv_cache.ForwardBatch.keeps_every_state
        if not per_position:
            kv_cache.ForwardBatch.keeps_every_state = property(lambda self: False)
        try:
            seq = runner.new_sequence()
            runner.prefill(seq, prompt)
            t0 = time.perf_counter()
            for i in range(steps):
                start = seq.length
                runner.verify(seq, fed)
                keep_accepted(runner, seq, start, fed[:1 + i % k])
            return (time.perf_counter() - t0) * 1000 / steps
        finally:
            kv_cache.ForwardBatch.keeps_every_state = kept

    if not hasattr(runner.model, "new_recurrent_state"):
        return {"skipped": "not a hybrid-recurrent model"}
    per, replay = [], []
    for _ in range(reps):
        per.append(run(True))
        replay.append(run(False))
    return {"verify_tokens": k + 1, "per_position_states_ms": round(statistics.median(per), 2),
            "replay_ms": round(statistics.median(replay), 2)}


def bench_llama_cpp(model: Path, text: str, max_tokens: int, threads: int) -> dict:
    from tests.tools import llama_cpp

    exe = llama_cpp.tool("llama-server")
    if exe is None:
        return {"skipped": "llama-server is not built here (python -m tests.tools.llama_cpp)"}
    out = {"note": "llama-completion has no speculative option in this build and llama-lookup / "
                   "llama-speculative are not built; llama-server --spec-type ngram-simple is its n-gram peer"}
    for name, extra in (("plain", []), ("ngram_simple", ["--spec-type", "ngram-simple"])):
        try:
            out[name] = _llama_server_run(exe, model, text, max_tokens, threads, extra, llama_cpp.env())
        except (OSError, RuntimeError, ValueError) as e:
            out[name] = {"error": str(e)[:300]}
    plain, spec = out.get("plain", {}), out.get("ngram_simple", {})
    if plain.get("decode_tokens_per_sec") and spec.get("decode_tokens_per_sec"):
        out["speedup"] = round(spec["decode_tokens_per_sec"] / plain["decode_tokens_per_sec"], 3)
    return out


def _llama_server_run(exe: Path, model: Path, text: str, max_tokens: int, threads: int, extra: list[str],
                      env: dict) -> dict:
    from serve import free_port, stop, wait_http_ready

    port = free_port()
    cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "4096", "-t", str(threads),
           "--jinja", "-ngl", "0", "--no-webui", "--parallel", "1", *extra]
    with open(os.devnull, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**env, "OMP_WAIT_POLICY": "PASSIVE"})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http_ready(url, proc, "/health", 300)
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0.0,
                    "cache_prompt": False}
            res = _post(url + "/v1/chat/completions", body)  # warm-up
            res = _post(url + "/v1/chat/completions", body)
        finally:
            stop(proc)
    t = res.get("timings", {})
    row = {"decode_tokens_per_sec": round(float(t.get("predicted_per_second", 0.0)), 2),
           "generated_tokens": int(t.get("predicted_n", 0))}
    if "draft_n" in t:
        row.update(drafted=int(t["draft_n"]), accepted=int(t.get("draft_n_accepted", 0)),
                   acceptance_rate=round(int(t.get("draft_n_accepted", 0)) / max(int(t["draft_n"]), 1), 4))
    return row


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF (default: the built-in chat model)")
    p.add_argument("--mode", choices=["ngram", "mtp"], default="ngram", help="where the drafts come from")
    p.add_argument("--draft-tokens", default=None, help="comma-separated draft lengths to try (default 3,6; "
                   "mtp: 1,2,3)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server threads")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args(argv)
    from hf2q.engine.factory import prepare_mlx

    prepare_mlx()
    model = chat_model(args.model)
    drafts = args.draft_tokens or ("1,2,3" if args.mode == "mtp" else "3,6")
    text = edit_prompt()
    t0 = time.perf_counter()
    report = {"model": model.name, "workload": f"rewrite {EDIT_SOURCE.relative_to(ROOT)} with one rename",
              "temperature": 0.0, "max_tokens": args.max_tokens, "reps": args.reps,
              "hf2q": bench_hf2q(model, text, [int(k) for k in drafts.split(",")], args.max_tokens, args.reps,
                                 args.mode)}
    if args.mode == "mtp":
        report["note"] = "random weights (synthetic / test files) make the MTP acceptance rate meaningless"
    report["llama_cpp"] = ({"skipped": "--skip-llama-cpp"} if args.skip_llama_cpp
                           else bench_llama_cpp(model, text, args.max_tokens, args.threads))
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
