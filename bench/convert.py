"""Benchmark: ``hf2q convert`` vs llama.cpp's pipeline (convert_hf_to_gguf.py --outtype f16 + llama-quantize).

Same machine, same thread count, same HF input (the HF copies of SmolLM2-135M and
Gemma3-270m from ``tests.models.real``). For each model × quant we record wall seconds and
peak RSS of each side (per process, from ``wait4``; llama.cpp's figure is the max of its two
steps, its wall time their sum — the F16 export is measured once per model and charged to
every quant, as each real run of that pipeline would pay it) and the ratios hf2q / llama.cpp. Prints one JSON document.

    python bench/convert.py [--threads 2] [--quants q8_0,q4_k_m,q6_k] [--models smollm2,gemma3]
                            [--no-integrity] [-o results.json]

Targets (issue 2): wall ratio ≤ 0.66, hf2q peak RSS ≤ 2 × largest tensor + 300 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process; raises on failure."""
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a chatty child must never block on it
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        err = log.read().decode(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} … failed ({p.returncode}): {err[-1500:]}")
    return wall, usage.ru_maxrss * 1024


def largest_tensor_bytes(src: Path) -> int:
    from hf2q.sources.safetensors_reader import SafetensorsCheckpoint

    with SafetensorsCheckpoint(src) as ck:
        return max(e.nbytes for e in ck)


def llamacpp_f16(src: Path, threads: int, work: Path) -> tuple[Path, float, int]:
    """llama.cpp's first step (HF → F16 GGUF), measured once per model and charged to every quant."""
    from tests.tools import llama_cpp

    f16 = work / "llamacpp-f16.gguf"
    env = dict(llama_cpp.env(), OMP_NUM_THREADS=str(threads), PYTHONPATH=str(llama_cpp.gguf_py_dir()))
    wall, rss = run_measured([sys.executable, str(llama_cpp.convert_script()), str(src), "--outtype", "f16",
                              "--outfile", str(f16)], env)
    return f16, wall, rss


def bench_one(src: Path, quant: str, threads: int, work: Path, integrity: bool,
              f16_step: tuple[Path, float, int]) -> dict:
    from tests.tools import llama_cpp

    env = llama_cpp.env()
    env["OMP_NUM_THREADS"] = str(threads)
    ours = work / f"hf2q-{quant}.gguf"
    cmd = [sys.executable, "-m", "hf2q", "convert", str(src), "-q", quant, "-o", str(ours), "--threads", str(threads)]
    if not integrity:
        cmd.append("--no-integrity")
    h_wall, h_rss = run_measured(cmd, env)

    f16, c_wall, c_rss = f16_step
    theirs = work / f"llamacpp-{quant}.gguf"
    q_wall, q_rss = run_measured([str(llama_cpp.tool("llama-quantize")), str(f16), str(theirs), quant,
                                  str(threads)], env)
    l_wall, l_rss = c_wall + q_wall, max(c_rss, q_rss)
    sizes = (ours.stat().st_size, theirs.stat().st_size)
    for p in (ours, theirs, ours.with_name(ours.name + ".report.json")):
        p.unlink(missing_ok=True)
    return {
        "quant": quant,
        "hf2q": {"wall_s": round(h_wall, 2), "peak_rss_mb": round(h_rss / 2**20, 1)},
        "llama_cpp": {"wall_s": round(l_wall, 2), "peak_rss_mb": round(l_rss / 2**20, 1),
                      "convert_f16_s": round(c_wall, 2), "quantize_s": round(q_wall, 2)},
        "wall_ratio": round(h_wall / l_wall, 3),
        "rss_ratio": round(h_rss / l_rss, 3),
        "output_mb": {"hf2q": round(sizes[0] / 2**20, 2), "llama_cpp": round(sizes[1] / 2**20, 2)},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quants", default="q8_0,q4_k_m,q6_k")
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--no-integrity", action="store_true", help="skip hf2q's sha256 of the inputs")
    ap.add_argument("-o", "--output", help="also write the JSON here")
    args = ap.parse_args(argv)

    from tests.models import real
    from tests.tools import llama_cpp

    if not llama_cpp.available():
        print("llama.cpp is not built (python -m tests.tools.llama_cpp)", file=sys.stderr)
        return 1
    sources = {"smollm2": real.smollm2_hf_dir, "gemma3": real.gemma3_hf_dir}
    results = []
    with tempfile.TemporaryDirectory(prefix="hf2q-bench-") as tmp:
        for model in args.models.split(","):
            src = Path(sources[model]())
            largest = largest_tensor_bytes(src)
            f16_step = llamacpp_f16(src, args.threads, Path(tmp))
            for quant in args.quants.split(","):
                r = bench_one(src, quant, args.threads, Path(tmp), not args.no_integrity, f16_step)
                r["model"] = model
                r["largest_tensor_mb"] = round(largest / 2**20, 1)
                r["rss_target_mb"] = round((2 * largest + 300 * 2**20) / 2**20, 1)
                r["rss_target_met"] = r["hf2q"]["peak_rss_mb"] <= r["rss_target_mb"]
                r["wall_target_met"] = r["wall_ratio"] <= 0.66
                results.append(r)
                print(json.dumps(r), file=sys.stderr)
            f16_step[0].unlink(missing_ok=True)
    doc = {"benchmark": "convert", "threads": args.threads, "machine": platform.machine(),
           "cpus": os.cpu_count(), "integrity": not args.no_integrity, "results": results}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
