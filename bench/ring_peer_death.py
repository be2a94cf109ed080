"""What MLX's ring backend does when a peer is SIGKILLed mid-collective — no hf2q code involved.

    python bench/ring_peer_death.py chained|independent|sync [--kill-at 20] [--wait 25]

Two processes on 127.0.0.1 (``mx.distributed.init(backend="ring")``, hostfile of two free ports).
Both run steps of three ``tanh(x @ w)`` + ``all_sum`` layers; rank 0 kills rank 1 after
``--kill-at`` steps and goes on. ``sync`` evaluates each step before building the next; ``independent``
queues step n+1 (``mx.async_eval``) before reading step n; ``chained`` does that with step n+1 fed
step n's output (what hf2q's pipelined decode does). Prints how rank 0 ended: an exception (the
behaviour hf2q's fail-closed path relies on), a signal (-11: segfault), or ``hung`` when it had not
ended within ``--wait`` seconds of the start (then it is SIGABRTed so faulthandler prints where it waits).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(mode: str, kill_at: int, wait: float) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = os.path.join(tmp, "ring.json")
        with open(hostfile, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(2)], f)
        env = {**os.environ, "MLX_HOSTFILE": hostfile}
        me = [sys.executable, os.path.abspath(__file__), mode, "--kill-at", str(kill_at)]
        peer = subprocess.Popen(me, env={**env, "MLX_RANK": "1"})
        lead = subprocess.Popen([*me, "--peer", str(peer.pid)], env={**env, "MLX_RANK": "0"})
        try:
            rc = str(lead.wait(wait))
        except subprocess.TimeoutExpired:
            lead.send_signal(signal.SIGABRT)
            rc = f"hung (then {lead.wait()})"
        peer.wait(10)
        return rc


def rank(mode: str, kill_at: int, peer: int | None) -> None:
    import mlx.core as mx

    faulthandler.enable()
    group = mx.distributed.init(strict=True, backend="ring")
    w = mx.random.normal((512, 512), key=mx.random.key(0))
    x = mx.ones((4, 512))
    mx.eval(w, x)

    def step(h):
        for _ in range(3):
            h = mx.distributed.all_sum(mx.tanh(h @ w), group=group) * 0.5
        return h

    if peer is None:  # rank 1: follow until killed
        while True:
            x = step(x)
            mx.eval(x)
    queued = None
    n = 0
    try:
        for n in range(1_000_000):
            y = step(x)
            if mode == "sync":
                mx.eval(y)
            else:
                mx.async_eval(y)
                if queued is not None:
                    mx.eval(queued)
                queued = y
            if mode == "chained":
                x = y
            if n == kill_at:
                os.kill(peer, signal.SIGKILL)
    except Exception as e:  # noqa: BLE001 — what we want to see
        print(f"rank 0 raised at step {n}: {type(e).__name__}: {e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("chained", "independent", "sync"))
    ap.add_argument("--kill-at", type=int, default=20)
    ap.add_argument("--wait", type=float, default=40.0)
    ap.add_argument("--peer", type=int)
    a = ap.parse_args()
    if "MLX_RANK" in os.environ:
        rank(a.mode, a.kill_at, a.peer)
    else:
        print(f"{a.mode}: rank 0 exit status {launch(a.mode, a.kill_at, a.wait)}", flush=True)


if __name__ == "__main__":
    main()
