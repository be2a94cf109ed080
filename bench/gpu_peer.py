"""hf2q and llama.cpp side by side on one GPU: the same GGUFs, the same run, JSON with ratios.

    python bench/gpu_peer.py --llama-src llama.cpp-src.tar.gz --vocab-gguf ggml-vocab-qwen2.gguf \\
        --chat-template Qwen3.jinja --mixes q4_k_m,q8_0 --parts engine,batch,serve --out peer.json

1. Builds llama.cpp with CUDA (``--llama-src``: a source tree or a .tar.gz of one) into ``--llama-build``
   unless its tools are already there, and points ``tests/tools/llama_cpp`` at it (``HF2Q_LLAMA_BIN``).
2. Synthesises random-weight GGUFs of a real shape in each mix (``bench/synth_gguf.py``), with the tokenizer of
   ``--vocab-gguf`` and the chat template of ``--chat-template`` (through ``hf2q gguf-patch``) so both servers
   can answer chat requests.
3. Parts, each on the same files:

   * ``engine``: pp512, pp2048 and tg128 at batch 1 — hf2q's runner (``bench/decode.py``) vs ``llama-bench
     -fa 1 -ngl 99``;
   * ``batch``: aggregate decode at 1/2/4/8 sequences — hf2q's pipelined steps (``bench/gpu_batch.py``) vs
     ``llama-batched-bench`` (64-token prompts, 128 generated per sequence);
   * ``serve``: ``hf2q serve --slots 4`` vs ``llama-server --parallel 4 -ngl 99`` with 1 and 4 streaming
     clients (``bench/serve.py``).

The JSON is rewritten after every part, so a run cut short still leaves what it measured.

``--moe-grouped both`` times the engine part's hf2q figures twice on a mixture-of-experts file: its experts one
product per (token, expert) pair, then in the default layout (grouped by expert for prefill on a GPU,
``hf2q.engine.expert_route``).

``--fused-proj both`` runs hf2q's parts twice per file, with the load-time fusion of q|k|v and gate|up off and on
(keys ``engine@fused-off``, ``engine@fused-on``, …, and each load's seconds), llama.cpp once: the same-run comparison
that decides fusion's default on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit  # noqa: E402

LLAMA_TOOLS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-completion")
BATCHES = (1, 2, 4, 8)
#: where each part's report keeps the peer's figures (measured once per file, reused by a second setting)
PEER_KEYS = {"engine": "llama.cpp", "batch": "llama-batched-bench", "serve": "llama-server"}


def build_llama(src: Path, build: Path, cuda_arch: str) -> dict:
    """Configure and build the llama.cpp tools once; a build that is already there is reused."""
    bin_dir = build / "bin"
    if all((bin_dir / t).exists() for t in LLAMA_TOOLS):
        return {"built": False, "bin": str(bin_dir)}
    if src.is_file():  # a tarball of the source tree
        tree = build.parent / "src"
        tree.mkdir(parents=True, exist_ok=True)
        with tarfile.open(src) as t:
            t.extractall(tree, filter="data")
        src = tree
    t0 = time.time()
    cfg = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DGGML_CUDA=ON",
           f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
           "-DLLAMA_USE_PREBUILT_UI=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    for cmd in (cfg, ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 4), "--target", *LLAMA_TOOLS]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"llama.cpp build failed ({cmd[1]}): {r.stdout[-1500:]}{r.stderr[-1500:]}")
    return {"built": True, "bin": str(bin_dir), "seconds": round(time.time() - t0, 1)}


def synth(shape: str, mix: str, work: Path, vocab: str | None, template: str | None,
          skeleton: str | None = None) -> Path:
    """The random-weight GGUF of ``shape`` in ``mix``, or filled from a ``bench/synth_plan.py`` skeleton
    (families ``synth_gguf.py`` has no shape for: its mix and tokenizer are the skeleton's)."""
    out = work / (f"{Path(skeleton).name}.gguf" if skeleton else f"{shape}-{mix}.gguf")
    if out.exists():
        return out
    if skeleton:
        subprocess.run([sys.executable, str(ROOT / "bench/synth_gguf.py"), "--skeleton", skeleton, "-o", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
        return out
    cmd = [sys.executable, str(ROOT / "bench/synth_gguf.py"), "--shape", shape, "--mix", mix, "-o", str(out)]
    if vocab:
        cmd += ["--vocab-gguf", vocab]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    if template:
        subprocess.run([sys.executable, "-m", "hf2q", "gguf-patch", str(out), "--chat-template", template],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def llama_batched(gguf: Path, steps: int) -> dict:
    from tests.tools import llama_cpp

    exe = llama_cpp.tool("llama-batched-bench")
    if exe is None:
        return {"error": f"llama-batched-bench is not in {llama_cpp.bin_dir()}"}
    cmd = [str(exe), "-m", str(gguf), "-c", "16384", "-b", "2048", "-ub", "512",
           "-npp", "64", "-ntg", str(steps), "-npl", ",".join(map(str, BATCHES)), "-ngl", "99", "-fa", "on",
           "--output-format", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=llama_cpp.env())
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-400:]}
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[f"B{row['pl']}"] = round(float(row["speed_tg"]), 1)
    return out


def ratios(ours: dict, peer: dict) -> dict:
    return {k: round(ours[k] / v, 3) for k, v in peer.items() if k in ours and isinstance(v, (int, float)) and v}


def part_engine(r, gguf: Path, reps: int, peer: dict | None = None, moe_both: bool = False) -> dict:
    """``peer``: llama.cpp's figures already measured on this file in this run (the second fusion setting);
    ``moe_both``: also time the MoE experts one product per (token, expert) pair (``HF2Q_MOE_GROUPED=0``) before
    the default layout, on the same loaded model."""
    from bench.decode import bench_llama_cpp, bench_runner

    extra = {}
    if moe_both:
        before = os.environ.get("HF2Q_MOE_GROUPED")
        os.environ["HF2Q_MOE_GROUPED"] = "0"
        try:
            extra["hf2q@moe-per-pair"] = {k: round(v, 1) for k, v in bench_runner(r, [512, 2048], 128, reps, 2048).items()}
        finally:
            if before is None:
                os.environ.pop("HF2Q_MOE_GROUPED")
            else:
                os.environ["HF2Q_MOE_GROUPED"] = before
    ours = {k: round(v, 1) for k, v in bench_runner(r, [512, 2048], 128, reps, 2048).items()}
    if peer is None:
        peer = bench_llama_cpp(gguf, [512, 2048], 128, reps, os.cpu_count() or 4, ["-ngl", "99", "-fa", "1"]) or {}
        peer = {k: round(v, 1) for k, v in peer.items()}
    return {"hf2q": ours, **extra, "llama.cpp": peer, "ratio": ratios(ours, peer)}


def part_batch(r, gguf: Path, steps: int, peer: dict | None = None) -> dict:
    from bench.gpu_batch import aggregate_decode

    rows = aggregate_decode(r, cases=tuple((b, True) for b in BATCHES), steps=steps)
    ours = {k: v["pipelined_tok_s"] for k, v in rows.items()}
    if peer is None:
        peer = llama_batched(gguf, steps)
    return {"hf2q": ours, "hf2q_build_ms": {k: v["build_ms"] for k, v in rows.items()}, "llama-batched-bench": peer,
            "ratio": ratios(ours, peer)}


def set_fused_proj(setting: str | None) -> None:
    """``on`` / ``off`` force the load-time fusion of adjacent projections; ``None`` leaves the environment as given."""
    if setting is None:
        return
    os.environ.pop("HF2Q_FUSED_PROJ", None)
    os.environ.pop("HF2Q_NO_FUSED_PROJ", None)
    os.environ["HF2Q_FUSED_PROJ" if setting == "on" else "HF2Q_NO_FUSED_PROJ"] = "1"


def part_serve(gguf: Path, max_tokens: int, peer: dict | None = None) -> dict:
    """``peer``: llama-server's figures already measured on this file in this run (the second fusion setting)."""
    from bench import serve

    args = argparse.Namespace(requests=2, max_tokens=max_tokens, skip_cached=True)
    out = {} if peer is None else {"llama-server": peer}
    servers = [("hf2q", lambda: serve.start_hf2q(gguf, 4, 4096, log))]
    if peer is None:
        servers.append(("llama-server", lambda: serve.start_llama_server(gguf, 4, 4096, os.cpu_count() or 4, log,
                                                                          gpu_layers=99)))
    with open(os.devnull, "ab") as log:
        for name, start in servers:
            proc, url = start()
            try:
                m = serve.measure(url, args, proc.pid)
                out[name] = {k: m[k]["aggregate_tokens_per_sec"] for k in ("one_client", "four_clients")}
            finally:
                serve.stop(proc)
    if "hf2q" in out and "llama-server" in out:
        out["ratio"] = ratios(out["hf2q"], out["llama-server"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-src", default=None, help="llama.cpp source tree or .tar.gz (built when tools are absent)")
    ap.add_argument("--llama-build", default=str(Path.home() / "lcpp" / "build"))
    ap.add_argument("--cuda-arch", default="90")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--mixes", default="q4_k_m,q8_0")
    ap.add_argument("--skeleton", default=None, help="a bench/synth_plan.py skeleton instead of --shape "
                    "(e.g. gemma4-31b); --mixes then names the skeleton's one mix, for the report")
    ap.add_argument("--vocab-gguf", default=None)
    ap.add_argument("--chat-template", default=None, help="a Jinja chat template file embedded for the serve part")
    ap.add_argument("--parts", default="engine,batch,serve")
    ap.add_argument("--work", default="/tmp/hf2q-gpu")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=128, help="generated tokens per sequence in the batch part")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request in the serve part")
    ap.add_argument("--fused-proj", choices=["default", "on", "off", "both"], default="default",
                    help="hf2q's fused q|k|v and gate|up products (HF2Q_FUSED_PROJ); both: each part once per setting "
                         "on the same file, llama.cpp measured once")
    ap.add_argument("--moe-grouped", choices=["default", "both"], default="default",
                    help="both: the engine part also times MoE experts one product per (token, expert) pair")
    ap.add_argument("--out", default="gpu-peer.json")
    a = ap.parse_args(argv)

    import mlx.core as mx

    report: dict = {"device": str(mx.default_device()), "mlx": mx.__version__, "shape": a.skeleton or a.shape,
                    "time": time.strftime("%FT%TZ", time.gmtime()), "runs": {}}
    build = Path(a.llama_build)
    if a.llama_src:
        report["llama.cpp"] = build_llama(Path(a.llama_src), build, a.cuda_arch)
    os.environ["HF2Q_LLAMA_BIN"] = str(build / "bin")

    def save() -> None:
        from hf2q.atomic import atomic_write_text

        atomic_write_text(a.out, json.dumps(report, indent=2))

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    parts = [p for p in a.parts.split(",") if p]
    settings = {"default": [None], "on": ["on"], "off": ["off"], "both": ["off", "on"]}[a.fused_proj]
    for mix in [m for m in a.mixes.split(",") if m]:
        gguf = synth(a.shape, mix, work, a.vocab_gguf, a.chat_template if "serve" in parts else None, a.skeleton)
        row = report["runs"].setdefault(mix, {"bytes": gguf.stat().st_size})
        peers: dict[str, dict] = {}  # llama.cpp's figures per part, measured once per file
        for setting in settings:
            set_fused_proj(setting)  # read at load, by this process's runner and by the served child
            suffix = "" if setting is None else f"@fused-{setting}"
            runner = None  # one load serves the engine and batch parts; dropped before the servers start
            for part in parts:
                t0 = time.time()
                if part in ("engine", "batch") and runner is None:
                    from hf2q.engine.runner import MlxModelRunner, warm_up

                    runner = MlxModelRunner.load(gguf, ctx=4096)
                    warm_up(runner)  # as serve does before ready (bench_runner warms its shapes again)
                    row["load" + suffix] = {"seconds": round(time.time() - t0, 1)}  # a first use compiles kernels
                    t0 = time.time()
                elif part == "serve":
                    runner = None
                fn = {"engine": lambda: part_engine(runner, gguf, a.reps, peers.get("engine"), a.moe_grouped == "both"),
                      "batch": lambda: part_batch(runner, gguf, a.steps, peers.get("batch")),
                      "serve": lambda: part_serve(gguf, a.max_tokens, peers.get("serve"))}[part]
                key = part + suffix
                try:
                    row[key] = fn()
                    peer_key = PEER_KEYS.get(part)
                    if peer_key and row[key].get(peer_key) and "error" not in row[key][peer_key]:
                        peers.setdefault(part, row[key][peer_key])
                except Exception as e:  # one failed part must not lose the others' figures
                    row[key] = {"error": f"{type(e).__name__}: {e}"[:400]}
                row[key]["seconds"] = round(time.time() - t0, 1)
                print(json.dumps({"mix": mix, key: row[key]}), flush=True)
                save()
    return emit(report, None)  # the file is already written; print it as every bench does


if __name__ == "__main__":
    raise SystemExit(main())
