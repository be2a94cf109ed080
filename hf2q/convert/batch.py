"""``hf2q convert --batch PLAN``: many sources × quants × formats from one TOML or JSON plan.

A plan (paths are relative to the plan file)::

    output_dir = "converted"                     # default: beside the plan
    sources = ["models/SmolLM2", {repo = "Qwen/Qwen3-0.6B", revision = "main"}]
    quants = ["q4_k_m", "q8_0", "mlx-4"]
    formats = ["gguf", "mlx"]                    # optional: inferred from each quant name
    group_size = 64                              # mlx only (optional)

Every source is crossed with every quant that fits one of the formats (``mlx-*`` names
→ mlx, the rest → gguf; a mixed-bit tier plans its types per source inside its job). Outputs are ``<output_dir>/<source>-<quant>.gguf`` or
``<output_dir>/<source>-<quant>/``.

Resumable: after a successful job a receipt ``<output>.receipt.json`` records the input
hashes, quant, format, group size and hf2q version. A rerun skips a job whose output exists
with a matching receipt, so an interrupted batch continues where it stopped and a changed
input or hf2q version is redone. ``--jobs N`` runs conversions in N worker processes (spawned,
not forked: MLX and thread pools do not survive a fork); without ``--keep-going`` the first
failure stops the batch (jobs already running finish). One summary table is printed at
the end and the same summary is written as JSON (``--json-report`` or
``<output_dir>/batch-summary.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import time
import tomllib
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import attrs

from hf2q import __version__
from hf2q.atomic import atomic_write_text
from hf2q.errors import EXIT_FAILURE, Hf2qError, InputError, UsageError, did_you_mean

log = logging.getLogger("hf2q.batch")

RECEIPT_SCHEMA = "hf2q.batch.receipt/1"
SUMMARY_SCHEMA = "hf2q.batch.summary/1"
FORMATS = ("gguf", "mlx")


@attrs.frozen
class Job:
    source: str  # local folder (repos are resolved before jobs are made)
    label: str
    quant: str
    format: str
    output: str
    group_size: int | None
    threads: int | None
    integrity: bool = True


# ------------------------------------------------------------------------------ plan

def load_plan(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read the batch plan ({e.strerror})") from None
    try:
        if path.suffix.lower() == ".json":
            plan = json.loads(text)
        else:
            plan = tomllib.loads(text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: invalid plan ({str(e).splitlines()[0]})") from None
    if not isinstance(plan, dict):
        raise InputError(f"{path}: the plan must be a table/object")
    unknown = set(plan) - {"output_dir", "sources", "quants", "formats", "group_size", "threads"}
    if unknown:
        raise InputError(f"{path}: unknown plan key(s) {', '.join(sorted(unknown))}")
    for key in ("sources", "quants"):
        if not isinstance(plan.get(key), list) or not plan[key]:
            raise InputError(f"{path}: '{key}' must be a non-empty list")
    return plan


def _format_of(quant: str) -> str:
    return "mlx" if quant.lower().startswith("mlx") else "gguf"


def _check_quant(quant: str) -> str:
    from hf2q.convert.mlx_policy import MLX_QUANT_NAMES, parse_mlx_quant
    from hf2q.convert.quant_names import GGUF_QUANTS, TIER_QUANTS, parse_gguf_quant

    if not isinstance(quant, str):
        raise InputError(f"plan: quant {quant!r} is not a string")
    q = quant.lower()
    if q.startswith("mlx"):
        parse_mlx_quant(q)
    elif q in GGUF_QUANTS or q in TIER_QUANTS:  # a tier plans its types per source, inside each job
        parsed = parse_gguf_quant(q)
        if parsed.needs_imatrix:
            raise InputError(f"plan: {q} needs an importance matrix, which batch mode does not take")
    else:
        raise InputError(f"plan: unknown quant {quant!r}"
                         + did_you_mean(q, [*GGUF_QUANTS, *TIER_QUANTS, *MLX_QUANT_NAMES]))
    return q


def _sources(plan: dict, base: Path, cache_dir: str | None) -> list[tuple[str, Path]]:
    """(label, local folder) per source; Hub repos are fetched (or reused) here, once."""
    out = []
    for s in plan["sources"]:
        if isinstance(s, str):
            p = (base / s).expanduser() if not Path(s).expanduser().is_absolute() else Path(s).expanduser()
            if not (p / "config.json").is_file():
                raise InputError(f"plan: source {s!r} is not an HF model directory (no config.json)")
            out.append((p.name, p.resolve()))
        elif isinstance(s, dict) and isinstance(s.get("repo"), str):
            from hf2q.sources.hub import resolve_repo
            folder = resolve_repo(s["repo"], s.get("revision"), cache_dir)
            out.append((s["repo"].split("/")[-1], folder))
        else:
            raise InputError(f"plan: a source must be a path or {{repo = \"ORG/NAME\"}}, got {s!r}")
    labels = [label for label, _ in out]
    dup = {lab for lab in labels if labels.count(lab) > 1}
    if dup:
        raise InputError(f"plan: two sources would write the same outputs ({', '.join(sorted(dup))})")
    return out


def make_jobs(plan: dict, plan_path: Path, args: argparse.Namespace) -> list[Job]:
    base = plan_path.parent
    quants = [_check_quant(q) for q in plan["quants"]]
    formats = plan.get("formats")
    if formats is not None and (not isinstance(formats, list) or not formats
                                or any(f not in FORMATS for f in formats)):
        raise InputError(f"plan: formats must be a list drawn from {', '.join(FORMATS)}")
    group_size = plan.get("group_size", getattr(args, "group_size", None))
    if group_size is not None and group_size not in (32, 64, 128):
        raise InputError(f"plan: group_size must be 32, 64 or 128 (got {group_size!r})")
    out_dir = Path(plan.get("output_dir", "."))
    out_dir = out_dir if out_dir.is_absolute() else base / out_dir
    if getattr(args, "output", None):
        out_dir = Path(args.output)
    threads = getattr(args, "threads", None) or plan.get("threads")
    jobs = []
    for label, folder in _sources(plan, base, getattr(args, "cache_dir", None)):
        for q in quants:
            fmt = _format_of(q)
            if formats is not None and fmt not in formats:
                continue
            name = f"{label}-{q}" + (".gguf" if fmt == "gguf" else "")
            jobs.append(Job(str(folder), label, q, fmt, str(out_dir / name), group_size if fmt == "mlx" else None,
                            threads, not getattr(args, "no_integrity", False)))
    if not jobs:
        raise InputError("plan: no source × quant × format combination to convert")
    return jobs


# ------------------------------------------------------------------------------ receipts

def receipt_path(output: Path) -> Path:
    return output.with_name(output.name + ".receipt.json")


def _output_bytes(output: Path) -> int | None:
    if output.is_file():
        return output.stat().st_size
    if output.is_dir():
        return sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    return None


def _input_hashes(source: Path) -> dict[str, str]:
    from hf2q.sources.integrity import hash_inputs
    from hf2q.sources.safetensors_reader import checkpoint_files

    return hash_inputs(source, checkpoint_files(source))


def _receipt_key(job: Job, hashes: dict[str, str]) -> dict[str, Any]:
    return {"inputs_sha256": hashes, "quant": job.quant, "format": job.format, "group_size": job.group_size,
            "hf2q_version": __version__}


def is_done(job: Job, hashes: dict[str, str]) -> bool:
    """The output exists, is the size it had, and was made from these inputs with these settings."""
    out = Path(job.output)
    try:
        rec = json.loads(receipt_path(out).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(rec, dict) or rec.get("schema") != RECEIPT_SCHEMA:
        return False
    if {k: rec.get(k) for k in _receipt_key(job, hashes)} != _receipt_key(job, hashes):
        return False
    return rec.get("output_bytes") is not None and _output_bytes(out) == rec.get("output_bytes")


def write_receipt(job: Job, hashes: dict[str, str]) -> None:
    out = Path(job.output)
    rec = {"schema": RECEIPT_SCHEMA, "source": job.source, **_receipt_key(job, hashes),
           "output": str(out), "output_bytes": _output_bytes(out), "finished_unix": int(time.time())}
    atomic_write_text(receipt_path(out), json.dumps(rec, indent=1, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------ running

def _die_with_parent() -> None:
    """In each worker: end when the batch process dies, even by ``kill -9`` (Linux), instead of
    converting on as an orphan nobody collects."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass  # not Linux: a worker notices the closed pipe when it asks for its next job


def run_job(job: Job, hashes: dict[str, str] | None = None) -> dict[str, Any]:
    """Convert one job (in a worker process or inline); never raises.

    ``hashes`` are the input hashes the parent computed when it decided to run the job; they
    go into the receipt (hashing again here would double the I/O of large checkpoints).
    """
    t0 = time.perf_counter()
    result: dict[str, Any] = {"source": job.label, "quant": job.quant, "format": job.format,
                              "output": job.output}
    try:
        src, out = Path(job.source), Path(job.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        hashes = hashes if hashes is not None else _input_hashes(src)
        if job.format == "mlx":
            from hf2q.convert import mlx_policy
            from hf2q.convert.mlx_writer import write_mlx
            rep = write_mlx(src, out, mlx_policy.parse_mlx_quant(job.quant),
                            mlx_policy.check_group_size(job.group_size), integrity=job.integrity)
        else:
            from hf2q.convert.pipeline import convert_gguf
            from hf2q.convert.quant_names import parse_gguf_quant
            rep = convert_gguf(src, out, parse_gguf_quant(job.quant), threads=job.threads,
                               integrity=job.integrity)
        write_receipt(job, hashes)
        result.update(status="converted", bytes=rep.get("output_bytes"), bits_per_weight=rep.get("bits_per_weight"))
    except Hf2qError as e:
        result.update(status="failed", error=str(e), exit_code=e.exit_code)
    except Exception as e:  # noqa: BLE001 — a bug in one job must not lose the others' results
        result.update(status="failed", error=f"internal error: {type(e).__name__}: {e}", exit_code=EXIT_FAILURE)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def _skipped(job: Job) -> dict[str, Any]:
    return {"source": job.label, "quant": job.quant, "format": job.format, "output": job.output,
            "status": "skipped", "bytes": _output_bytes(Path(job.output)), "seconds": 0.0}


def _execute(pending: list[Job], hashes: dict[str, dict[str, str]], jobs_n: int,
             keep_going: bool) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    if jobs_n <= 1:
        for i, job in enumerate(pending):
            r = run_job(job, hashes[job.source])
            results.append(r)
            log.info("%s %s → %s", r["status"], job.label, job.quant)
            if r["status"] == "failed" and not keep_going:
                results += [{**_skipped(j), "status": "not run", "bytes": None} for j in pending[i + 1:]]
                break
        return results
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs_n, mp_context=ctx, initializer=_die_with_parent) as pool:
        futures = {pool.submit(run_job, job, hashes[job.source]): job for job in pending}
        stop = False
        remaining = set(futures)
        while remaining:
            done, remaining = wait(remaining, return_when=FIRST_COMPLETED)
            for f in done:
                job = futures[f]
                if f.cancelled():
                    results.append({**_skipped(job), "status": "not run", "bytes": None})
                    continue
                try:
                    r = f.result()
                except Exception as e:  # noqa: BLE001 — a worker died (killed, out of memory)
                    r = {"source": job.label, "quant": job.quant, "format": job.format, "output": job.output,
                         "status": "failed", "error": f"worker died: {type(e).__name__}", "exit_code": EXIT_FAILURE,
                         "seconds": None}
                results.append(r)
                if r["status"] == "failed" and not keep_going and not stop:
                    stop = True
                    for other in remaining:
                        other.cancel()
    order = {j.output: i for i, j in enumerate(pending)}
    return sorted(results, key=lambda r: order[r["output"]])


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hf2q batch", show_lines=False)
    for col in ("source", "quant", "format", "status", "MiB", "bpw", "seconds", "output / error"):
        table.add_column(col, overflow="fold")
    for r in rows:
        mib = f"{r['bytes'] / 2**20:.1f}" if r.get("bytes") else ""
        bpw = f"{r['bits_per_weight']:.2f}" if r.get("bits_per_weight") else ""
        secs = f"{r['seconds']:.1f}" if r.get("seconds") else ""
        table.add_row(r["source"], r["quant"], r["format"], r["status"], mib, bpw, secs,
                      r.get("error") or r["output"])
    Console(soft_wrap=False, width=max(120, os.get_terminal_size().columns if os.isatty(1) else 160)).print(table)


def run_batch(args: argparse.Namespace) -> int:
    if getattr(args, "src", None) or getattr(args, "repo", None):
        raise UsageError("--batch takes its sources from the plan; do not also give SRC or --repo")
    if getattr(args, "dry_run", False):
        raise UsageError("--dry-run is not supported with --batch")
    plan_path = Path(args.batch)
    plan = load_plan(plan_path)
    jobs = make_jobs(plan, plan_path, args)
    t0 = time.perf_counter()
    hashes: dict[str, dict[str, str]] = {}
    unreadable: dict[str, Hf2qError] = {}
    for src in dict.fromkeys(j.source for j in jobs):
        try:
            hashes[src] = _input_hashes(Path(src))
        except Hf2qError as e:  # e.g. no safetensors: that source's jobs fail, the rest may go on
            if not args.keep_going:
                raise
            unreadable[src] = e
    todo = [j for j in jobs if j.source in hashes and not is_done(j, hashes[j.source])]
    skipped = {j.output: _skipped(j) for j in jobs if j.source in hashes and j not in todo}
    for j in jobs:
        if j.source in unreadable:
            e = unreadable[j.source]
            skipped[j.output] = {**_skipped(j), "status": "failed", "bytes": None, "error": str(e),
                                 "exit_code": e.exit_code}
    ran = {r["output"]: r for r in _execute(todo, hashes, int(getattr(args, "jobs", 1) or 1), args.keep_going)}
    rows = [skipped.get(j.output) or ran[j.output] for j in jobs]
    summary = {"schema": SUMMARY_SCHEMA, "hf2q_version": __version__, "plan": str(plan_path),
               "jobs": len(jobs), "converted": sum(r["status"] == "converted" for r in rows),
               "skipped": sum(r["status"] == "skipped" for r in rows),
               "failed": sum(r["status"] == "failed" for r in rows),
               "not_run": sum(r["status"] == "not run" for r in rows),
               "seconds": round(time.perf_counter() - t0, 3), "results": rows}
    out_dir = Path(jobs[0].output).parent
    summary_path = Path(args.json_report) if getattr(args, "json_report", None) else out_dir / "batch-summary.json"
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(summary_path, json.dumps(summary, indent=1) + "\n")
    _print_table(rows)
    print(f"{summary['converted']} converted, {summary['skipped']} skipped, {summary['failed']} failed"
          + (f", {summary['not_run']} not run" if summary["not_run"] else "") + f"; summary: {summary_path}")
    failed = [r for r in rows if r["status"] == "failed"]
    return failed[0]["exit_code"] if failed else 0
