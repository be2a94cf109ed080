"""Reliability suite: real ``hf2q`` processes under hostile input, kills and load; prints one JSON object.

Parts (``--parts``, default all):

- ``http``: the hostile-request corpus and a hypothesis fuzz against ``hf2q serve`` (bench/reliability_http.py);
- ``files``: crafted GGUFs and HF checkpoints through ``info``, ``serve`` and ``convert`` (bench/reliability_files.py);
- ``kill``: ``kill -9`` of ``convert`` / ``convert --batch`` at random moments (bench/reliability_kill.py);
- ``kv``: ``kill -9`` of a ``--kv-persist`` server under load, restarted each time, and a clean SIGTERM
  that must leave every complete block on disk (bench/reliability_kill.py);
- ``load``: concurrent streams over 4 slots with random disconnects (bench/reliability_load.py);
- ``faults``: an engine fault and a hang injected mid-stream (bench/reliability_faults.py).

The models: the built-in default (SmolLM2-135M Q4_1) for serving, its HF checkpoint and the tiny
llama checkpoint for ``convert``, MiniLM (converted once into the work directory) for embeddings.
Every count in ``totals`` must be 0; ``peak_rss_bytes`` is the largest server's peak.

    python bench/reliability.py                        # the full default run
    python bench/reliability.py --lanes 3              # the same, parts side by side
    python bench/reliability.py --quick                # everything, small (tests/test_reliability_quick.py)
    python bench/reliability.py --parts http,load --load-seconds 60 -o rel.json
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import emit  # noqa: E402
from reliability_common import COUNTS, ServeProcess, Tally, run_cli  # noqa: E402

PARTS = ("http", "files", "kill", "kv", "load", "faults")
QUICK = dict(fuzz_examples=12, file_cases=2, convert_kills=1, batch_kills=1, kv_kills=1, load_streams=8,
             load_seconds=4.0, disconnect_every=3, lanes=3)
FULL = dict(fuzz_examples=300, file_cases=0, convert_kills=50, batch_kills=50, kv_kills=50, load_streams=64,
            load_seconds=300.0, disconnect_every=5, lanes=1)
#: with ``--lanes 3`` (quick) these run side by side; mostly each waits on its own servers
LANES = (("kill", "faults"), ("http", "files", "load"), ("kv",))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="every part, small (the test runs this)")
    p.add_argument("--fuzz-examples", type=int, help="hypothesis examples against the live server")
    p.add_argument("--file-cases", type=int, help="crafted files of each kind to try (0: all)")
    p.add_argument("--convert-kills", type=int, help="kill -9s of a single convert")
    p.add_argument("--batch-kills", type=int, help="kill -9s of convert --batch")
    p.add_argument("--kv-kills", type=int, help="kill -9s of a --kv-persist server under load")
    p.add_argument("--load-streams", type=int, help="concurrent streams (over 4 slots)")
    p.add_argument("--load-seconds", type=float, help="how long the concurrent load runs")
    p.add_argument("--disconnect-every", type=int, help="one stream in N disconnects mid-stream")
    p.add_argument("--lanes", type=int, choices=[1, 3], help="3: run parts side by side (the quick default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="GGUF to serve (default: the built-in default model)")
    p.add_argument("--work-dir", help="keep logs and outputs here (default: a temporary directory)")
    p.add_argument("--plant-wrong-expectation", action="store_true",
                   help="add one corpus case whose expected status is wrong (shows the suite can fail)")
    p.add_argument("-o", "--output", help="also write the JSON report here")
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")
    return args


def embedding_model(work: Path) -> Path | None:
    """MiniLM as a GGUF, converted once from the test models' HF copy; None where it is not there."""
    out = work / "minilm-f16.gguf"
    if out.exists():
        return out
    try:
        from tests.models import real

        src = real.minilm_hf_dir()
    except Exception:  # noqa: BLE001 — no network and no cached copy: serve without embeddings
        return None
    r = run_cli(["convert", str(src), "-q", "f16", "-o", str(out)], timeout=300)
    return out if r.code == 0 else None


@contextlib.contextmanager
def serving(args: list[str], log: Path, tally: Tally, what: str, api_key: str | None = None):
    """A server for one part: started, yielded, then stopped with SIGTERM, which must exit 0,
    and its log checked for tracebacks."""
    server = ServeProcess(args, log, api_key=api_key).start()
    try:
        yield server
    finally:
        code = server.terminate()
        tally.cases += 1
        if code != 0:
            tally.fail("wrong_exit_codes", f"{what} server exited {code} after SIGTERM")
        tally.check_log(server.log(), f"{what} server log")
        tally.info["peak_rss_bytes"] = server.peak_rss


def part_http(args, work: Path, model: Path, tally: Tally) -> None:
    import reliability_http as http

    emb = embedding_model(work)
    with serving(["--model", str(model), *http.serve_args(emb)], work / "http-serve.log", tally, "http",
                 api_key=http.KEY) as server:
        http.run(server, tally, fuzz_examples=args.fuzz_examples, seed=args.seed, has_embeddings=emb is not None,
                 planted=args.plant_wrong_expectation)


def part_files(args, work: Path, model: Path, tally: Tally) -> None:
    import reliability_files as files

    files.run(work, tally, limit=args.file_cases)


def part_kill(args, work: Path, model: Path, tally: Tally) -> None:
    import reliability_kill as kill
    from tests.models import real, tiny

    src = tiny.checkpoint("llama") if args.quick else real.smollm2_hf_dir()
    kill.run_convert(work, tally, src=src, convert_kills=args.convert_kills, batch_kills=args.batch_kills,
                     seed=args.seed)


def part_kv(args, work: Path, model: Path, tally: Tally) -> None:
    import reliability_kill as kill

    kill.run_kv(work, model, tally, kills=args.kv_kills, prompts=2 if args.quick else 6,
                words=300 if args.quick else 700, sigterm_words=0 if args.quick else 2400,
                restart_after_sigterm=True, seed=args.seed)
    tally.info["peak_rss_bytes"] = tally.info.get("kv_peak_rss_bytes", 0)


def part_load(args, work: Path, model: Path, tally: Tally) -> None:
    import reliability_load as load

    with serving(["--model", str(model), *load.serve_args(args.load_streams)], work / "load-serve.log", tally,
                 "load") as server:
        load.run(server, tally, streams=args.load_streams, seconds=args.load_seconds,
                 disconnect_every=args.disconnect_every, seed=args.seed)


def part_faults(args, work: Path, model: Path, tally: Tally) -> None:
    import reliability_faults as faults

    faults.run(work, model, tally)


def run_parts(args, work: Path) -> dict:
    from common import chat_model

    model = chat_model(args.model)
    runners = {"http": part_http, "files": part_files, "kill": part_kill, "kv": part_kv, "load": part_load,
               "faults": part_faults}
    results: dict[str, dict] = {}

    def lane(names) -> None:
        for name in names:
            tally = Tally()
            t0 = time.perf_counter()
            try:
                runners[name](args, work, model, tally)
            except Exception as e:  # noqa: BLE001 — a part that cannot run is itself a failure, reported
                tally.fail("aborted_parts", f"part {name} aborted: {type(e).__name__}: {e}")
            tally.info["seconds"] = round(time.perf_counter() - t0, 1)
            results[name] = tally.as_dict()

    if args.lanes == 1:
        lane(args.parts)
    else:
        # every module a part imports lazily is imported here first: two lanes importing numpy (or a
        # module that does) at the same moment can see it partially initialised
        import numpy  # noqa: F401

        import reliability_faults, reliability_files, reliability_http, reliability_kill, reliability_load  # noqa: F401,E401
        from tests.models import real, tiny  # noqa: F401
        threads = [threading.Thread(target=lane, args=([n for n in names if n in args.parts],)) for names in LANES]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report: dict = {"parts": {name: results[name] for name in args.parts}}
    parts = report["parts"].values()
    report["cases"] = sum(p["cases"] for p in parts)
    report["totals"] = {k: sum(p[k] for p in parts) for k in COUNTS}
    report["peak_rss_bytes"] = max([p.get("info", {}).get("peak_rss_bytes", 0) for p in parts] or [0])
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        report = run_parts(args, work)
    else:
        work = Path(tempfile.mkdtemp(prefix="hf2q-reliability-"))
        try:
            report = run_parts(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report = {"quick": args.quick, "parts_run": args.parts, **report, "seconds": round(time.perf_counter() - t0, 1)}
    return emit(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
