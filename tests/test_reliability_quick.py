"""The reliability suite's quick mode (bench/reliability.py --quick) against real hf2q processes.

Every part runs small: the whole hostile-request corpus and a short fuzz, a few crafted files, one
kill -9 of each kind, a short burst of concurrent streams, an injected fault and hang. Every count
must be 0 but one: a corpus case planted with a wrong expected status must be counted, so a suite
that counted nothing would fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "reliability.py"

pytestmark = pytest.mark.slow


def run_suite(tmp_path: Path, *args: str, timeout: float) -> dict:
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, str(SCRIPT), *args, "--work-dir", str(tmp_path / "work"), "-o", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(out.read_text())


def test_quick_suite_counts_nothing_wrong_but_the_planted_case(tmp_path):
    # one corpus case is planted with a wrong expected status: exactly it must be counted
    report = run_suite(tmp_path, "--quick", "--plant-wrong-expectation", timeout=300)
    assert set(report["parts"]) == {"http", "files", "kill", "kv", "load", "faults"}
    details = {name: part.get("details") for name, part in report["parts"].items() if part.get("details")}
    failing = {k: v for k, v in report["totals"].items() if v}
    assert failing == {"wrong_status": 1}, (failing, details)
    assert details == {"http": {"wrong_status": [details["http"]["wrong_status"][0]]}}, details
    assert "planted" in details["http"]["wrong_status"][0]
    assert report["parts"]["http"]["cases"] >= 150  # the corpus itself, before the fuzz
    assert report["cases"] >= 300 and report["peak_rss_bytes"] > 0
