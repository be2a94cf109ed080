"""Start a tensor-parallel group: rank 0 in this process, ranks 1..N-1 on this machine or on others.

``runner_factory(path, n, ctx, hosts)`` is what ``hf2q serve --tensor-parallel N`` hands to
the runtime; the runtime calls it inside its GPU-owner thread, which then becomes rank 0.
Start-up, in order, each step bounded so that a rank that never comes up fails the load
instead of hanging it:

1. rank 0 checks that the model splits over N ranks (heads, block-aligned columns) —
   a model that does not is an ``InputError`` before any process starts;
2. one machine: it listens for control connections on 127.0.0.1 and spawns the followers
   (``python -m hf2q.engine.tp_launch --rank r …``) with the ``mx.distributed`` settings in
   their environment: a ring hostfile of free 127.0.0.1 ports (CPU), or ``NCCL_HOST_IP`` /
   ``NCCL_PORT`` / ``MLX_WORLD_SIZE`` and one GPU per rank through ``CUDA_VISIBLE_DEVICES``
   (CUDA; ``NCCL_NVLS_ENABLE=0`` is always set). Several machines (``hosts``, an
   ``mlx.launch`` hostfile, ``hf2q.engine.tp_hosts``): it listens on its hostfile address and
   the followers, started by hand there (``hf2q tp-follower``), connect to it;
3. each follower says hello (the launch's secret, its rank, its model file's identity); rank
   0 answers with the backend and context, then every rank calls ``mx.distributed.init``
   (rank 0's runs in a helper thread watched for dead followers: MLX's ring init waits
   forever for a missing peer), loads its shard and reports ready.

Followers exit when the control connection closes or their parent process disappears, so
no rank outlives rank 0. ``mlx.launch`` is not used to start ranks: it starts every rank
itself, and here rank 0 must be the serving process; its hostfile is what places them.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hf2q.engine.distributed_runner import (
    FOLLOWER_BROKEN,
    DistributedRunner,
    GroupBroken,
    follow,
    pipelines_over,
    recv_message,
    send_message,
)
from hf2q.engine.tp_hosts import SECRET_ENV as TOKEN_ENV
from hf2q.engine.tp_hosts import TPHosts, apply_envs, group_token, hosts_from_args, model_identity
from hf2q.errors import EXIT_INTERRUPTED, ConversionError, Hf2qError, InputError, UsageError

log = logging.getLogger("hf2q.tp")

START_TIMEOUT_S = 600.0  # loading a large shard can take minutes


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


def rank_env(backend: str, rank: int, size: int, workdir: Path, ring: list[str],
             nccl: tuple[str, int]) -> dict[str, str]:
    """The environment ``mx.distributed.init(backend=…)`` reads for ``rank``: the ring's
    ``host:port`` per rank (written as MLX's ring hostfile) or NCCL's rendezvous at rank 0."""
    env = {"MLX_RANK": str(rank), "NCCL_NVLS_ENABLE": "0"}
    if backend == "ring":
        hostfile = workdir / "ring-hosts.json"
        if not hostfile.exists():
            hostfile.write_text(json.dumps([[a] for a in ring[:size]]))
        env["MLX_HOSTFILE"] = str(hostfile)
    else:
        env.update(NCCL_HOST_IP=nccl[0], NCCL_PORT=str(nccl[1]), MLX_WORLD_SIZE=str(size))
    return env


def tune(conn: socket.socket) -> None:
    """A control connection: no Nagle delay, and TCP keepalive so a host that vanishes (no FIN) is
    noticed within seconds rather than the kernel's two hours."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def peer_closed(sock: socket.socket) -> bool:
    """Whether the other end of ``sock`` is gone, without consuming anything (safe beside a sender).

    Followers send nothing once ready, so a readable control socket on rank 0 means EOF or reset;
    on a follower, a readable socket normally holds the next command (not EOF)."""
    if sock.fileno() < 0:
        return True
    try:
        poller = select.poll()  # not select(): a busy server's descriptors may pass FD_SETSIZE
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


def plan_split(model, size: int):
    """Every rank's ``HeadPlan`` for ``model`` (path or opened GGUF); ``InputError`` when it cannot split ``size`` ways."""
    from hf2q.engine.tensor_parallel import rank_plan, shard_gguf
    from hf2q.formats.gguf_file import GGUFFile, open_gguf

    g = model if isinstance(model, GGUFFile) else open_gguf(model)
    if g.hparams.is_encoder:
        raise InputError(f"{g.path.name}: tensor parallelism serves decoder (chat) models only")
    plans = []
    for r in range(size):
        plans.append(rank_plan(g, size, r))
        shard_gguf(g, r, size)  # views only: proves every column cut is block-aligned
    return plans


class Followers:
    """The follower processes of one single-host group: liveness checks and teardown."""

    def __init__(self, procs: list[subprocess.Popen], workdir: tempfile.TemporaryDirectory):
        self.procs = procs
        self._workdir = workdir

    def check_alive(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            rc = p.poll()
            if rc is not None:
                raise GroupBroken(f"tensor-parallel rank {r} exited with status {rc}")

    def reap(self, grace_s: float = 10.0) -> None:
        """After a clean stop: let the followers exit by themselves (status 0), then clean up."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.terminate()

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


class RemoteFollowers:
    """The followers of a group spanning hosts: rank 0 cannot see their processes, only their
    control connections — a closed or reset connection (a killed process, a rebooted host, a
    keepalive that went unanswered) is a dead rank."""

    def __init__(self, hosts: TPHosts, workdir: tempfile.TemporaryDirectory):
        self.hosts = hosts
        self.links: dict[int, socket.socket] = {}
        self._workdir = workdir

    def check_alive(self) -> None:
        for r, conn in sorted(self.links.items()):
            if peer_closed(conn):
                raise GroupBroken(f"tensor-parallel rank {r} ({self.hosts.addresses[r]}) closed its control "
                                  f"connection")

    def reap(self) -> None:
        self.terminate()

    def terminate(self) -> None:
        for conn in self.links.values():  # a follower exits when its control connection closes
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._workdir.cleanup()

    pids: list[int] = []


def _wait(what: str | Callable[[], str], done: Callable[[], bool], followers, deadline: float,
          timeout_s: float) -> None:
    while not done():
        followers.check_alive()
        if time.monotonic() > deadline:
            text = what() if callable(what) else what
            raise GroupBroken(f"tensor-parallel start-up: {text} did not finish within {timeout_s:g} s")
        time.sleep(0.05)


def launch(path: str | Path, size: int, ctx: int | None = None, *, backend: str | None = None,
           timeout_s: float = START_TIMEOUT_S, hosts: TPHosts | None = None,
           kv_cache_type: str = "f16") -> DistributedRunner:
    """Start ``size`` ranks over ``path``; this process becomes rank 0. Returns its runner. Every rank
    stores its own KV heads as ``kv_cache_type`` (the welcome message tells the followers).

    Without ``hosts`` the followers are child processes on this machine; with them (a parsed
    hostfile) they are started by hand on their hosts (``hf2q tp-follower``) and connect here."""
    from hf2q.engine.factory import prepare_mlx

    prepare_mlx()
    import mlx.core as mx

    from hf2q.formats.gguf_file import open_gguf

    gguf = open_gguf(path)  # parsed once here: big tokenizers make parsing take seconds
    plans = plan_split(gguf, size)
    identity = model_identity(gguf)
    deadline = time.monotonic() + timeout_s
    workdir = tempfile.TemporaryDirectory(prefix="hf2q-tp-")
    if hosts is None:
        backend = backend or choose_backend()
        ports = free_ports(size)
        ring, nccl = [f"127.0.0.1:{p}" for p in ports], ("127.0.0.1", ports[0])
        listener = socket.create_server(("127.0.0.1", 0), backlog=size)
        token = secrets.token_hex(16)
        procs = []
        for r in range(1, size):
            env = {**os.environ, **rank_env(backend, r, size, Path(workdir.name), ring, nccl), TOKEN_ENV: token}
            if backend == "nccl":  # one GPU per rank: the r-th of those this process may use
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                env["CUDA_VISIBLE_DEVICES"] = visible[r].strip() if len(visible) > r and visible[r].strip() else str(r)
            cmd = [sys.executable, "-m", "hf2q.engine.tp_launch", "--rank", str(r), "--size", str(size),
                   "--model", str(path), "--control", f"127.0.0.1:{listener.getsockname()[1]}",
                   "--parent", str(os.getpid())]
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        followers = Followers(procs, workdir)
    else:
        apply_envs(hosts)
        backend = backend or hosts.backend or choose_backend()
        ring, nccl = hosts.ring(), hosts.nccl
        try:
            listener = socket.create_server(hosts.control, backlog=size)
        except OSError as e:
            workdir.cleanup()
            raise GroupBroken(f"tensor-parallel rank 0 cannot listen on {hosts.control[0]}:{hosts.control[1]} "
                              f"for its followers: {e.strerror or e}") from None
        token = group_token()
        followers = RemoteFollowers(hosts, workdir)
    listener.settimeout(0.2)
    try:
        links: dict[int, socket.socket] = {}

        def accept_one() -> bool:
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                return len(links) == size - 1
            conn.settimeout(10)
            try:
                msg = recv_message(conn)
            except (OSError, ValueError):
                msg = None
            hello = msg[0] if msg else {}
            offered = str(hello.get("token", "")) if isinstance(hello, dict) else ""
            if not hmac.compare_digest(offered.encode(), token.encode()):
                if hosts is not None:
                    log.warning("tensor-parallel: refused a connection from %s (no or another %s)", addr[0], TOKEN_ENV)
                conn.close()  # not one of ours
                return len(links) == size - 1
            rank = hello.get("rank")
            problem = None
            if not isinstance(rank, int) or not 0 < rank < size or hello.get("size") != size:
                problem = f"a follower at {addr[0]} says it is rank {rank} of {hello.get('size')}, not 1..{size - 1} of {size}"
            elif rank in links:
                problem = f"two followers say they are rank {rank}"
            elif hello.get("model") != identity:
                problem = (f"rank {rank} ({addr[0]}) opened a different model than rank 0's {gguf.path.name} "
                           f"(every host needs the same GGUF)")
            if problem:
                send_message(conn, {"op": "refused", "error": problem})
                conn.close()
                raise GroupBroken(problem)
            send_message(conn, {"op": "welcome", "backend": backend, "ctx": ctx, "kv_cache_type": kv_cache_type})
            conn.settimeout(None)
            tune(conn)
            links[rank] = conn
            if isinstance(followers, RemoteFollowers):
                followers.links[rank] = conn
            return len(links) == size - 1

        def missing() -> str:
            absent = [r for r in range(1, size) if r not in links]
            if hosts is None:
                return f"followers connecting (ranks {absent} missing)"
            return "; ".join(f"rank {r} ({hosts.addresses[r]}) never joined — start it there with "
                             f"`hf2q tp-follower --hostfile FILE --rank {r} MODEL`" for r in absent) + ";"

        _wait(missing, accept_one, followers, deadline, timeout_s)
        listener.close()

        os.environ.update(rank_env(backend, 0, size, Path(workdir.name), ring, nccl))
        box: list = []
        helper = threading.Thread(target=lambda: box.append(_init(mx, backend)), daemon=True,
                                  name="hf2q-tp-init")
        helper.start()
        _wait("mx.distributed.init", lambda: bool(box), followers, deadline, timeout_s)
        group = box[0]
        if isinstance(group, BaseException):
            raise GroupBroken(f"mx.distributed.init({backend!r}) failed: {group}")
        if group.size() != size:
            raise GroupBroken(f"mx.distributed.init({backend!r}) formed a group of {group.size()}, not {size}")
        local = load_shard(gguf, 0, size, group, ctx, kv_cache_type)
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

        _wait("followers loading their shards", poll_ready, followers, deadline, timeout_s)
        for conn in links.values():
            conn.settimeout(None)
        log.info("tensor-parallel group of %d ranks ready (%s%s)", size, backend,
                 "" if hosts is None else ", " + ", ".join(hosts.addresses))
        runner = DistributedRunner(local, [links[r] for r in range(1, size)], plans, group,
                                   check_alive=followers.check_alive, on_fault=followers.terminate,
                                   on_close=followers.reap, pipelined=pipelines_over(backend))
        runner.followers = followers  # a runner closed, dropped or alive at exit reaps them (on_close)
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


def runner_factory(path: str | Path, size: int, ctx: int | None = None, hosts: TPHosts | None = None,
                   timeout_s: float = START_TIMEOUT_S, kv_cache_type: str = "f16") -> Callable[[], object]:
    """What the serving runtime calls in its GPU-owner thread: one rank (plain runner) or a TP group."""
    def build():
        if size == 1:
            from hf2q.engine.factory import load_runner

            return load_runner(path, ctx, kv_cache_type)
        return launch(path, size, ctx, hosts=hosts, timeout_s=timeout_s, kv_cache_type=kv_cache_type)
    return build


# ---- follower process -------------------------------------------------------------------------

def _leave(stopped: threading.Event, rank: int, why: str) -> None:
    """Exit the process because rank 0 is gone — unless it stopped the group just before (its last
    command may still be on its way to the main thread, which then exits 0 by itself)."""
    if stopped.wait(1.0):
        return
    print(f"hf2q tp rank {rank}: {why}; the group is broken, exiting", file=sys.stderr, flush=True)
    os._exit(FOLLOWER_BROKEN)


def _watch_parent(parent: int, rank: int, stopped: threading.Event) -> None:
    """Exit as soon as rank 0's process is gone (even while blocked inside a collective)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    _leave(stopped, rank, "rank 0's process is gone")


def _watch_control(sock: socket.socket, rank: int, stopped: threading.Event) -> None:
    """Exit as soon as rank 0's control connection closes, even while blocked inside a collective
    (an NCCL collective whose peer is gone never returns); the only signal across hosts."""
    while not peer_closed(sock):
        time.sleep(0.5)
    _leave(stopped, rank, "rank 0 closed the control connection")


def _exit_on_signal(rank: int) -> None:
    """SIGTERM / SIGINT end a follower at once (also while it waits inside a collective): one line, and
    the interrupted status; rank 0 sees the rank leave and fails the group closed."""
    def handler(signum, _frame):
        print(f"hf2q tp rank {rank}: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _connect(control: tuple[str, int], rank: int, deadline: float, timeout_s: float) -> socket.socket:
    """The control connection to rank 0, retried until ``deadline`` (the follower may start first)."""
    while True:
        try:
            return socket.create_connection(control, timeout=5)
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConversionError(f"tensor-parallel rank {rank}: rank 0 at {control[0]}:{control[1]} did not "
                                      f"answer within {timeout_s:g} s ({e.strerror or e}); start `hf2q serve "
                                      f"--hostfile …` there") from None
            time.sleep(0.5)


def run_follower(model: str | Path, rank: int, size: int, control: tuple[str, int], *, token: str,
                 hosts: TPHosts | None = None, parent: int | None = None,
                 timeout_s: float = START_TIMEOUT_S) -> int:
    """One follower rank, from the first connection to rank 0 to its end; its exit status.

    ``hosts`` (a group across machines) gives this rank's ``mx.distributed`` settings; without
    it (a child of rank 0) they are already in the environment. Rank 0 answers the hello with
    the backend and context every rank uses, or refuses it (wrong model, rank or size)."""
    from hf2q.formats.gguf_file import open_gguf

    g = open_gguf(model)
    stopped = threading.Event()  # set when rank 0 ends the group cleanly
    if threading.current_thread() is threading.main_thread():
        _exit_on_signal(rank)
    if parent is not None:
        threading.Thread(target=_watch_parent, args=(parent, rank, stopped), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    sock = _connect(control, rank, deadline, timeout_s)
    send_message(sock, {"token": token, "rank": rank, "size": size, "model": model_identity(g)})
    sock.settimeout(max(1.0, deadline - time.monotonic()))
    try:
        reply = recv_message(sock)
    except (TimeoutError, OSError):
        reply = None
    if reply is None:
        raise ConversionError(f"tensor-parallel rank {rank}: rank 0 at {control[0]}:{control[1]} did not accept "
                              f"this follower (another {TOKEN_ENV}, or another group)")
    if reply[0].get("op") != "welcome":
        raise ConversionError(f"tensor-parallel rank {rank}: rank 0 refused it: {reply[0].get('error')}")
    sock.settimeout(None)
    tune(sock)
    threading.Thread(target=_watch_control, args=(sock, rank, stopped), daemon=True).start()
    backend, ctx, kv_type = reply[0]["backend"], reply[0].get("ctx"), reply[0].get("kv_cache_type", "f16")
    try:
        if hosts is not None:
            workdir = tempfile.mkdtemp(prefix="hf2q-tp-")
            os.environ.update(rank_env(backend, rank, size, Path(workdir), hosts.ring(), hosts.nccl))
        from hf2q.engine.factory import prepare_mlx

        prepare_mlx()
        import mlx.core as mx

        from hf2q.engine.tensor_parallel import rank_plan

        group = mx.distributed.init(strict=True, backend=backend)
        runner = load_shard(g, rank, size, group, ctx, kv_type)
        plan = rank_plan(g, size, rank)
    except Exception as e:  # noqa: BLE001 — reported to rank 0, which fails the load
        send_message(sock, {"op": "failed", "error": f"{type(e).__name__}: {e}"})
        print(f"hf2q tp rank {rank}: failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    send_message(sock, {"op": "ready"})
    log.info("rank %d of %d ready (%s)", rank, size, backend)
    try:
        return follow(runner, sock, group, plan, stopped)
    except Exception as e:  # noqa: BLE001 — one line; rank 0 sees the rank die and fails closed
        print(f"hf2q tp rank {rank}: fatal: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return FOLLOWER_BROKEN


def follower_command(args) -> int:
    """``hf2q tp-follower --hostfile FILE --rank R MODEL`` (or ``--hosts a,b``): one rank of a group spanning machines."""
    hosts = hosts_from_args(args)
    if not 0 < args.rank < hosts.size:
        raise UsageError(f"--rank {args.rank}: a follower is rank 1..{hosts.size - 1} of the hostfile's "
                         f"{hosts.size} hosts (rank 0 is `hf2q serve`)")
    model = Path(args.model).expanduser()
    if not model.is_file():
        raise InputError(f"{str(model)!r} does not exist (each host needs its own copy of the GGUF)")
    apply_envs(hosts)
    logging.getLogger("hf2q.tp").setLevel(logging.INFO)
    return run_follower(model, args.rank, hosts.size, hosts.control, token=group_token(),
                        hosts=hosts, timeout_s=args.tp_timeout)


def follower_main(argv: list[str] | None = None) -> int:
    """A follower started by rank 0 on this machine (its ``mx.distributed`` settings in the environment)."""
    ap = argparse.ArgumentParser(prog="python -m hf2q.engine.tp_launch",
                                 description="one tensor-parallel follower rank (started by rank 0)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--control", required=True, help="HOST:PORT of rank 0's control listener")
    ap.add_argument("--parent", type=int, required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"hf2q tp rank {a.rank}: %(message)s")
    host, port = a.control.rsplit(":", 1)
    try:
        return run_follower(a.model, a.rank, a.size, (host, int(port)), token=os.environ.pop(TOKEN_ENV, ""),
                            parent=a.parent, timeout_s=60)
    except Hf2qError as e:
        print(f"hf2q tp rank {a.rank}: {e}", file=sys.stderr, flush=True)
        return e.exit_code



def load_shard(model: str | Path | GGUFFile, rank: int, size: int, group, ctx: int | None = None,
               kv_cache_type: str = "f16"):
    """An ``MlxModelRunner`` over rank ``rank``'s share of ``model`` (a path or an opened GGUF).

    Its KV caches hold the rank's KV heads only, so ``kv_bytes_per_token`` is per rank.
    """
    from hf2q.engine.models import build_model
    from hf2q.engine.runner import MlxModelRunner, compute_dtype
    from hf2q.engine.tensor_parallel import parallelize, shard_gguf
    from hf2q.formats.gguf_check import check_weights
    from hf2q.formats.gguf_file import GGUFFile, open_gguf

    g = model if isinstance(model, GGUFFile) else open_gguf(model)
    if g.hparams.is_encoder:
        raise InputError(f"{g.path.name}: tensor parallelism serves decoder (chat) models only")
    check_weights(g)  # the whole file, before its tensors are cut into this rank's shares
    view = shard_gguf(g, rank, size)
    dtype = compute_dtype(g.arch)
    model = parallelize(build_model(view, dtype), group)
    runner = MlxModelRunner(view, model, dtype, ctx, kv_cache_type)
    runner.gguf = g  # names, tokenizer and metadata of the real file
    return runner


if __name__ == "__main__":
    sys.exit(follower_main())
