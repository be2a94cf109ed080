"""Cached-turn time to first token of a growing agent transcript on a Qwen 3.5 shape: hf2q vs llama-server.

An agent resends its whole transcript every turn: a ~20 KB system prompt (tools, rules, a file it works
on), then tool calls and results appended turn after turn. A hybrid model's recurrent layers cannot be
cut back token by token, so a server reuses such a prompt only from a recurrent checkpoint at or before
where the new turn diverges (docs/ENGINE.md, "Hybrid recurrent state"). This measures, per turn, the
client's TTFT (request sent → first streamed delta), the server's ``cached_tokens`` and the turn's TTFT
over the cold first turn's; then the last turn once more with its first tool result edited, which leaves
the slot's history just past the system prompt (what a server keeps of the prefix there).

The model is a GGUF given with ``--model``, or a random-weight one of a real shape written by
``bench/synth_gguf.py`` (``--shape``, default the small ``qwen35-tiny`` that a 2-core CPU runs in
seconds; ``--shape qwen35-9b --gpu-layers 99`` on a GPU machine), with the qwen35 vocabulary llama.cpp
ships (its chat template included), so both servers read the same file. llama-server (``--jinja``,
same slots and context) is the peer where it is built and loads the file.

    python bench/ttft_cached.py --out ttft-cached.json
    python bench/ttft_cached.py --shape qwen35-9b --mix q4_k_m --gpu-layers 99 --turns 6
    python bench/ttft_cached.py --model some-qwen35.gguf --speculative mtp --skip-peer
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import emit  # noqa: E402
from serve import free_port, long_context, start_llama_server, stop, stream_chat, wait_http_ready  # noqa: E402

VOCAB = Path.home() / ".cache/hf2q/pypi-models/llama-cpp-python-0.3.36/llama.cpp/models/ggml-vocab-qwen35.gguf"
#: the answer each turn streams: TTFT is the measure, a few tokens are enough to see the first one
ANSWER_TOKENS = 4


def synth_model(shape: str, mix: str, out_dir: Path, mtp: bool) -> Path:
    """A random-weight GGUF of ``shape`` (``bench/synth_gguf.py``), written once into ``out_dir``."""
    out = out_dir / f"{shape}-{mix}{'-mtp' if mtp else ''}.gguf"
    if not out.exists():
        cmd = [sys.executable, str(ROOT / "bench" / "synth_gguf.py"), "--shape", shape, "--mix", mix,
               "--vocab-gguf", str(VOCAB), "-o", str(out), *(["--mtp"] if mtp else [])]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def agent_turns(context_bytes: int, turns: int) -> list[list[dict]]:
    """The messages of each turn: a ~``context_bytes`` system prompt and user task, then per turn one more
    assistant tool request and its tool result (as text, so any template renders them)."""
    system = {"role": "system", "content": "You are a coding agent. Tools: read_file, write_file, run_tests. "
              "The project notes follow.\n\n" + long_context(context_bytes)}
    messages = [system, {"role": "user", "content": "Rename the function parse_row to read_row everywhere."}]
    out = [list(messages)]
    for i in range(1, turns):
        messages += [{"role": "assistant", "content": f"Calling read_file on src/module_{i}.py."},
                     {"role": "user", "content": f"Result of read_file: def parse_row_{i}(x):\n    return x + {i}\n"}]
        out.append(list(messages))
    return out


def diverged_turn(turns: list[list[dict]]) -> list[dict] | None:
    """The last turn with its first tool result edited (an agent that re-ran a step): the prompt leaves the
    slot's history a few dozen tokens past the system prompt, so only a prefix up to there can be reused."""
    if len(turns) < 2:
        return None
    messages = [dict(m) for m in turns[-1]]
    messages[3]["content"] = messages[3]["content"].replace("return x", "return -x")
    return messages


async def transcript(url: str, turns: list[list[dict]]) -> list[dict]:
    """One row per turn, then (with two turns or more) one for :func:`diverged_turn` (``"diverged": True``)."""
    rows = []
    extra = diverged_turn(turns)
    async with httpx.AsyncClient(timeout=1800) as client:
        for messages in turns + ([extra] if extra else []):
            r = await stream_chat(client, url, messages, ANSWER_TOKENS)
            rows.append({"prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"],
                         "ttft_ms": round(r["ttft_s"] * 1000, 1)})
    if extra:
        rows[-1]["diverged"] = True
    cold = rows[0]["ttft_ms"]
    for r in rows[1:]:
        r["over_cold"] = round(r["ttft_ms"] / cold, 4) if cold else None
    return rows


def summary(rows: list[dict]) -> dict:
    """The cold turn's TTFT, the cached turns' median, their worst ratio to cold and least cached share."""
    out = {"cold_ttft_ms": rows[0]["ttft_ms"]}
    cached = [r for r in rows[1:] if not r.get("diverged")]
    if cached:
        out.update(cached_ttft_ms_median=statistics.median(r["ttft_ms"] for r in cached),
                   worst_over_cold=max(r["over_cold"] or 0.0 for r in cached),
                   min_cached_fraction=round(min((r["cached_tokens"] or 0) / max(r["prompt_tokens"] or 1, 1)
                                                 for r in cached), 4))
    diverged = [r for r in rows if r.get("diverged")]
    if diverged:
        out["diverged_ttft_ms"], out["diverged_cached_tokens"] = diverged[0]["ttft_ms"], diverged[0]["cached_tokens"]
    return out


def measure(url: str, turns: list[list[dict]], proc: subprocess.Popen | None = None) -> dict:
    """The transcript's rows and summary, or the error that ended it (a peer that exits mid-run)."""
    try:
        rows = trio.run(transcript, url, turns)
    except (httpx.HTTPError, RuntimeError) as e:
        code = proc.poll() if proc is not None else None
        return {"error": f"{type(e).__name__}: {str(e)[:200]}" + (f" (server exit code {code})" if code is not None
                                                                   else "")}
    return {"turns": rows, **summary(rows)}


def start_hf2q(model: Path, slots: int, ctx: int, speculative: str, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hf2q", "serve", "--model", str(model), "--port", str(port), "--slots", str(slots),
           "--ctx", str(ctx), "--operator-ui", "plain", "--speculative", speculative]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(url, proc, "/readyz", 900)
    return proc, url


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a qwen35 / qwen35moe GGUF (default: a synthetic one of --shape)")
    p.add_argument("--shape", default="qwen35-tiny", help="bench/synth_gguf.py shape (qwen35-tiny, qwen35-0.8b, "
                   "qwen35-9b)")
    p.add_argument("--mix", default="q8_0", help="bench/synth_gguf.py weight mix")
    p.add_argument("--work-dir", default="/tmp/hf2q-ttft-cached", help="where the synthetic GGUF is written")
    p.add_argument("--context-bytes", type=int, default=20_000)
    p.add_argument("--turns", type=int, default=4, help="turns of the transcript (the first is cold)")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--ctx", type=int, default=8192, help="per-slot context for both servers")
    p.add_argument("--speculative", choices=["off", "mtp", "ngram"], default="off", help="hf2q serve --speculative "
                   "(mtp: the synthetic file gets its nextn block)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server threads")
    p.add_argument("--gpu-layers", type=int, default=0, help="llama-server -ngl (99 on a GPU machine)")
    p.add_argument("--skip-peer", action="store_true", help="only measure hf2q")
    p.add_argument("--skip-ours", action="store_true", help="only measure llama-server")
    p.add_argument("--server-log", default=os.devnull)
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args(argv)
    if args.model:
        model = Path(args.model)
    else:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        model = synth_model(args.shape, args.mix, work, args.speculative == "mtp")
    turns = agent_turns(args.context_bytes, args.turns)
    report = {"model": model.name, "shape": None if args.model else args.shape, "context_bytes": args.context_bytes,
              "turns": args.turns, "slots": args.slots, "ctx": args.ctx, "speculative": args.speculative,
              "cpu_count": os.cpu_count(), "time": time.strftime("%FT%TZ", time.gmtime())}
    with open(args.server_log, "ab") as log:
        if args.skip_ours:
            report["hf2q"] = {"skipped": "--skip-ours"}
        else:
            proc, url = start_hf2q(model, args.slots, args.ctx, args.speculative, log)
            try:
                report["hf2q"] = measure(url, turns)
            finally:
                stop(proc)
        if args.skip_peer:
            report["llama_cpp"] = {"skipped": "--skip-peer"}
        else:
            try:
                proc, url = start_llama_server(model, args.slots, args.ctx, args.threads, log, args.gpu_layers)
            except (OSError, RuntimeError) as e:
                report["llama_cpp"] = {"skipped": f"llama-server did not start on this file: {str(e)[:200]}"}
            else:
                try:
                    report["llama_cpp"] = measure(url, turns, proc)
                finally:
                    stop(proc)
    return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
