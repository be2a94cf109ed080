"""Who may join a group across hosts (``HF2Q_TP_TOKEN``) and how a follower's process ends.

Two "hosts" on 127.0.0.1 (ring backend): rank 0 is a small driver over ``tp_launch.runner_factory``
(the serving runtime's own start-up, without HTTP) and rank 1 the real ``hf2q tp-follower`` command.
A follower's exit status says how its group ended: 0 when rank 0 stopped it (a server that exits
cleanly), 1 when the group broke (rank 0 vanished), 130 when it was itself stopped by a signal.
On one machine a closed runner and a dropped one both stop their child ranks (exit 0) and reap them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf2q.engine.tp_hosts import SECRET_ENV
from tests.test_tp_multihost import PY, ROOT, follower, models, stop, two_hosts  # noqa: F401 — fixtures

SECRET = "exit-test-secret"

RANK0 = r"""
import os, sys
sys.path.insert(0, {root!r})
from hf2q.engine import tp_launch
from hf2q.engine.tp_hosts import read_hostfile
path, hostfile, port, then = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
hosts = None if hostfile == "-" else read_hostfile(hostfile, port)
runner = tp_launch.runner_factory(path, 2, 64, hosts, 120)()
seq = runner.new_sequence()
runner.prefill(seq, [1, 2, 3])
print("ready", runner.followers.pids, flush=True)
if then == "vanish":  # rank 0 dies without a word
    os._exit(0)
if then == "wait":  # until the test ends the follower
    sys.stdin.readline()
    os._exit(0)
if then in ("close", "drop"):  # one machine: rank 0 ends the group, reports how its child ranks ended
    followers = runner.followers
    if then == "close":
        runner.close()
        runner.close()  # idempotent
    else:  # no close(): the last reference goes
        import gc
        del seq, runner
        gc.collect()
    print("codes", [p.returncode for p in followers.procs], flush=True)
    print("alive", [pid for pid in followers.pids if os.path.exists(f"/proc/{{pid}}")], flush=True)
# "exit": a normal interpreter exit (as after a drained SIGTERM): the group is stopped at exit
"""


def env(token: str | None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    return e if token is None else {**e, SECRET_ENV: token}


def rank0(model: Path, hostfile, port: int, then: str, tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "rank0.py"
    script.write_text(RANK0.format(root=str(ROOT)))
    return subprocess.Popen([sys.executable, str(script), str(model), str(hostfile), str(port), then], cwd=ROOT,
                            env=env(SECRET), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def rank1(model: Path, hostfile: Path, port: int, log: Path, token: str | None = SECRET,
          timeout: str = "60") -> subprocess.Popen:
    return subprocess.Popen([*PY, "tp-follower", str(model), "--rank", "1", "--hostfile", str(hostfile),
                             "--tp-port", str(port), "--tp-timeout", timeout], cwd=ROOT, env=env(token),
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)


def test_across_hosts_the_token_is_required(models, tmp_path):
    """Without ``HF2Q_TP_TOKEN`` neither command starts: exit 2, one line, before anything loads."""
    model = models("llama", "f32")
    hostfile, port = two_hosts(tmp_path)
    runs = [subprocess.run(cmd, cwd=ROOT, env=env(token), capture_output=True, text=True, timeout=120)
            for cmd, token in (([*PY, "serve", "--model", str(model), "--hostfile", str(hostfile)], None),
                               ([*PY, "tp-follower", str(model), "--rank", "1", "--hosts", "127.0.0.1,127.0.0.1"],
                                ""))]
    for r in runs:
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [
            f"hf2q: error: {SECRET_ENV} is not set: a tensor-parallel group across hosts needs the same secret on "
            f"every host (e.g. export {SECRET_ENV}=$(openssl rand -hex 16) on each)"], r.stderr


def test_a_follower_with_another_token_is_refused_and_logged(models, tmp_path):
    """Rank 0 drops the connection and logs it; the follower exits 1 in one line; rank 0, still
    without its rank 1, gives up at ``--tp-timeout`` (exit 1)."""
    model = models("llama", "f32")
    hostfile, port = two_hosts(tmp_path)
    serve = subprocess.Popen([*PY, "serve", "--model", str(model), "--hostfile", str(hostfile), "--tp-port", str(port),
                              "--tp-timeout", "20", "--port", "0", "--operator-ui", "plain"], cwd=ROOT,
                             env=env(SECRET), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    intruder = subprocess.run([*PY, "tp-follower", str(model), "--rank", "1", "--hostfile", str(hostfile),
                               "--tp-port", str(port), "--tp-timeout", "30"], cwd=ROOT, env=env("not-the-secret"),
                              capture_output=True, text=True, timeout=120)
    out, err = serve.communicate(timeout=120)
    assert intruder.returncode == 1 and intruder.stderr.strip().splitlines() == [
        f"hf2q: error: tensor-parallel rank 1: rank 0 at 127.0.0.1:{port + 2} did not accept this follower "
        f"(another {SECRET_ENV}, or another group)"], intruder.stderr
    assert f"tensor-parallel: refused a connection from 127.0.0.1 (no or another {SECRET_ENV})" in out + err
    assert serve.returncode == 1 and "rank 1 (127.0.0.1) never joined" in err.strip().splitlines()[-1], err


def wait_line(proc: subprocess.Popen, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    assert line.startswith("ready") and time.monotonic() < deadline, (line, proc.stderr.read()[-2000:])
    return line


@pytest.mark.slow
def test_follower_exit_status_says_how_the_group_ended(models, tmp_path):
    """0 after rank 0's clean exit (it stops the group), 1 when rank 0 vanished, 130 on SIGTERM;
    each with one line in the follower's log (but the clean stop)."""
    model = models("llama", "f32")
    statuses, logs = {}, {}
    for then in ("exit", "vanish", "sigterm"):
        where = tmp_path / then
        where.mkdir()
        hostfile, port = two_hosts(where)
        logs[then] = where / "rank1.log"
        follower_proc = rank1(model, hostfile, port, logs[then])
        lead = rank0(model, hostfile, port, "wait" if then == "sigterm" else then, where)
        try:
            wait_line(lead)
            if then == "sigterm":
                follower_proc.send_signal(signal.SIGTERM)
            statuses[then] = follower_proc.wait(60)
            if then == "exit":
                assert lead.wait(60) == 0
        finally:
            stop(follower_proc, signal.SIGKILL, 5)
            stop(lead, signal.SIGKILL, 5)
    assert statuses == {"exit": 0, "vanish": 1, "sigterm": 130}, {k: logs[k].read_text()[-800:] for k in logs}
    assert "hf2q tp rank 1: rank 0 closed the control connection; the group is broken, exiting" \
        in logs["vanish"].read_text() or "without stopping the group" in logs["vanish"].read_text()
    assert "hf2q tp rank 1: stopped by SIGTERM" in logs["sigterm"].read_text()
    assert "broken" not in logs["exit"].read_text()


@pytest.mark.parametrize("then", ["close", "drop"])
def test_a_closed_or_dropped_runner_stops_its_child_ranks(models, tmp_path, then):
    """One machine (rank 0 spawns rank 1): ``close()`` (twice) and a runner dropped without it end the
    group the same way — the child rank is told to stop, exits 0 and is reaped before rank 0 goes on."""
    local = rank0(models("llama", "f32"), "-", 0, then, tmp_path)
    try:
        wait_line(local)
        lines = [local.stdout.readline().strip() for _ in range(2)]
        assert lines == ["codes [0]", "alive []"] and local.wait(60) == 0, (lines, local.stderr.read()[-2000:])
    finally:
        stop(local, signal.SIGKILL, 5)
