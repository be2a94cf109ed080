"""The JSON report written beside every conversion (``OUTPUT.report.json`` or ``--json-report``).

It records what went in (sha256 of each input file), what came out (per-tensor type, bytes,
shape, and the error of the stored values against the source: RMSE and cosine over a fixed
sample of rows), and where the time went — enough to audit or reproduce a conversion.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hf2q import __version__
from hf2q.atomic import atomic_write_text

SCHEMA = "hf2q.convert.report/1"


def default_path(output: Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".report.json")


def build(plan, output: Path, hashes: dict[str, str], tensors: list[dict], timings: dict, threads: int) -> dict:
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t["type"]] = counts.get(t["type"], 0) + 1
    n_elem = sum(t.n_elements for t in plan.tensors)
    total = sum(t["bytes"] for t in tensors)
    return {
        "schema": SCHEMA,
        "hf2q_version": __version__,
        "created_unix": int(time.time()),
        "source": str(plan.src),
        "output": str(output),
        "format": "gguf",
        "quant": plan.quant.name,
        "file_type": int(plan.quant.ftype),
        "architecture": plan.family.arch_name,
        "layers": plan.family.layer_summary(),
        "threads": threads,
        "inputs_sha256": hashes,
        "integrity_checked": bool(hashes),
        "tensor_count": len(tensors),
        "type_counts": counts,
        "total_tensor_bytes": total,
        "output_bytes": Path(output).stat().st_size if Path(output).exists() else None,
        "bits_per_weight": 8 * total / max(1, n_elem),
        "timings_s": {k: round(v, 4) for k, v in timings.items()},
        "tensors": tensors,
    }


def write(rep: dict, path: Path) -> None:
    atomic_write_text(path, json.dumps(rep, indent=1) + "\n")
