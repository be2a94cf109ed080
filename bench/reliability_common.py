"""What every part of ``bench/reliability.py`` shares: the tally of what went wrong, real ``hf2q``
processes (a serve process on an ephemeral port, a one-shot CLI run) and an SSE stream reader.

Each part adds to one ``Tally``; a count that is not zero is a reliability bug, and the first few
details of each are kept so the report says what broke, not only how often.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TRACEBACK = "Traceback (most recent call last)"
#: the counts a run must keep at zero (the report's totals)
COUNTS = ("server_5xx", "wrong_status", "bad_error_bodies", "hangs", "tracebacks", "wrong_exit_codes",
          "lost_streams", "duplicated_streams", "incomplete_streams", "unhealthy_after", "partial_outputs",
          "orphan_processes", "corrupt_blocks", "corrupt_blocks_used", "lost_blocks", "metrics_mismatch",
          "slow_to_idle", "aborted_parts")
DETAILS_KEPT = 8


@attrs.define
class Tally:
    """Cases tried and what went wrong, for one part of the suite."""

    cases: int = 0
    counts: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(COUNTS, 0))
    details: dict[str, list[str]] = attrs.field(factory=dict)
    info: dict = attrs.field(factory=dict)  # measurements that are not failures (timings, sizes)

    def fail(self, what: str, detail: str) -> None:
        self.counts[what] += 1
        kept = self.details.setdefault(what, [])
        if len(kept) < DETAILS_KEPT:
            kept.append(detail[:300])

    def check_log(self, text: str, where: str, expected: str | None = None) -> None:
        """Count the tracebacks in a process's output (but those naming ``expected``: an injected fault)."""
        blocks = [b for b in text.split(TRACEBACK)[1:] if not (expected and expected in b[:4000])]
        if blocks:
            self.counts["tracebacks"] += len(blocks) - 1
            self.fail("tracebacks", f"{where}: {TRACEBACK}{blocks[0][:280]!r}")

    def as_dict(self) -> dict:
        out = {"cases": self.cases, **self.counts}
        if self.details:
            out["details"] = self.details
        if self.info:
            out["info"] = self.info
        return out


def child_env() -> dict[str, str]:
    """The environment of every hf2q child: this checkout's package first, the shared hf2q cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HF2Q_CACHE", str(Path.home() / ".cache" / "hf2q"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@attrs.frozen
class CliRun:
    code: int | None  # None: still running at the deadline (then killed)
    stdout: str
    stderr: str
    seconds: float


def run_cli(args: list[str], timeout: float, cwd: Path | None = None) -> CliRun:
    """``python -m hf2q ARGS`` to completion, or killed at ``timeout`` (code None)."""
    t = time.perf_counter()
    p = subprocess.Popen([PYTHON, "-m", "hf2q", *args], cwd=cwd or ROOT, env=child_env(), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        code: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        code = None
    return CliRun(code, out, err, time.perf_counter() - t)


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set so far (``VmHWM``), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class ServeProcess:
    """One ``hf2q serve`` (or a launcher with the same interface) on an ephemeral port.

    The log goes to a file (read for the URL, readiness and tracebacks); ``peak_rss`` is read from
    ``/proc`` whenever the process is sampled and before it is stopped or killed."""

    def __init__(self, args: list[str], log_path: Path, *, api_key: str | None = None,
                 command: tuple[str, ...] = (PYTHON, "-m", "hf2q", "serve")):
        self.argv = [*command, "--port", "0", "--operator-ui", "plain", *args]
        self.log_path = log_path
        self.api_key = api_key
        self.url = ""
        self.peak_rss = 0
        self.proc: subprocess.Popen | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout: float = 180.0) -> "ServeProcess":
        """Start and wait until ``/readyz`` answers 200; raises ``RuntimeError`` if it never does."""
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=child_env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode} at start: {self.log()[-600:]}")
            if not self.url:
                m = re.search(r"hf2q serve: (http://\S+) model", self.log())
                if m:
                    self.url = m.group(1)
            if self.url:
                try:
                    if httpx.get(self.url + "/readyz", timeout=5).status_code == 200:
                        self.sample()
                        return self
                except httpx.TransportError:
                    pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server not ready within {timeout:.0f} s: {self.log()[-600:]}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def sample(self) -> None:
        if self.proc is not None:
            self.peak_rss = max(self.peak_rss, peak_rss_bytes(self.proc.pid))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (only the server: its children, if any, are left for the caller to find)."""
        if self.alive():
            self.sample()
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._close()

    def terminate(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait for the exit code; None if it did not exit in ``timeout`` (then killed)."""
        if not self.alive():
            self._close()
            return self.proc.returncode if self.proc else None
        self.sample()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self._close()
        return code

    def _close(self) -> None:
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()


def sse_events(lines) -> list:
    """The ``data:`` payloads of an SSE response, parsed (``"[DONE]"`` kept as the string)."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def check_stream(events: list, tally: Tally, name: str) -> str | None:
    """One complete chat stream: a role chunk, one finish_reason, one ``[DONE]`` last, one id.
    Returns the content; counts and returns None for a lost, duplicated or incomplete stream."""
    if not events:
        tally.fail("lost_streams", f"{name}: no event")
        return None
    dones = sum(1 for e in events if e == "[DONE]")
    chunks = [e for e in events if isinstance(e, dict) and "choices" in e]
    finishes = [c for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    ids = {c.get("id") for c in chunks}
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if dones > 1 or len(finishes) > 1 or len(ids) > 1:
        tally.fail("duplicated_streams", f"{name}: {dones} [DONE], {len(finishes)} finish, ids {sorted(map(str, ids))}")
        return None
    if errors or dones != 1 or events[-1] != "[DONE]" or len(finishes) != 1:
        tally.fail("incomplete_streams", f"{name}: {dones} [DONE], {len(finishes)} finish, errors {errors[:1]}")
        return None
    return "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
