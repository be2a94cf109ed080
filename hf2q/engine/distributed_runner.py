"""A ``ModelRunner`` spread over tensor-parallel ranks: rank 0 leads, the followers replay.

Rank 0 (the serving process) holds a :class:`DistributedRunner`; every engine call on it —
``new_sequence``, ``prefill``, ``decode``, ``decode_async``, ``trim`` (on the sequence),
``export_kv``, ``import_kv`` — is first sent to every follower as a small command, then run on rank 0's
own shard. Each follower runs :func:`follow`, which executes the same call on its shard;
the ranks meet inside the forward pass at the ``mx.distributed.all_sum`` of every
row-parallel layer, so the logits on rank 0 are the full model's. Sequence ids are
assigned by rank 0 and identical everywhere.

Commands travel on a plain TCP control connection per follower (to 127.0.0.1 on one
machine, to rank 0's hostfile address across machines; length-prefixed JSON + raw numpy
bytes); only tensors use ``mx.distributed``. Measured reason: a follower that
waits for its next command inside an MLX ring ``all_sum`` spins at ~30 % of a CPU core
while the server is idle (and a waiting NCCL collective would occupy the GPU), whereas a
socket ``recv`` sleeps. The socket also reports a dead peer at once (EOF / broken pipe).

Pipelined decode (``decode_async``): rank 0 samples on the device and its tokens reach the
followers inside the graph — each rank adds its contribution to one ``all_sum`` of an int32 ``[N]``
array (rank 0 its sampled ids, a follower zeros that depend on its own logits, so every rank
meets that collective after the step's last layer). The sum, identical on every rank, is what
each rank feeds its next step, so the follower never waits for rank 0's host and rank 0 never
reads its tokens to send them: the command for step *n+1* names step *n* (``after``) instead of
carrying ids. Why not sample identically on every rank: the followers would need every
request's sampler and RNG key, and their tokens would match rank 0's only if the all-reduced
logits were bitwise equal on every rank and backend (an assumption about each backend's
all-reduce algorithm); one small integer collective per step costs less than relying on it (docs/TENSOR_PARALLEL.md has the figures).

Failure handling (fail closed, docs/TENSOR_PARALLEL.md): a follower that died is noticed before the next
command (process watch, broken pipe) or inside a collective (the ring backend raises
"connection to a peer was lost"; a hung NCCL collective is caught by the supervisor's
deadline). Rank 0 then raises, marks the group broken (every later call raises too)
and terminates the remaining followers. A follower exits when its control connection
closes, i.e. when rank 0 is gone. Errors a user can cause (``InputError``, context
exceeded) are raised identically on every rank before any collective, so they leave the
group in step.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from hf2q.engine.kv_layout import END_STATE_PREFIX
from hf2q.errors import InputError

log = logging.getLogger("hf2q.tp")

_LEN = struct.Struct("!Q")


# ---- control messages ---------------------------------------------------------------------

def send_message(sock: socket.socket, header: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
    """One frame: length of the JSON header, the header (which lists the arrays), the raw array bytes."""
    arrays = {k: np.ascontiguousarray(v) for k, v in (arrays or {}).items()}
    header = {**header, "arrays": [[k, v.dtype.str, list(v.shape)] for k, v in arrays.items()]}
    head = json.dumps(header).encode()
    sock.sendall(b"".join([_LEN.pack(len(head)), head, *(v.tobytes() for v in arrays.values())]))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> tuple[dict, dict[str, np.ndarray]] | None:
    """The next frame, or None when the peer closed the connection."""
    raw = _recv_exact(sock, _LEN.size)
    if raw is None:
        return None
    head = _recv_exact(sock, _LEN.unpack(raw)[0])
    if head is None:
        return None
    header = json.loads(head)
    arrays = {}
    for name, dtype, shape in header.pop("arrays"):
        dt = np.dtype(dtype)
        body = _recv_exact(sock, int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
        if body is None:
            return None
        arrays[name] = np.frombuffer(body, dtype=dt).reshape(shape)
    return header, arrays


# ---- pipelined decode (every rank) -----------------------------------------------------------

#: set to 1 to pipeline decode steps over the ring backend too (tests, benchmarks)
RING_PIPELINE_ENV = "HF2Q_TP_PIPELINE"


def pipelines_over(backend: str) -> bool:
    """Whether the serving runtime should queue decode steps ahead over ``backend``.

    Not over MLX's ring backend (CPU) unless ``HF2Q_TP_PIPELINE=1``: measured, a queued step buys
    nothing on a CPU, which builds the graph and runs the kernels on the same cores; and a peer that
    dies while a step is queued can crash rank 0 inside the ring backend (a segfault in
    ``mx.async_eval`` while the ring fails its pending tasks) instead of raising, which a synchronous
    step does. NCCL (GPUs), the case pipelining is for, fails by hanging, which the GPU owner's
    dead-rank poll catches."""
    return backend != "ring" or os.environ.get(RING_PIPELINE_ENV) == "1"


#: queued steps a follower keeps addressable for ``after`` (a pipeline chains from the newest one)
KEPT_STEPS = 4


def shared_step(runner, seqs, tokens, samplers, group, lead: bool) -> tuple["mx.array", "mx.array"]:
    """Collective: one ``decode_async`` on this rank's shard, then rank 0's sampled ids on every
    rank (an ``all_sum`` where only ``lead`` contributes). Lazy ``(tokens [N] int32, logprobs [N])``;
    the logprobs are meaningful on rank 0 only."""
    import mlx.core as mx

    own = runner.decode_async(seqs, tokens, samplers)
    # a follower's zeros are computed from its own sample, so its all_sum waits for the step's last
    # all-reduce, as rank 0's does: every rank meets the collectives in the same order
    shared = mx.distributed.all_sum(own.tokens if lead else own.tokens * 0, group=group)
    mx.async_eval(shared)
    return shared, own.logprobs


class GroupPending:
    """Rank 0's queued distributed step; reading it fails the group closed if a collective broke.

    Wraps the ``PendingTokens`` of the broadcast ids (``inner``, what rank 0's shard is fed next)."""

    __slots__ = ("inner", "step", "_runner")

    def __init__(self, inner, step: int, runner: "DistributedRunner"):
        self.inner, self.step, self._runner = inner, step, runner

    @property
    def tokens(self):
        return self.inner.tokens

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        try:
            return self.inner.result()
        except Exception as e:
            if self._runner._broken is None:
                self._runner._fail(e)
            raise GroupBroken(self._runner._broken) from e


# ---- rank 0 ---------------------------------------------------------------------------------

class GroupBroken(RuntimeError):
    """A tensor-parallel rank died or a collective failed; the engine must not be used again."""


class ShardedSequence:
    """Rank 0's handle on one sequence; every rank holds its heads' KV under the same id."""

    def __init__(self, runner: DistributedRunner, seq_id: int, local):
        self._runner = runner
        self.seq_id = seq_id
        self.local = local

    @property
    def length(self) -> int:
        return self.local.length

    @property
    def nbytes(self) -> int:
        """Rank 0's KV bytes (each rank holds the same amount for its own heads)."""
        return self.local.nbytes

    def trim(self, n_tokens: int) -> None:
        self._runner._trim(self, n_tokens)

    def reuse_points(self) -> tuple[int, ...] | None:
        """Where this sequence can be trimmed back to (a recurrent or sliding-window cache); every
        rank's cache advances in step, so rank 0's points are the group's."""
        return self.local.reuse_points()

    @property
    def published_points(self) -> tuple[int, ...] | None:
        """Rank 0's reuse points as of the last forward or trim (what the slot routes prompts by)."""
        return getattr(self.local, "published_points", None)

    @property
    def mrope_shifts(self):
        """Rank 0's M-RoPE shifts after images (every rank's prefill records the same ones)."""
        return getattr(self.local, "mrope_shifts", None)

    @mrope_shifts.setter
    def mrope_shifts(self, pairs) -> None:  # set from outside a prefill (a restored prefix): on every rank
        self._runner._set_shifts(self, pairs)

    # ---- the persistent store's blocks (a hybrid model's: each rank captures its state share) ----

    @property
    def persist_kind(self) -> str:
        return getattr(self.local, "persist_kind", "")

    @property
    def block_ends(self) -> dict:
        """Rank 0's captured block ends (every rank captures the same ones, each its own share)."""
        return getattr(self.local, "block_ends", {})

    def keep_block_ends(self, block_tokens: int) -> None:
        """Capture block-end states on every rank. Called from the serving loop's side while the sequence
        runs no forward (``kv_prefix``): rank 0's is set here, the followers' with the next command (which
        precedes any forward of this sequence), so the caller never waits for a running step."""
        self.local.keep_block_ends(block_tokens)
        self._runner._keep_ends.append((self.seq_id, int(block_tokens)))

    def forget_block_ends(self, keep) -> None:
        """Let go of the captured block ends not in ``keep`` on every rank (an engine call)."""
        self._runner._forget_ends(self, keep)

    def __del__(self):  # followers drop their copy with the next command
        runner = getattr(self, "_runner", None)
        if runner is not None:
            runner._released.append(self.seq_id)


class ControlLinks:
    """Rank 0's control connections to the followers, the lock that keeps each command whole on them,
    and the one way the group ends (:meth:`close`).

    Apart from the runner so that the runner's finalizer can hold it: a runner dropped without
    ``close()``, or still alive when the interpreter exits (a server that drained), ends its group
    through the same ``close`` under the same lock as an explicit ``close()``."""

    def __init__(self, socks: Sequence[socket.socket], on_close: Callable[[], None]):
        self.socks = list(socks)
        self.lock = threading.Lock()
        self.broken: str | None = None  # why the group may not be used again
        self._on_close = on_close
        self._closed = False

    def close(self) -> None:
        """Tell every follower to stop (each exits 0), then run ``on_close`` (rank 0's launcher waits
        for its child ranks there). Idempotent. A broken group gets no stop: its followers were already
        ended as from a failure.

        A step that never returns (a hung collective) holds the lock: after a few seconds the group is
        ended without the stop (the followers then exit as from a broken group)."""
        locked = self.lock.acquire(timeout=5)
        try:
            if self._closed:
                return
            self._closed = True
            for sock in self.socks:
                try:
                    if locked and self.broken is None:
                        send_message(sock, {"op": "stop"})
                    sock.close()
                except OSError:
                    pass
            self.broken = self.broken or "tensor-parallel runner closed"
        finally:
            if locked:
                self.lock.release()
        try:
            self._on_close()
        except Exception:
            log.exception("stopping the tensor-parallel followers failed")


class DistributedRunner:
    """Rank 0's runner: broadcast each call to the followers, then run it on the local shard.

    ``local`` is rank 0's ``MlxModelRunner`` over its shard; ``links`` the control sockets
    of ranks 1..N-1 in rank order; ``plans`` every rank's :class:`HeadPlan`; ``check_alive``
    raises when a follower process has exited; ``on_fault`` tears the group down after a failure,
    ``on_close`` once the group has been told to stop (:meth:`close`, or the runner dropped).
    """

    def __init__(self, local, links: Sequence[socket.socket], plans, group, *,
                 check_alive: Callable[[], None] = lambda: None, on_fault: Callable[[], None] = lambda: None,
                 on_close: Callable[[], None] = lambda: None, pipelined: bool = True):
        self.local = local
        self._control = ControlLinks(links, on_close)
        self.links = self._control.socks
        self.plans = list(plans)
        self.group = group
        self.size = len(self.links) + 1
        self._check_alive = check_alive
        self._on_fault = on_fault
        self._next_id = 0
        self._released: list[int] = []
        self._keep_ends: list[tuple[int, int]] = []  # (seq id, block tokens) the followers are told next
        self._sent_images = None  # what the followers hold of rank 0's images (``attach_vision``)
        self._lock = self._control.lock  # one caller thread in practice; keeps commands whole regardless
        # dropped without close(), or alive at interpreter exit: the group still ends cleanly (same close)
        weakref.finalize(self, self._control.close)
        self._pipelined = pipelined  # whether the runtime may queue steps ahead (``pipelines_over``)
        self._step = 0  # id of the next pipelined step (the followers keep the last KEPT_STEPS by id)
        for name in ("vocab_size", "n_ctx_train", "n_ctx", "eos_token_ids", "is_embedding_model",
                     "kv_bytes_per_token", "gguf", "arch", "dtype", "stats"):
            setattr(self, name, getattr(local, name))
        self.tensor_parallel = self.size
        # prefix reuse: a recurrent or sliding-window model trims only at its reuse points, at any TP
        self.trims_prefix = bool(getattr(local, "trims_prefix", True))
        self.kv_bytes_per_slot = getattr(local, "kv_bytes_per_slot", 0)
        self.kv_cache_type = getattr(local, "kv_cache_type", "f16")  # every rank's (tp_launch tells the followers)

    @property
    def persists_kv(self) -> bool:
        """Plain K/V persists across ranks, a hybrid model's blocks with every rank's recurrent state share
        (``gather_kv``, ``gather_state``), a sliding-window model's with every rank's window rows (by KV head,
        as the K/V), and DeepSeek-V4's compact cache, whole on every rank (one rank's export is the block).
        Read when asked: the local runner's answer changes once its MTP head is on."""
        hybrid = hasattr(getattr(self.local, "model", None), "new_recurrent_state")
        windowed = bool(getattr(self.local, "window_layers", None))
        return bool(getattr(self.local, "persists_kv", True)) and (
            self.trims_prefix or hybrid or windowed or _same_cache_on_every_rank(self.local))

    @property
    def kv_identity(self) -> str:
        """KV computed over a tensor-parallel split (sharded heads, all-reduced partial sums) is its own kind;
        read when the store opens, after an MTP head was enabled (rank 0's identity names it)."""
        return f"{self.local.kv_identity}-tp{self.size}"

    @property
    def _broken(self) -> str | None:
        return self._control.broken

    @_broken.setter
    def _broken(self, why: str | None) -> None:
        self._control.broken = why

    def dead_peer(self) -> str | None:
        """Why a follower is gone (it exited), else None. Safe from any thread: only polls processes.

        The serving runtime polls it while a step is pending, because a collective (NCCL) with a
        dead peer never returns — without it the group fails closed only at the step deadline."""
        try:
            self._check_alive()
        except GroupBroken as e:
            if self._broken is None:  # fail closed on every rank: stop the survivors (they wait in NCCL)
                self._fail(e)
            return str(e)
        return None

    # ---- plumbing ------------------------------------------------------------------------

    def _run(self, header: dict, local_call: Callable[[], object], arrays=None, per_rank=None):
        """Send ``header`` (+ arrays, or ``per_rank[r]`` for follower r) to every follower, then run locally."""
        with self._lock:
            if self._broken:
                raise GroupBroken(self._broken)
            try:
                self._check_alive()
                released = []
                while self._released:  # appended by ShardedSequence.__del__, possibly meanwhile
                    released.append(self._released.pop())
                if released:
                    header = {**header, "release": released}
                keep_ends = []
                while self._keep_ends:  # appended by ShardedSequence.keep_block_ends, possibly meanwhile
                    keep_ends.append(self._keep_ends.pop(0))
                if keep_ends:
                    header = {**header, "keep_ends": keep_ends}
                if self._sent_images is not None:
                    header = self._sent_images.with_drops(header, self.local.images)
                for r, sock in enumerate(self.links, start=1):
                    try:
                        send_message(sock, header, per_rank[r] if per_rank is not None else arrays)
                    except OSError as e:
                        raise GroupBroken(f"tensor-parallel rank {r} is gone ({e.__class__.__name__})") from None
                return local_call()
            except (InputError, ValueError):
                raise  # raised on every rank alike, before any collective: the group is still in step
            except Exception as e:
                self._fail(e)
                raise GroupBroken(self._broken) from e

    def _fail(self, e: BaseException) -> None:
        reason = str(e) or repr(e)
        for _ in range(20):  # a collective usually fails because a rank died: name it if so
            try:
                self._check_alive()
            except GroupBroken as dead:
                reason = f"{dead} ({reason})" if str(dead) not in reason else reason
                break
            time.sleep(0.05)
        self._broken = f"tensor-parallel group failed: {reason}"
        log.error("%s", self._broken)
        try:
            self._on_fault()
        except Exception:
            log.exception("stopping the tensor-parallel followers failed")

    # ---- the ModelRunner contract ---------------------------------------------------------

    def new_sequence(self) -> ShardedSequence:
        seq_id = self._next_id
        self._next_id += 1
        local = self._run({"op": "new", "seq": seq_id}, self.local.new_sequence)
        return ShardedSequence(self, seq_id, local)

    def prefill(self, seq: ShardedSequence, tokens: Sequence[int]) -> np.ndarray:
        toks = np.asarray(list(tokens), dtype=np.int64)
        header, arrays = {"op": "prefill", "seq": seq.seq_id}, {"tokens": toks}
        if self._sent_images is not None:  # rank 0 encodes; features the followers lack go with the chunk
            entries, features = self._sent_images.chunk(self.local.images, self.local.vision, toks)
            if entries:
                header["images"] = entries
                arrays.update(features)
        return self._run(header, lambda: self.local.prefill(seq.local, toks.tolist()), arrays)

    def attach_vision(self, encoder, store) -> None:
        """Serve images: the encoder runs unsplit on rank 0 (``hf2q.engine.vision.tp_images``)."""
        from hf2q.engine.vision.tp_images import SentImages

        self.local.attach_vision(encoder, store)
        self._sent_images = SentImages()

    @property
    def images(self):
        return self.local.images

    @property
    def vision(self):
        return self.local.vision

    def _set_shifts(self, seq: ShardedSequence, pairs) -> None:
        pairs = [(int(a), int(b)) for a, b in pairs]
        self._run({"op": "shifts", "seq": seq.seq_id, "pairs": pairs},
                  lambda: setattr(seq.local, "mrope_shifts", list(pairs)))

    def decode(self, seqs: Sequence[ShardedSequence], tokens: Sequence[int]) -> np.ndarray:
        toks = np.asarray(list(tokens), dtype=np.int64)
        ids = [s.seq_id for s in seqs]
        return self._run({"op": "decode", "seqs": ids},
                         lambda: self.local.decode([s.local for s in seqs], toks.tolist()), {"tokens": toks})

    def verify(self, seq: ShardedSequence, tokens: Sequence[int]) -> np.ndarray:
        """``MlxModelRunner.verify`` on every rank (speculative decoding); rank 0's rows."""
        toks = np.asarray(list(tokens), dtype=np.int64)
        return self._run({"op": "verify", "seq": seq.seq_id}, lambda: self.local.verify(seq.local, toks.tolist()),
                         {"tokens": toks})

    @property
    def rolls_back_drafts(self) -> bool:
        """Rank 0's answer (every rank holds the same model): whether a verify can be cut back anywhere."""
        return bool(self.local.rolls_back_drafts)

    def enable_mtp(self, draft_model=None) -> None:
        """Every rank loads its share of the MTP draft head (``--speculative mtp``), before any sequence;
        DeepSeek-V4's from the companion file ``draft_model`` (a path or ``GGUFFile``), which every rank opens."""
        path = None if draft_model is None else str(getattr(draft_model, "path", draft_model))
        self._run({"op": "enable_mtp", "draft": path},
                  lambda: loaded_on_every_rank(lambda: self.local.enable_mtp(draft_model), self.group, 0))
        self.kv_bytes_per_token = self.local.kv_bytes_per_token

    @property
    def drafts(self) -> bool:
        """Whether the model drafts for itself (its MTP head is enabled)."""
        return bool(self.local.drafts)

    def draft(self, seq: ShardedSequence, pending: int, k: int) -> list[int]:
        """The MTP head's draft, its steps run on every rank in step (their all-reduces); rank 0's tokens
        (every rank's are the same: the head's output is all-reduced, its LM head replicated)."""
        return self._run({"op": "draft", "seq": seq.seq_id, "pending": int(pending), "k": int(k)},
                         lambda: self.local.draft(seq.local, pending, k))

    def draft_logits(self, seq: ShardedSequence, pending: int, k: int) -> tuple[list[int], np.ndarray]:
        """:meth:`draft` with rank 0's float32 logits of the drafted positions."""
        return self._run({"op": "draft", "seq": seq.seq_id, "pending": int(pending), "k": int(k), "logits": True},
                         lambda: self.local.draft_logits(seq.local, pending, k))

    @property
    def pipelines_decode(self) -> bool:
        """Whether the runtime should queue steps ahead: rank 0's shard runs the MLX graph (it always
        does at N > 1, since the host decode step has no all-reduce) and the backend allows it
        (:func:`pipelines_over`). ``decode_async`` itself works either way."""
        return self._pipelined and bool(getattr(self.local, "pipelines_decode", False))

    def decode_async(self, seqs: Sequence[ShardedSequence], tokens, samplers) -> GroupPending:
        """``MlxModelRunner.decode_async`` across the group: rank 0 samples with ``samplers``, every
        rank feeds the broadcast ids to its next step. ``tokens`` is a list of ints or a recent
        :class:`GroupPending`, which the followers find by its step id (no host read on rank 0)."""
        if len(seqs) != len(samplers):
            raise ValueError("decode_async needs one sampler per sequence")
        step, self._step = self._step, self._step + 1
        header = {"op": "decode_async", "seqs": [s.seq_id for s in seqs], "step": step}
        arrays = None
        if isinstance(tokens, GroupPending) and tokens._runner is self and step - tokens.step < KEPT_STEPS:
            header["after"] = tokens.step
            tokens = tokens.inner
        else:  # ids from the host (or a step too old for the followers to hold)
            ints = tokens.result()[0] if hasattr(tokens, "result") else tokens
            tokens = [int(t) for t in ints]
            arrays = {"tokens": np.asarray(tokens, dtype=np.int64)}
        locals_ = [s.local for s in seqs]
        from hf2q.engine.runner import PendingTokens

        shared, logprobs = self._run(header, lambda: shared_step(self.local, locals_, tokens, samplers,
                                                                  self.group, lead=True), arrays)
        return GroupPending(PendingTokens(shared, logprobs), step, self)

    def _trim(self, seq: ShardedSequence, n_tokens: int) -> None:
        self._run({"op": "trim", "seq": seq.seq_id, "n": int(n_tokens)}, lambda: seq.local.trim(n_tokens))

    def embed(self, batch):
        raise InputError("tensor parallelism serves decoder (chat) models only; embeddings run on one rank")

    def export_kv(self, seq: ShardedSequence, start: int, end: int) -> dict[str, np.ndarray]:
        """Every rank exports its heads; one ``all_gather`` assembles the full KV in head order (and a
        hybrid block's end state from every rank's share, :func:`gather_state`)."""
        return self._run({"op": "export", "seq": seq.seq_id, "start": int(start), "end": int(end)},
                         lambda: gather_kv(self.local, seq.local, start, end, self.group, self.plans[0]))

    def import_kv(self, seq: ShardedSequence, arrays: dict[str, np.ndarray], n_tokens: int) -> None:
        """Each rank receives (and keeps) the KV heads it owns, and its share of a block's end state (the whole
        block where every rank holds the whole cache: DeepSeek-V4's)."""
        if _same_cache_on_every_rank(self.local):
            per_rank = {r: arrays for r in range(self.size)}
        else:
            heads = seq.local.kv_heads  # every rank's cache has as many heads (its own)
            per_rank = {r: {**head_slice(arrays, r, self.size, heads), **state_share(arrays, r, self.size)}
                        for r in range(self.size)}
        self._run({"op": "import", "seq": seq.seq_id, "n": int(n_tokens)},
                  lambda: self.local.import_kv(seq.local, per_rank[0], n_tokens), per_rank=per_rank)

    def _forget_ends(self, seq: ShardedSequence, keep) -> None:
        keep = sorted(int(n) for n in keep)
        self._run({"op": "forget_ends", "seq": seq.seq_id, "keep": keep},
                  lambda: seq.local.forget_block_ends(keep))

    def time_all_sum(self, shape: Sequence[int], reps: int) -> list[float]:
        """Seconds of each of ``reps`` float32 ``all_sum``s of ``shape`` across the group, timed on rank 0
        (the collective a row-parallel layer ends in, alone; for ``bench/tp_engine.py``)."""
        return self._run({"op": "allsum", "shape": [int(n) for n in shape], "reps": int(reps)},
                         lambda: all_sum_times(self.group, shape, reps))

    def close(self) -> None:
        """End the group cleanly (:meth:`ControlLinks.close`); idempotent, the runner is unusable afterwards."""
        self._control.close()


def _same_cache_on_every_rank(local) -> bool:
    """Whether every rank's sequence cache is the same whole one (DeepSeek-V4's compact cache): its blocks
    are then one rank's export, and every rank imports all of a block."""
    return bool(getattr(getattr(local, "model", None), "same_cache_on_every_rank", False))


#: end-state tensors whose rows are KV heads, like the K/V's: a window layer's last rows ``state.k.{i}`` /
#: ``state.v.{i}`` ``[kv_heads, rows, head_dim]`` (an 8-bit cache's codes and their ``.scales``)
HEAD_STATES = ("k", "v")


def _by_head(name: str) -> bool:
    return not name.startswith(END_STATE_PREFIX) or name[len(END_STATE_PREFIX):].split(".", 1)[0] in HEAD_STATES


def head_slice(arrays: dict[str, np.ndarray], rank: int, size: int, heads: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s ``heads`` cache heads out of gathered ``k.{i}`` / ``v.{i}`` (and window rows)
    ``[groups · heads, n, d]``: :func:`gather_kv` laid out each group of ranks that hold the same heads once,
    in rank order, so ``groups`` is ``size`` / the KV heads' replicas."""
    out = {}
    for k, v in arrays.items():
        if not _by_head(k):
            continue
        groups = len(v) // heads
        if len(v) % heads or not groups or size % groups:
            raise ValueError(f"KV block part {k!r} has {len(v)} heads, not a share of {heads} for each of "
                             f"{size} ranks")
        at = rank // (size // groups) * heads
        out[k] = np.ascontiguousarray(v[at:at + heads])
    return out


#: the axis of each end-state tensor (``state.{kind}.{layer}``) along which the ranks' shares lie side by
#: side: a conv window ``[K − 1, channels]`` by channel, a delta-rule state ``[value heads, …]`` by head; a
#: kind not named here (an MTP head's input row, after the all-reduces) is the same on every rank
STATE_SHARE_AXES = {"conv": 1, "ssm": 0}


def _share_axis(name: str) -> int | None:
    return STATE_SHARE_AXES.get(name[len(END_STATE_PREFIX):].split(".", 1)[0])


def state_share(arrays: dict[str, np.ndarray], rank: int, size: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s share of a block's end state (:func:`gather_state` laid the ranks' shares out in
    rank order, equal parts, so a block of a ``size``-rank group restores to one of the same split)."""
    out = {}
    for name, a in arrays.items():
        if not _by_head(name):
            axis = _share_axis(name)
            out[name] = a if axis is None else np.ascontiguousarray(np.split(a, size, axis=axis)[rank])
    return out


def gather_state(mine: dict[str, np.ndarray], group) -> dict[str, np.ndarray]:
    """Collective: every rank's share of a hybrid block's end state side by side, rank by rank; empty when
    some rank holds none at this block's end (the block then serves the chain only). The state of a rank is
    of its own heads (``tensor_parallel.DeltaNetPlan``), so the layout is that of this split: the persistent
    store keys a group's blocks by its size (``kv_identity``)."""
    import mlx.core as mx

    if not held_by_every_rank(mine, group):
        return {}
    names = sorted(mine)
    packed = np.concatenate([np.ascontiguousarray(mine[k]).reshape(-1).view(np.uint8) for k in names])
    full = np.array(mx.distributed.all_gather(mx.array(packed[None]), group=group))  # [ranks, bytes]
    out, at = {}, 0
    for k in names:
        a = mine[k]
        parts = [np.ascontiguousarray(row[at:at + a.nbytes]).view(a.dtype).reshape(a.shape) for row in full]
        axis = _share_axis(k)
        out[k] = parts[0] if axis is None else np.concatenate(parts, axis=axis)
        at += a.nbytes
    return out


def rank_flags(flag: bool, group) -> list[bool]:
    """Collective: every rank's ``flag``, in rank order."""
    import mlx.core as mx

    return [bool(f) for f in np.array(mx.distributed.all_gather(mx.array([int(flag)], dtype=mx.int32),
                                                                group=group)).reshape(-1)]


def held_by_every_rank(mine: dict, group) -> bool:
    """Collective: whether every rank holds an end state for this block (``mine`` not empty on each)."""
    return all(rank_flags(bool(mine), group))


def gather_kv(local, seq, start: int, end: int, group, plan) -> dict[str, np.ndarray]:
    """Collective: this rank's exported heads, all-gathered into full-model arrays (every rank gets them),
    with a sliding-window sequence's window rows at the block end (by head, when every rank holds them),
    and for a hybrid sequence the block's end state (:func:`gather_state`)."""
    import mlx.core as mx

    mine = local.export_kv(seq, start, end)
    if _same_cache_on_every_rank(local):  # each rank exported (and let go of) the same block: no collective
        return mine
    state = {k: mine.pop(k) for k in [k for k in mine if k.startswith(END_STATE_PREFIX)]}
    kind = getattr(seq, "persist_kind", "")  # every rank's sequence alike: the same collectives on each
    if kind == "window" and held_by_every_rank(state, group):
        mine.update(state)
    names = sorted(mine)
    if not names:  # a model of window layers only, at a block end whose rows are gone (on every rank)
        return {}
    # one collective whatever the arrays' widths and dtypes (an 8-bit cache's codes and scales, a window's
    # rows): each KV head's bytes of every array side by side
    packed = np.concatenate([np.ascontiguousarray(mine[k]).reshape(len(mine[k]), -1).view(np.uint8)
                             for k in names], axis=1)  # [kv_local, bytes]
    full = np.array(mx.distributed.all_gather(mx.array(packed), group=group))  # [ranks · kv_local, bytes]
    # the ranks that replicate a KV head appear once (a rank's heads stay together: a gemma4 cache head
    # is a piece of a KV head)
    full = full.reshape(-1, *packed.shape)[:: plan.kv_replicas].reshape(-1, packed.shape[1])
    out, at = {}, 0
    for k in names:
        a = mine[k]
        n = a[:1].nbytes
        out[k] = np.ascontiguousarray(full[:, at:at + n]).view(a.dtype).reshape(len(full), *a.shape[1:])
        at += n
    if kind and kind != "window":
        out.update(gather_state(state, group))
    return out


def loaded_on_every_rank(load: Callable[[], object], group, rank: int) -> None:
    """Collective: run this rank's ``load`` (the MTP head: a rank's own file may be missing or differ), then
    agree; if any rank failed, every rank raises one ``InputError`` naming the ranks, so rank 0 refuses at
    start-up instead of a follower without the head breaking the group at the first draft."""
    err: Exception | None = None
    try:
        load()
    except (InputError, ValueError) as e:
        err = e
    ok = rank_flags(err is None, group)
    if err is not None:
        if rank:  # rank 0 reports its own; a follower's reason is only in its log
            log.error("rank %d: the draft head did not load: %s", rank, err)
        raise err
    failed = [r for r, good in enumerate(ok) if not good]
    if failed:
        raise InputError(f"tensor-parallel rank {', '.join(map(str, failed))} could not load the draft head "
                         "(the rank's log says why)")


def all_sum_times(group, shape: Sequence[int], reps: int) -> list[float]:
    """Collective: ``reps`` timed ``all_sum``s of a float32 array of ``shape``, each evaluated alone."""
    import mlx.core as mx

    x = mx.ones(tuple(shape), dtype=mx.float32)
    mx.eval(x)
    for _ in range(3):  # untimed: the first collectives after an idle spell wake the peers up
        mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - t0)
    return times


# ---- followers ------------------------------------------------------------------------------

#: a follower's exit statuses (docs/TENSOR_PARALLEL.md): rank 0 ended the group / the group broke
FOLLOWER_STOPPED, FOLLOWER_BROKEN = 0, 1


def follow(runner, sock: socket.socket, group, plan, stopped: threading.Event | None = None) -> int:
    """Replay rank 0's calls on this rank's shard until rank 0 says stop or goes away; exit status.

    Only a ``stop`` command is a clean end (``stopped`` is set first, so the watcher threads that
    exit the process when rank 0 vanishes know it did not); a control connection that closes without
    one means rank 0 died or failed closed, and the follower reports the group broken."""
    from hf2q.engine.runner import PendingTokens
    from hf2q.engine.sampling.device import DeviceSampler
    from hf2q.sched.contracts import SamplingParams

    seqs: dict[int, object] = {}
    queued: dict[int, PendingTokens] = {}  # pipelined steps by id: the tokens a later step is fed
    greedy = DeviceSampler(SamplingParams(temperature=0.0))  # a follower's own pick only orders its collectives
    while True:
        msg = recv_message(sock)
        if msg is None:
            log.warning("rank %d: rank 0 closed the control connection without stopping the group; exiting",
                        plan.rank)
            return FOLLOWER_BROKEN
        header, arrays = msg
        if header["op"] == "stop":
            if stopped is not None:
                stopped.set()
            log.info("rank %d: rank 0 stopped the group; exiting", plan.rank)
            return FOLLOWER_STOPPED
        for seq_id in header.get("release", ()):
            seqs.pop(seq_id, None)
        for seq_id, block_tokens in header.get("keep_ends", ()):
            if seq_id in seqs:
                seqs[seq_id].keep_block_ends(block_tokens)
        op = header["op"]
        try:
            if op == "new":
                seqs[header["seq"]] = runner.new_sequence()
            elif op == "prefill":
                if "images" in header:
                    from hf2q.engine.vision.tp_images import take_images

                    take_images(runner, header["images"], arrays)
                runner.prefill(seqs[header["seq"]], arrays["tokens"].tolist())
            elif op == "shifts":
                from hf2q.engine.vision.tp_images import ensure_store

                ensure_store(runner)  # a shifted sequence decodes at explicit positions
                seqs[header["seq"]].mrope_shifts = [tuple(p) for p in header["pairs"]]
            elif op == "decode":
                runner.decode([seqs[i] for i in header["seqs"]], arrays["tokens"].tolist())
            elif op == "decode_async":
                step = header["step"]
                fed = queued[header["after"]] if "after" in header else arrays["tokens"].tolist()
                rows = [seqs[i] for i in header["seqs"]]
                shared, logprobs = shared_step(runner, rows, fed, [greedy] * len(rows), group, lead=False)
                queued[step] = PendingTokens(shared, logprobs)
                for old in [k for k in queued if k <= step - KEPT_STEPS]:
                    del queued[old]
            elif op == "verify":
                runner.verify(seqs[header["seq"]], arrays["tokens"].tolist())
            elif op == "enable_mtp":
                loaded_on_every_rank(lambda: runner.enable_mtp(header.get("draft")), group, plan.rank)
            elif op == "draft":
                (runner.draft_logits if header.get("logits") else runner.draft)(seqs[header["seq"]], header["pending"],
                                                                                 header["k"])
            elif op == "trim":
                seqs[header["seq"]].trim(header["n"])
            elif op == "export":
                gather_kv(runner, seqs[header["seq"]], header["start"], header["end"], group, plan)
            elif op == "import":
                runner.import_kv(seqs[header["seq"]], arrays, header["n"])
            elif op == "forget_ends":
                seqs[header["seq"]].forget_block_ends(header["keep"])
            elif op == "allsum":
                all_sum_times(group, header["shape"], header["reps"])
            else:
                raise RuntimeError(f"unknown tensor-parallel command {op!r}")
        except (InputError, ValueError) as e:  # rank 0 raised the same error before any collective
            log.debug("rank %d: %s rejected: %s", plan.rank, op, e)
        if "drop_images" in header:  # after the command: it may have read them
            from hf2q.engine.vision.tp_images import drop_images

            drop_images(runner, header["drop_images"])
