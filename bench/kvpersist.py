"""Benchmark the persistent prefix KV store; prints one JSON object (``-o FILE`` also writes it).

Part 1 (always): store throughput for blocks shaped like the model's KV (default: SmolLM2-135M,
read from its GGUF — 30 layers × K/V × [3 kv heads, 256 tokens, 64] at f16 ≈ 5.9 MB a block):
blocks/s and MB/s written through the writer actor (temp → fsync → rename → dir fsync),
read + verified, and start-up recovery time with full and header-only verification.

``--q8-error``: the effect of storing KV as 8-bit rows (``payload_kind="kv-q8"``) on a real
model's next-token logits and greedy continuation, with transformers as the engine.

Part 2 (``--ttft``; needs ``hf2q serve --kv-persist`` integrated): time to first token of one
~20 KB-context chat request against a real server — cold, again from the live slot, and after
a server restart from disk — with ``cached_tokens`` and whether the T=0 outputs are identical.
The target is restored TTFT ≤ 25 % of cold.

    python bench/kvpersist.py                       # store throughput, SmolLM2 shapes
    python bench/kvpersist.py --ttft --context-bytes 20000 -o kv.json
    python bench/kvpersist.py --skip-store --q8-error   # output error of 8-bit payloads (transformers)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402


def kv_shapes_from_gguf(path: str) -> dict:
    from hf2q.formats.gguf_file import open_gguf

    hp = open_gguf(path).hparams
    _, n_kv = hp.uniform_heads()
    return {"n_layer": hp.n_layers, "n_kv_heads": n_kv, "head_dim": hp.key_length}


def make_block_arrays(shapes: dict, rng, dtype=np.float16) -> dict[str, np.ndarray]:
    from hf2q.kvstore import BLOCK_TOKENS

    shape = (shapes["n_kv_heads"], BLOCK_TOKENS, shapes["head_dim"])
    return {f"layers.{i}.{kv}": rng.standard_normal(shape, dtype=np.float32).astype(dtype)
            for i in range(shapes["n_layer"]) for kv in "kv"}


def bench_store(shapes: dict, n_blocks: int, workdir: Path) -> dict:
    from hf2q.actors.kv_writer import open_kv_writer
    from hf2q.kvstore import BLOCK_TOKENS, BlockStore, KVBlock

    fp = "b" * 64
    rng = np.random.default_rng(0)
    arrays = make_block_arrays(shapes, rng)
    block_mb = sum(a.nbytes for a in arrays.values()) / 1e6
    tokens = rng.integers(0, 49152, n_blocks * BLOCK_TOKENS).tolist()
    root = workdir / "store"
    store = BlockStore.open(root, fp)
    blocks = [KVBlock.from_span(s, tokens, arrays) for s in store.spans(tokens)]

    async def write_all():
        async with open_kv_writer(store, capacity=n_blocks) as writer:
            t0 = time.perf_counter()
            for b in blocks:
                assert writer.submit_nowait(b)
            await writer.wait_idle()
            return time.perf_counter() - t0

    wall = trio.run(write_all)
    metas = store.longest_prefix(tokens)
    t0 = time.perf_counter()
    for m in metas:
        store.read(m)
    read_wall = time.perf_counter() - t0
    store.close()
    file_mb = sum(p.stat().st_size for p in (root / "blocks").iterdir()) / 1e6
    t0 = time.perf_counter()
    BlockStore.open(root, fp).close()
    full = time.perf_counter() - t0
    t0 = time.perf_counter()
    BlockStore.open(root, fp, verify_bodies=False).close()
    header_only = time.perf_counter() - t0
    shutil.rmtree(root)
    return {
        "kv_shapes": shapes, "blocks": n_blocks, "block_payload_mb": round(block_mb, 3),
        "file_overhead_bytes": round((file_mb - block_mb * n_blocks) * 1e6 / n_blocks),
        "write_blocks_per_s": round(n_blocks / wall, 2), "write_mb_per_s": round(block_mb * n_blocks / wall, 1),
        "write_tokens_per_s": round(n_blocks * BLOCK_TOKENS / wall),
        "read_verify_blocks_per_s": round(n_blocks / read_wall, 2),
        "read_verify_mb_per_s": round(block_mb * n_blocks / read_wall, 1),
        "recovery_full_verify_s": round(full, 4), "recovery_header_only_s": round(header_only, 4),
    }


# ---- error of 8-bit KV payloads on a real model (transformers as the independent engine) ----------


def bench_q8_error(model_path: str, n_prompt: int, n_cont: int) -> dict:
    """Quantize a real prompt's KV the way ``kv-q8`` stores it and measure what the model does next.

    transformers (loading the same GGUF) computes the prompt's KV; variants of that cache —
    rounded to float16 (the engine's dtype) and float16 → q8 rows → float16 — then drive the
    next ``n_cont`` teacher-forced tokens and a greedy continuation, compared with float32 KV.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf2q.fetch import LLAMA_CPP_SDIST, fetch
    from hf2q.kvstore.q8 import dequantize_rows, quantize_rows

    d, name = os.path.dirname(model_path), os.path.basename(model_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    text = (Path(fetch(LLAMA_CPP_SDIST)) / "README.md").read_text("utf-8")  # real prose + code
    ids = torch.tensor([tok(text).input_ids[: n_prompt + n_cont]])
    assert ids.shape[1] == n_prompt + n_cont

    def f16(t):
        return t.to(torch.float16).to(torch.float32)

    def q8(t):
        h = t.to(torch.float16).numpy()
        q, sc = quantize_rows(h)
        return torch.from_numpy(dequantize_rows(q, sc, np.float16).astype(np.float32))

    with torch.no_grad():
        base = model(ids[:, :n_prompt], use_cache=True).past_key_values

        def run(transform):
            cache = copy.deepcopy(base)
            errs = []
            for layer in cache.layers:
                for attr in ("keys", "values"):
                    orig = getattr(layer, attr)
                    new = transform(orig) if transform else orig
                    errs.append(float(torch.linalg.norm(new - orig) / torch.linalg.norm(orig)))
                    setattr(layer, attr, new)
            forced = model(ids[:, n_prompt:], past_key_values=cache).logits[0].double()
            cache = copy.deepcopy(base)
            for layer in cache.layers:
                for attr in ("keys", "values"):
                    setattr(layer, attr, transform(getattr(layer, attr)) if transform else getattr(layer, attr))
            greedy, nxt = [], ids[:, n_prompt:n_prompt + 1]
            for _ in range(n_cont):
                logits = model(nxt, past_key_values=cache).logits[0, -1]
                nxt = logits.argmax().view(1, 1)
                greedy.append(int(nxt))
            return forced, greedy, max(errs) if errs else 0.0

        ref, ref_greedy, _ = run(None)
        out = {"prompt_tokens": n_prompt, "continuation_tokens": n_cont}
        for label, fn in (("f16", f16), ("q8", q8)):
            logits, greedy, kv_rel = run(fn)
            p = torch.log_softmax(ref, -1)
            qlog = torch.log_softmax(logits, -1)
            kl = (p.exp() * (p - qlog)).sum(-1)
            same = next((i for i, (a, b) in enumerate(zip(greedy, ref_greedy)) if a != b), len(greedy))
            out[label] = {"kv_rel_rmse_max": round(kv_rel, 5),
                          "max_abs_logit_diff": round(float((logits - ref).abs().max()), 4),
                          "mean_kl": float(f"{float(kl.mean()):.3g}"), "max_kl": float(f"{float(kl.max()):.3g}"),
                          "top1_agreement": round(float((logits.argmax(-1) == ref.argmax(-1)).double().mean()), 4),
                          "greedy_tokens_identical": same}
    return out


# ---- TTFT against a real server ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, kv_dir: Path, extra: list[str]):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "hf2q", "serve", "--model", model, "--port", str(self.port),
               "--kv-persist", str(kv_dir), "--slots", "1", *extra]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError("server exited: " + self.log.read().decode(errors="replace")[-800:])
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server not ready in time")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _chat(url: str, context: str, max_tokens: int) -> dict:
    import httpx

    body = {"model": "default", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": context},
                         {"role": "user", "content": "Summarise the text above in one sentence."}]}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    j = r.json()
    timing = j.get("x_hf2q_timing", {})
    return {"ttft_ms": timing.get("time_to_first_token_ms"), "wall_s": round(wall, 3),
            "prompt_tokens": j["usage"]["prompt_tokens"],
            "cached_tokens": (j["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "text": j["choices"][0]["message"].get("content")}


def bench_ttft(model: str, context_bytes: int, max_tokens: int, workdir: Path, ready_timeout: float,
               extra: list[str]) -> dict:
    words = ("the persistent cache keeps blocks of keys and values on disk so a restarted server "
             "answers a long prompt without recomputing it ").split()
    rng = np.random.default_rng(1)
    context = ""
    while len(context.encode()) < context_bytes:
        context += " ".join(rng.choice(words, 16)) + ". "
    kv_dir = workdir / "kv"
    out: dict = {"context_bytes": len(context.encode())}
    srv = Server(model, kv_dir, extra)
    try:
        srv.wait_ready(ready_timeout)
        out["cold"] = _chat(srv.url, context, max_tokens)
        out["live_slot"] = _chat(srv.url, context, max_tokens)
    finally:
        srv.stop()
    srv = Server(model, kv_dir, extra)
    try:
        srv.wait_ready(ready_timeout)
        out["restored_from_disk"] = _chat(srv.url, context, max_tokens)
    finally:
        srv.stop()
    texts = {out[k].pop("text") for k in ("cold", "live_slot", "restored_from_disk")}
    out["identical_outputs"] = len(texts) == 1
    cold, disk = out["cold"]["ttft_ms"], out["restored_from_disk"]["ttft_ms"]
    if cold and disk:
        out["restored_over_cold"] = round(disk / cold, 3)
        out["meets_25pct_target"] = disk <= 0.25 * cold
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF whose KV shapes to use (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--dir", help="where to write (default: a temp dir; use the disk you will serve from)")
    ap.add_argument("--ttft", action="store_true", help="also measure TTFT against a real server")
    ap.add_argument("--q8-error", action="store_true",
                    help="measure the output error of 8-bit KV payloads with transformers on the model")
    ap.add_argument("--q8-prompt", type=int, default=512)
    ap.add_argument("--q8-continuation", type=int, default=64)
    ap.add_argument("--skip-store", action="store_true", help="skip the store throughput part")
    ap.add_argument("--context-bytes", type=int, default=20_000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra flag for hf2q serve (repeatable)")
    ap.add_argument("-o", "--output")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from hf2q.fetch import SMOLLM2, fetch

        model = str(fetch(SMOLLM2))
    work = Path(tempfile.mkdtemp(prefix="kvbench-", dir=args.dir))
    try:
        result: dict = {"model": os.path.basename(model)}
        if not args.skip_store:
            result["store"] = bench_store(kv_shapes_from_gguf(model), args.blocks, work)
        if args.q8_error:
            result["q8_error"] = bench_q8_error(model, args.q8_prompt, args.q8_continuation)
        if args.ttft:
            try:
                result["ttft"] = bench_ttft(model, args.context_bytes, args.max_tokens, work, args.ready_timeout,
                                            args.serve_arg)
            except Exception as e:  # noqa: BLE001 — report, keep the store figures
                result["ttft"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return emit(result, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
