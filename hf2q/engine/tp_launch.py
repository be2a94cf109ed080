"""Start a tensor-parallel group: rank 0 in this process, ranks 1..N-1 as child processes.

``runner_factory(path, n, ctx)`` is what ``hf2q serve --tensor-parallel N`` hands to the
runtime; the runtime calls it inside its GPU-owner thread, which then becomes rank 0.
Start-up, in order, each step bounded so that a rank that never comes up fails the load
instead of hanging it:

1. rank 0 checks that the model splits over N ranks (heads, block-aligned columns) —
   a model that does not is an ``InputError`` before any process starts;
2. it listens for control connections on 127.0.0.1 and spawns the followers
   (``python -m hf2q.engine.tp_launch --rank r …``) with the ``mx.distributed`` settings in
   their environment: a ring hostfile of free 127.0.0.1 ports (CPU), or ``NCCL_HOST_IP`` /
   ``NCCL_PORT`` / ``MLX_WORLD_SIZE`` and one GPU per rank through ``CUDA_VISIBLE_DEVICES``
   (CUDA; ``NCCL_NVLS_ENABLE=0`` is always set);
3. each follower connects back with a per-launch secret, then every rank calls
   ``mx.distributed.init`` (rank 0's runs in a helper thread watched for dead followers:
   MLX's ring init waits forever for a missing peer), loads its shard and reports ready.

Followers exit when the control connection closes or their parent process disappears, so
no rank outlives rank 0. ``mlx.launch`` is not used: it starts every rank itself, and
here rank 0 must be the serving process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hf2q.engine.distributed_runner import (
    DistributedRunner,
    GroupBroken,
    follow,
    recv_message,
    send_message,
)
from hf2q.errors import InputError

log = logging.getLogger("hf2q.tp")

START_TIMEOUT_S = 600.0  # loading a large shard can take minutes
TOKEN_ENV = "HF2Q_TP_TOKEN"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free right now (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def choose_backend() -> str:
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return "nccl" if cuda is not None and cuda.is_available() else "ring"


def rank_env(backend: str, rank: int, size: int, workdir: Path, ports: list[int]) -> dict[str, str]:
    """The environment ``mx.distributed.init(backend=…)`` reads for ``rank``."""
    env = {"MLX_RANK": str(rank), "NCCL_NVLS_ENABLE": "0"}
    if backend == "ring":
        hostfile = workdir / "ring-hosts.json"
        if not hostfile.exists():
            hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[:size]]))
        env["MLX_HOSTFILE"] = str(hostfile)
    else:
        env.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(ports[0]), MLX_WORLD_SIZE=str(size))
    return env


def plan_split(model, size: int):
    """Every rank's ``HeadPlan`` for ``model`` (path or opened GGUF); ``InputError`` when it cannot split ``size`` ways."""
    from hf2q.engine.tensor_parallel import head_plan, shard_gguf
    from hf2q.formats.gguf_file import GGUFFile, open_gguf

    g = model if isinstance(model, GGUFFile) else open_gguf(model)
    if g.hparams.is_encoder:
        raise InputError(f"{g.path.name}: tensor parallelism serves decoder (chat) models only")
    n_heads, n_kv = g.hparams.uniform_heads(" with tensor parallelism")
    plans = []
    for r in range(size):
        plans.append(head_plan(n_heads, n_kv, size, r, g.path.name))
        shard_gguf(g, r, size)  # views only: proves every column cut is block-aligned
    return plans


class Followers:
    """The follower processes of one group: liveness checks and teardown."""

    def __init__(self, procs: list[subprocess.Popen], workdir: tempfile.TemporaryDirectory):
        self.procs = procs
        self._workdir = workdir

    def check_alive(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            rc = p.poll()
            if rc is not None:
                raise GroupBroken(f"tensor-parallel rank {r} exited with status {rc}")

    def terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._workdir.cleanup()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _wait(what: str, done: Callable[[], bool], followers: Followers, deadline: float) -> None:
    while not done():
        followers.check_alive()
        if time.monotonic() > deadline:
            raise GroupBroken(f"tensor-parallel start-up: {what} timed out")
        time.sleep(0.05)


def launch(path: str | Path, size: int, ctx: int | None = None, *, backend: str | None = None,
           timeout_s: float = START_TIMEOUT_S) -> DistributedRunner:
    """Start ``size`` ranks over ``path``; this process becomes rank 0. Returns its runner."""
    from hf2q.engine.factory import prepare_mlx

    prepare_mlx()
    import mlx.core as mx

    from hf2q.engine.tensor_parallel import load_shard
    from hf2q.formats.gguf_file import open_gguf

    gguf = open_gguf(path)  # parsed once here: big tokenizers make parsing take seconds
    plans = plan_split(gguf, size)
    backend = backend or choose_backend()
    deadline = time.monotonic() + timeout_s
    workdir = tempfile.TemporaryDirectory(prefix="hf2q-tp-")
    listener = socket.create_server(("127.0.0.1", 0), backlog=size)
    listener.settimeout(0.2)
    token = secrets.token_hex(16)
    ports = free_ports(size)
    procs = []
    for r in range(1, size):
        env = {**os.environ, **rank_env(backend, r, size, Path(workdir.name), ports), TOKEN_ENV: token}
        if backend == "nccl":  # one GPU per rank: the r-th of those this process may use
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
            env["CUDA_VISIBLE_DEVICES"] = visible[r].strip() if len(visible) > r and visible[r].strip() else str(r)
        cmd = [sys.executable, "-m", "hf2q.engine.tp_launch", "--rank", str(r), "--size", str(size),
               "--model", str(path), "--control", f"127.0.0.1:{listener.getsockname()[1]}",
               "--backend", backend, "--parent", str(os.getpid())]
        if ctx:
            cmd += ["--ctx", str(ctx)]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
    followers = Followers(procs, workdir)
    try:
        links: dict[int, socket.socket] = {}

        def accept_one() -> bool:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return len(links) == size - 1
            conn.settimeout(10)
            msg = recv_message(conn)
            if msg and msg[0].get("token") == token and 0 < int(msg[0].get("rank", 0)) < size:
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                links[int(msg[0]["rank"])] = conn
            else:
                conn.close()  # not one of ours
            return len(links) == size - 1

        _wait("followers connecting", accept_one, followers, deadline)
        listener.close()

        os.environ.update(rank_env(backend, 0, size, Path(workdir.name), ports))
        box: list = []
        helper = threading.Thread(target=lambda: box.append(_init(mx, backend)), daemon=True,
                                  name="hf2q-tp-init")
        helper.start()
        _wait("mx.distributed.init", lambda: bool(box), followers, deadline)
        group = box[0]
        if isinstance(group, BaseException):
            raise GroupBroken(f"mx.distributed.init({backend!r}) failed: {group}")
        if group.size() != size:
            raise GroupBroken(f"mx.distributed.init({backend!r}) formed a group of {group.size()}, not {size}")
        local = load_shard(gguf, 0, size, group, ctx)
        ready: set[int] = set()
        for r, conn in links.items():
            conn.settimeout(0.2)

        def poll_ready() -> bool:
            for r, conn in links.items():
                if r in ready:
                    continue
                try:
                    msg = recv_message(conn)
                except TimeoutError:
                    continue
                if msg is None:
                    raise GroupBroken(f"tensor-parallel rank {r} closed its control connection during start-up")
                if msg[0].get("op") == "failed":
                    raise GroupBroken(f"tensor-parallel rank {r} failed to start: {msg[0].get('error')}")
                ready.add(r)
            return len(ready) == size - 1

        _wait("followers loading their shards", poll_ready, followers, deadline)
        for conn in links.values():
            conn.settimeout(None)
        log.info("tensor-parallel group of %d ranks ready (%s)", size, backend)
        runner = DistributedRunner(local, [links[r] for r in range(1, size)], plans, group,
                                   check_alive=followers.check_alive, on_fault=followers.terminate)
        runner.followers = followers
        return runner
    except BaseException:
        listener.close()
        followers.terminate()
        raise


def _init(mx, backend: str):
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except BaseException as e:  # noqa: BLE001 — handed to the waiting thread
        return e


def runner_factory(path: str | Path, size: int, ctx: int | None = None) -> Callable[[], object]:
    """What the serving runtime calls in its GPU-owner thread: one rank (plain runner) or a TP group."""
    def build():
        if size == 1:
            from hf2q.engine.factory import load_runner

            return load_runner(path, ctx)
        return launch(path, size, ctx)
    return build


# ---- follower process -------------------------------------------------------------------------

def _watch_parent(parent: int) -> None:
    """Exit as soon as rank 0's process is gone (even while blocked inside a collective)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def follower_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hf2q.engine.tp_launch",
                                 description="one tensor-parallel follower rank (started by rank 0)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--control", required=True, help="HOST:PORT of rank 0's control listener")
    ap.add_argument("--backend", default="ring")
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--ctx", type=int)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"hf2q tp rank {a.rank}: %(message)s")
    threading.Thread(target=_watch_parent, args=(a.parent,), daemon=True).start()
    host, port = a.control.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_message(sock, {"token": os.environ.pop(TOKEN_ENV, ""), "rank": a.rank})
    try:
        from hf2q.engine.factory import prepare_mlx

        prepare_mlx()
        import mlx.core as mx

        from hf2q.engine.tensor_parallel import head_plan, load_shard

        group = mx.distributed.init(strict=True, backend=a.backend)
        runner = load_shard(a.model, a.rank, a.size, group, a.ctx)
        g = runner.gguf
        plan = head_plan(*g.hparams.uniform_heads(), a.size, a.rank)
    except Exception as e:  # noqa: BLE001 — reported to rank 0, which fails the load
        send_message(sock, {"op": "failed", "error": f"{type(e).__name__}: {e}"})
        return 1
    send_message(sock, {"op": "ready"})
    try:
        return follow(runner, sock, group, plan)
    except Exception as e:  # noqa: BLE001 — one line; rank 0 sees the rank die and fails closed
        print(f"hf2q tp rank {a.rank}: fatal: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(follower_main())
