"""Engine speed and correctness on a GPU (the lent H200), JSON out.

1. Synthesises random-weight GGUFs of a big real shape (default Qwen3-8B) in the given
   mixes with ``bench/synth_gguf.py`` and times hf2q's ``MlxModelRunner`` (pp512, pp2048 in
   2048-token transactions, tg128) with ``bench/decode.py``'s ``bench_hf2q``.
2. (The peers on the same files and GPU in the same run: ``bench/gpu_peer.py``.)
3. Correctness: for each small GGUF given with ``--check``, the logits of a 40-token prompt's last
   token and of 8 decode steps after it (the CPU's greedy tokens, forced on both), GPU vs the CPU
   backend in float32 (subprocess with ``HF2Q_DEVICE=cpu``), beside the same CPU run in the GPU's
   compute dtype: the GPU's deviation should be of the size its precision alone gives.
4. ``--check-mmproj``: the Qwen3-VL vision encoder on one fixed image, GPU (float32 and float16)
   vs the CPU in float32, beside the CPU in float16.

    python bench/gpu_engine.py --vocab-gguf V.gguf --mixes q4_k_m,q8_0 --check tiny.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DECODE_STEPS = 8


def logits_probe(path: str, forced: list[int] | None = None, dtype: str | None = None) -> dict:
    """Logits of a 40-token prompt's last token and of DECODE_STEPS decode steps after it.

    ``forced``: the tokens to decode (another run's greedy choices), so two backends are compared
    on the same sequence instead of diverging after the first near-tie; ``dtype`` runs the engine
    in that compute dtype (the CPU run in the GPU's precision is the yardstick for its rounding)."""
    import mlx.core as mx
    import numpy as np

    import hf2q.engine.runner as runner_mod

    if os.environ.get("HF2Q_DEVICE") == "cpu":
        mx.set_default_device(mx.cpu)
    if dtype:
        os.environ["HF2Q_NO_HOST_DECODE"] = "1"  # the host decoder is float32 only
        runner_mod.compute_dtype = lambda arch: getattr(mx, dtype)
    r = runner_mod.MlxModelRunner.load(path)
    s = r.new_sequence()
    toks = [int(t) for t in np.random.default_rng(1).integers(1, min(r.vocab_size, 1000), 40)]
    rows = [r.prefill(s, toks)]
    chosen = []
    for i in range(DECODE_STEPS):  # a prompt longer than a tiny sliding window, then decode steps
        chosen.append(forced[i] if forced else int(np.argmax(rows[-1])))
        rows.append(r.decode([s], [chosen[-1]])[0])
    return {"logits": np.stack(rows).astype("float64").tolist(), "tokens": chosen}


def _probe_subprocess(path: str, forced: list[int] | None, dtype: str | None) -> dict:
    cmd = [sys.executable, __file__, "--probe", path]
    if forced:
        cmd += ["--forced", json.dumps(forced)]
    if dtype:
        cmd += ["--probe-dtype", dtype]
    env = {**os.environ, "HF2Q_DEVICE": "cpu"}
    return json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)


def compare_backends(path: str) -> dict:
    """GPU vs CPU float32 on the CPU's greedy sequence, beside CPU-in-the-GPU's-dtype vs CPU float32."""
    import numpy as np

    from hf2q.engine.runner import compute_dtype
    from hf2q.formats.gguf_file import open_gguf

    gpu_dtype = str(compute_dtype(open_gguf(path).arch)).split(".")[-1]
    ref = _probe_subprocess(path, None, None)
    cpu = np.array(ref["logits"])
    gpu = np.array(logits_probe(path, ref["tokens"])["logits"])
    yard = np.array(_probe_subprocess(path, ref["tokens"], gpu_dtype)["logits"])
    return {"dtype": gpu_dtype, "scale": float(np.abs(cpu).max()),
            "gpu_max_abs": float(np.abs(gpu - cpu).max()),
            "cpu_same_dtype_max_abs": float(np.abs(yard - cpu).max()),
            "gpu_argmax_agree": int((gpu.argmax(1) == cpu.argmax(1)).sum()),
            "cpu_same_dtype_argmax_agree": int((yard.argmax(1) == cpu.argmax(1)).sum()),
            "steps": int(cpu.shape[0])}


def vision_probe(mmproj: str, dtype: str | None = None) -> dict:
    """The Qwen3-VL encoder's merged and deepstack features for one fixed 64×48 random image."""
    import mlx.core as mx
    import numpy as np

    from hf2q.engine.vision.qwen3vl import Qwen3VLVisionEncoder
    from hf2q.formats.gguf_file import open_gguf

    if os.environ.get("HF2Q_DEVICE") == "cpu":
        mx.set_default_device(mx.cpu)
    enc = Qwen3VLVisionEncoder(open_gguf(mmproj), getattr(mx, dtype) if dtype else mx.float32)
    image = np.random.default_rng(2).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    feats = enc(*enc.prepare(image))
    rows = [feats.merged, *feats.deepstack]
    return {"features": [np.array(r.astype(mx.float32)).astype("float64").tolist() for r in rows]}


def compare_vision(mmproj: str, gpu_dtype: str) -> dict:
    """The encoder on the GPU (float32 and the serving dtype) vs the CPU in float32."""
    import numpy as np

    cmd = [sys.executable, __file__, "--probe-vision", mmproj]
    ref = json.loads(subprocess.run(cmd, env={**os.environ, "HF2Q_DEVICE": "cpu"}, capture_output=True, text=True,
                                    check=True).stdout)["features"]
    out = {"scale": max(float(np.abs(np.array(r)).max()) for r in ref)}
    for dt in (None, gpu_dtype):
        got = vision_probe(mmproj, dt)["features"]
        out[f"gpu_{dt or 'float32'}_max_abs"] = max(float(np.abs(np.array(a) - np.array(b)).max())
                                                   for a, b in zip(got, ref))
    yard = json.loads(subprocess.run(cmd + ["--probe-dtype", gpu_dtype], env={**os.environ, "HF2Q_DEVICE": "cpu"},
                                     capture_output=True, text=True, check=True).stdout)["features"]
    out[f"cpu_{gpu_dtype}_max_abs"] = max(float(np.abs(np.array(a) - np.array(b)).max()) for a, b in zip(yard, ref))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--mixes", default="q4_k_m,q8_0")
    ap.add_argument("--vocab-gguf", default=None)
    ap.add_argument("--work", default="/tmp/hf2q-gpu")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--check", action="append", default=[])
    ap.add_argument("--check-mmproj", action="append", default=[], help="a Qwen3-VL mmproj: its encoder GPU vs CPU")
    ap.add_argument("--probe-vision", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--forced", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-dtype", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe_vision:
        print(json.dumps(vision_probe(a.probe_vision, a.probe_dtype)))
        return 0
    if a.probe:
        print(json.dumps(logits_probe(a.probe, json.loads(a.forced) if a.forced else None, a.probe_dtype)))
        return 0
    import mlx.core as mx
    import numpy as np

    result = {"device": str(mx.default_device()), "mlx": mx.__version__, "shape": a.shape, "runs": {}, "checks": {}}
    for path in a.check:
        result["checks"][Path(path).name] = compare_backends(path)
        print(json.dumps({"check": Path(path).name, **result["checks"][Path(path).name]}), flush=True)
    for path in a.check_mmproj:
        result["checks"][Path(path).name] = compare_vision(path, "float16")
        print(json.dumps({"check": Path(path).name, **result["checks"][Path(path).name]}), flush=True)
    from bench.decode import bench_hf2q

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    for mix in [m for m in a.mixes.split(",") if m]:
        out = work / f"{a.shape}-{mix}.gguf"
        if not out.exists():
            cmd = [sys.executable, str(ROOT / "bench/synth_gguf.py"), "--shape", a.shape, "--mix", mix, "-o", str(out)]
            if a.vocab_gguf:
                cmd += ["--vocab-gguf", a.vocab_gguf]
            subprocess.run(cmd, check=True)
        t0 = time.time()
        ours = bench_hf2q(out, [512, 2048], 128, a.reps, 2048)
        row = {"hf2q": {k: round(v, 1) for k, v in ours.items()}, "bytes": out.stat().st_size,
               "seconds": round(time.time() - t0, 1)}
        result["runs"][mix] = row
        print(json.dumps({"mix": mix, **row}), flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
