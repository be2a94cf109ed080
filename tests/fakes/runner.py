"""A fake ``ModelRunner`` (hf2q/engine/protocol.py) for runtime and API tests.

Deterministic: the logits for the next position depend only on the token history of the
sequence (prompt + everything fed so far), so the same history always yields the same
greedy token — whether it was prefilled in one chunk, many chunks, reused from a slot, or
imported from an export. ``expected_next_token`` is that rule written independently of the
runner so tests can predict outputs.

Knobs: per-call latency (``step_latency_s``, ``prefill_latency_per_token_s``), an
end-of-sequence after a given sequence length (``eos_at_length``), and injected faults
and hangs (``inject_fault``, ``inject_hang``) on the N-th prefill/decode call. It records
every call (kind, sizes, calling thread) so tests can assert batching and threading, and
the wall-clock span of every prefill/decode (``spans``) so a benchmark can see how long the
engine sat idle between steps — the serving path's own per-step overhead.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np


def expected_next_token(history: Sequence[int], vocab_size: int, eos_token_id: int,
                        eos_at_length: int | None = None) -> int:
    """The fake model's greedy next token after ``history`` (independent reference)."""
    if eos_at_length is not None and len(history) >= eos_at_length:
        return eos_token_id
    tail = list(history[-3:])
    t = (31 * sum(tail) + 7 * len(history) + 3) % vocab_size
    if t == eos_token_id:
        t = (t + 1) % vocab_size
    return t


class FakeSequence:
    def __init__(self, bytes_per_token: int):
        self.tokens: list[int] = []
        self.serial = 0
        self._bpt = bytes_per_token

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return len(self.tokens) * self._bpt

    def reuse_points(self) -> None:
        """Like a plain K/V cache: it can be cut back to any length (None)."""
        return None

    def trim(self, n_tokens: int) -> None:
        if n_tokens < 0 or n_tokens > len(self.tokens):
            raise ValueError(f"cannot trim a {len(self.tokens)}-token sequence to {n_tokens}")
        del self.tokens[n_tokens:]


class InjectedFault(RuntimeError):
    """Raised by the fake runner on purpose (a simulated device error)."""


class FakeModelRunner:
    def __init__(self, *, vocab_size: int = 97, n_ctx_train: int = 4096, kv_bytes_per_token: int = 64,
                 eos_token_id: int = 2, eos_at_length: int | None = None, step_latency_s: float = 0.0,
                 prefill_latency_per_token_s: float = 0.0, is_embedding_model: bool = False,
                 embedding_dim: int = 8, kv_identity: str = "fake-cpu-float32", next_token=None):
        self.vocab_size = vocab_size
        self.n_ctx_train = n_ctx_train
        self.kv_bytes_per_token = kv_bytes_per_token
        self.eos_token_id = eos_token_id
        self.eos_token_ids = frozenset({eos_token_id})
        self.eos_at_length = eos_at_length
        self.step_latency_s = step_latency_s
        self.prefill_latency_per_token_s = prefill_latency_per_token_s
        self.is_embedding_model = is_embedding_model
        self.embedding_dim = embedding_dim
        self.kv_identity = kv_identity  # what the persistent KV store keys blocks by, besides the model
        self.next_token = next_token  # history → the model's greedy token, instead of expected_next_token
        self.calls: list[tuple[str, int]] = []  # ("prefill", n_tokens) | ("decode", batch) | ...
        self.spans: list[tuple[str, float, float]] = []  # (kind, perf_counter at entry, at return)
        self.prefill_log: list[tuple[int, int]] = []  # (sequence serial, n_tokens) per prefill call
        self._serial = 0
        self.threads: set[int] = set()
        self.created_in_thread: int | None = None
        self._lock = threading.Lock()
        self._fault: tuple[str, int] | None = None
        self._hang: tuple[str, int] | None = None
        self.hang_release = threading.Event()
        self.hanging = threading.Event()

    # ---- construction from the GPU-owner thread ---------------------------------------

    def factory(self):
        """A ``runner_factory`` that returns this runner and records the thread it ran in."""
        def build():
            self.created_in_thread = threading.get_ident()
            return self
        return build

    # ---- fault injection --------------------------------------------------------------

    def inject_fault(self, kind: str = "decode", nth: int = 1) -> None:
        """Raise ``InjectedFault`` on the ``nth`` future call of ``kind`` (prefill|decode|embed|any)."""
        self._fault = (kind, self._count(kind) + nth)

    def inject_hang(self, kind: str = "decode", nth: int = 1) -> None:
        """Block (until ``hang_release`` is set) on the ``nth`` future call of ``kind``."""
        self._hang = (kind, self._count(kind) + nth)

    def _count(self, kind: str) -> int:
        return sum(1 for k, _ in self.calls if kind == "any" or k == kind)

    def _enter(self, kind: str, size: int) -> None:
        with self._lock:
            self.calls.append((kind, size))
            self.threads.add(threading.get_ident())
            n_kind, n_any = self._count(kind), self._count("any")
        for target, handler in ((self._hang, self._do_hang), (self._fault, self._do_fault)):
            if target is not None and (target[0] == kind and target[1] == n_kind
                                       or target[0] == "any" and target[1] == n_any):
                handler(kind)

    def _do_hang(self, kind: str) -> None:
        self.hanging.set()
        self.hang_release.wait(timeout=60)

    def _do_fault(self, kind: str) -> None:
        raise InjectedFault(f"injected fault in {kind}")

    @property
    def decode_batch_sizes(self) -> list[int]:
        return [n for k, n in self.calls if k == "decode"]

    @property
    def prefill_sizes(self) -> list[int]:
        return [n for k, n in self.calls if k == "prefill"]

    # ---- the ModelRunner protocol -------------------------------------------------------

    def new_sequence(self) -> FakeSequence:
        seq = FakeSequence(self.kv_bytes_per_token)
        self._serial += 1
        seq.serial = self._serial
        return seq

    def _logits(self, history: Sequence[int]) -> np.ndarray:
        target = (self.next_token(history) if self.next_token is not None else
                  expected_next_token(history, self.vocab_size, self.eos_token_id, self.eos_at_length))
        logits = np.full(self.vocab_size, -4.0, dtype=np.float32)
        logits[(target + 1) % self.vocab_size] = 2.0
        logits[target] = 6.0
        return logits

    def prefill(self, seq: FakeSequence, tokens: Sequence[int]) -> np.ndarray:
        if not tokens:
            raise ValueError("prefill needs at least one token")
        t0 = time.perf_counter()
        self._enter("prefill", len(tokens))
        self.prefill_log.append((getattr(seq, "serial", 0), len(tokens)))
        time.sleep(self.step_latency_s + self.prefill_latency_per_token_s * len(tokens))
        if seq.length + len(tokens) > self.n_ctx_train * 4:
            raise ValueError("sequence too long for the fake model")
        seq.tokens.extend(int(t) for t in tokens)
        out = self._logits(seq.tokens)
        self.spans.append(("prefill", t0, time.perf_counter()))
        return out

    def decode(self, seqs: Sequence[FakeSequence], tokens: Sequence[int]) -> np.ndarray:
        if len(seqs) != len(tokens) or not seqs:
            raise ValueError("decode needs one token per sequence")
        t0 = time.perf_counter()
        self._enter("decode", len(seqs))
        time.sleep(self.step_latency_s)
        out = np.empty((len(seqs), self.vocab_size), dtype=np.float32)
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            seq.tokens.append(int(tok))
            out[i] = self._logits(seq.tokens)
        self.spans.append(("decode", t0, time.perf_counter()))
        return out

    def verify(self, seq: FakeSequence, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` and return the logits after each of them (speculative decoding)."""
        if not tokens:
            raise ValueError("verify needs at least one token")
        self._enter("verify", len(tokens))
        time.sleep(self.step_latency_s)
        rows = []
        for tok in tokens:
            seq.tokens.append(int(tok))
            rows.append(self._logits(seq.tokens))
        return np.stack(rows)

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        self._enter("embed", len(batch))
        time.sleep(self.step_latency_s)
        out = np.zeros((len(batch), self.embedding_dim), dtype=np.float32)
        for toks in batch:  # as the real runner, an id outside the vocabulary is an engine fault
            if any(not 0 <= t < self.vocab_size for t in toks):
                raise IndexError("token id outside the embedding table")
        for i, toks in enumerate(batch):
            for j, t in enumerate(toks):
                out[i, (t + j) % self.embedding_dim] += 1.0 + (t % 5)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def export_kv(self, seq: FakeSequence, start: int, end: int) -> dict[str, np.ndarray]:
        self._enter("export_kv", end - start)
        if not 0 <= start <= end <= seq.length:
            raise ValueError(f"export [{start}, {end}) outside a {seq.length}-token sequence")
        return {"tokens": np.asarray(seq.tokens[start:end], dtype=np.int64)}

    def import_kv(self, seq: FakeSequence, arrays: dict[str, np.ndarray], n_tokens: int) -> None:
        self._enter("import_kv", n_tokens)
        toks = arrays["tokens"]
        if not 0 < n_tokens <= len(toks):
            raise ValueError(f"cannot import {n_tokens} positions from a {len(toks)}-position export")
        toks = toks[:n_tokens]  # the last block of a restore may be used partially
        seq.tokens.extend(int(t) for t in toks)
