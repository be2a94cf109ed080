"""What loading a model costs the host, with projections fused at load and without: seconds and peak memory.

    python bench/load_host.py                                  # a synthesised Qwen3-8B-wide file, 6 layers, Q8_0
    python bench/load_host.py --gguf /tmp/q8.gguf --rounds 3

Fusing q|k|v and gate|up (``hf2q.engine.layers.load_products``) must not make a load slower or its peak larger
than loading every projection apart, or a big model that fits unfused would not fit fused. Each load runs in a
fresh process (``HF2Q_NO_FUSED_PROJ=1`` for the unfused one), fused and unfused in turn for ``--rounds`` rounds so
the shared machine's swings fall on both: the process's peak resident set (``resource.getrusage``'s
``ru_maxrss``, which counts the GGUF's mmapped pages the load touched as well as the weights MLX holds), the
resident set before the load (imports), wall and CPU seconds of ``MlxModelRunner.load``, and the model's weight
bytes. The default file is ``bench/synth_gguf.py --shape qwen3-8b --layers 6 --mix q8_0`` (the 8B model's widths:
the fused products are as large as a real one's). Prints one JSON report (``--out`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit, synth_file  # noqa: E402

#: run in the child: one load, its figures as one JSON line
CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[2])
from hf2q.engine.factory import prepare_mlx
prepare_mlx()
import mlx.core as mx
from bench.common import process_cpu_s
from hf2q.engine.runner import MlxModelRunner
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = rss_mb()
c0, t0 = process_cpu_s(), time.perf_counter()
runner = MlxModelRunner.load(sys.argv[1], ctx=256)
t1, c1 = time.perf_counter(), process_cpu_s()
layer = runner.model.layers[0]
print(json.dumps({"load_s": round(t1 - t0, 3), "load_cpu_s": round(c1 - c0, 3), "peak_rss_mb": round(rss_mb()),
                  "rss_before_mb": round(before), "weights_mb": round(runner.model.weights_nbytes() / 2 ** 20),
                  "qkv_products": len(layer.attn.qkv), "gate_up_products": len(layer.ffn.gate_up)}))
"""


def load_once(path: Path, fused: bool) -> dict:
    env = dict(os.environ)
    env.pop("HF2Q_NO_FUSED_PROJ", None)
    if not fused:
        env["HF2Q_NO_FUSED_PROJ"] = "1"
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(ROOT)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    keys = ("load_s", "load_cpu_s", "peak_rss_mb")
    s = {f"{k}_median": round(statistics.median(r[k] for r in runs), 3) for k in keys}
    s.update({f"{k}_min": min(r[k] for r in runs) for k in keys})
    s.update({k: runs[0][k] for k in ("weights_mb", "qkv_products", "gate_up_products", "rss_before_mb")})
    s["runs"] = runs
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="load this file (default: a synthesised one)")
    p.add_argument("--shape", default="qwen3-8b", help="bench/synth_gguf.py shape of the synthesised file")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--mix", default="q8_0")
    p.add_argument("--work", default=None, help="where the synthesised file is kept (default: a temp dir)")
    p.add_argument("--vocab-gguf", default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hf2q-load-host-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        path = Path(args.gguf) if args.gguf else synth_file(work, args.shape, args.layers, args.mix, args.vocab_gguf)
        runs: dict[str, list[dict]] = {"fused": [], "unfused": []}
        for i in range(args.rounds):
            for name in (("fused", "unfused") if i % 2 == 0 else ("unfused", "fused")):
                runs[name].append(load_once(path, name == "fused"))
                print(f"round {i} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
        report = {"file": path.name, "file_mb": round(path.stat().st_size / 2 ** 20), "rounds": args.rounds,
                  **{k: summary(v) for k, v in runs.items()}}
        return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
