"""Part b of the reliability suite: crafted files through the real CLI.

The cases come from ``tests/tools/crafted_gguf.py`` (GGUFs, each with the exit code ``info`` and
``serve`` must give) and ``tests/tools/crafted_hf.py`` (HF checkpoints, with the exit code of
``convert``). Each run counts a wrong exit code (a signal, a 1 where the input is bad, a start
that should have been refused), a traceback in the output, a server that neither starts nor
exits, and a failed ``convert`` that leaves anything at its output path.
"""

from __future__ import annotations

import importlib
import shutil
import time
from pathlib import Path

from reliability_common import ServeProcess, Tally, run_cli

CLI_TIMEOUT_S = 120.0
SERVE_START_S = 120.0


def _cases(module: str, out_dir: Path, limit: int, tally: Tally) -> list:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        tally.info.setdefault("missing_case_modules", []).append(f"{module}: {e}")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = list(mod.build_cases(out_dir))
    if limit:  # a subset spread over the broken kinds (they fail fast; the valid controls are slow)
        broken = [c for c in cases if getattr(c, "convert_exit", getattr(c, "info_exit", 0)) != 0]
        step = max(1, len(broken) // limit)
        cases = broken[step // 2::step][:limit]
    return cases


def _check_run(tally: Tally, what: str, code: int | None, expected: int, output: str) -> None:
    tally.cases += 1
    if code is None:
        tally.fail("hangs", f"{what}: still running after {CLI_TIMEOUT_S:.0f} s")
    elif code != expected:
        last = output.strip().splitlines()[-1:] or [""]
        tally.fail("wrong_exit_codes", f"{what}: exit {code}, expected {expected}: {last[0][:160]}")
    tally.check_log(output, what)


def serve_exit(path: Path, log: Path) -> tuple[int | None, str]:
    """``hf2q serve --model PATH``'s start-up outcome: its exit code, or 0 once it is ready and
    then drains cleanly on SIGTERM (a server that starts but does not stop cleanly is its code)."""
    server = ServeProcess(["--model", str(path), "--slots", "1", "--ctx", "256"], log)
    try:
        server.start(SERVE_START_S)
    except RuntimeError:
        if server.alive():
            server.kill()
            return None, server.log()
        return server.proc.returncode, server.log()
    code = server.terminate(60)
    return code, server.log()


def run_gguf(work: Path, limit: int, tally: Tally) -> None:
    for case in _cases("tests.tools.crafted_gguf", work / "crafted-gguf", limit, tally):
        r = run_cli(["info", str(case.path)], CLI_TIMEOUT_S)
        _check_run(tally, f"info {case.name}", r.code, case.info_exit, r.stdout + r.stderr)
        code, log = serve_exit(case.path, work / f"serve-{case.name}.log")
        _check_run(tally, f"serve {case.name}", code, case.serve_exit, log)


def run_hf(work: Path, limit: int, tally: Tally) -> None:
    outs = work / "crafted-hf-out"
    for case in _cases("tests.tools.crafted_hf", work / "crafted-hf", limit, tally):
        out = outs / case.name / "model.gguf"
        shutil.rmtree(out.parent, ignore_errors=True)
        out.parent.mkdir(parents=True)
        args = [a.replace("{out}", str(out)) for a in case.convert_args]
        r = run_cli(["convert", str(case.path), *args], CLI_TIMEOUT_S)
        _check_run(tally, f"convert {case.name}", r.code, case.convert_exit, r.stdout + r.stderr)
        left = sorted(p.name for p in out.parent.iterdir())
        if case.convert_exit != 0 and left:
            tally.fail("partial_outputs", f"convert {case.name} failed but left {left}")


def run(work: Path, tally: Tally, *, limit: int) -> None:
    t0 = time.perf_counter()
    run_gguf(work, limit, tally)
    tally.info["gguf_seconds"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    run_hf(work, limit, tally)
    tally.info["hf_seconds"] = round(time.perf_counter() - t0, 1)
