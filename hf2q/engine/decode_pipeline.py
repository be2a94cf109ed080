"""Keeps the next batched decode step queued on the device while the current one is read.

Runs inside the engine thread only (it calls the runner). On a GPU, a blocking decode step
costs graph construction + kernels + a sync; with the runner's ``decode_async`` the step
after the current one is built and queued *before* the current tokens are read, so Python
graph construction overlaps the kernels (H200, Qwen3-8B Q8_0: ~120 → ~200 tok/s).

The queued step is a speculation: it feeds every row the token just sampled, assuming the
same requests decode again next step. The GPU owner's next step uses it only when that
holds — same sequences, in the same order, fed the same tokens. Anything else (a request
ended or joined, a prefill or another job touching the caches) first calls :meth:`settle`,
which drops the speculation and trims the one extra position it wrote into each cache, so
every cache again holds exactly the tokens its slot fed.

Used only when the runner decodes through the MLX graph (``pipelines_decode``) and every
row's sampling runs on the device (``hf2q.engine.sampling.device_capable``); otherwise the owner
keeps its synchronous host-sampled step.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from hf2q.engine.sampling.rows import Sampled


class DecodePipeline:
    def __init__(self) -> None:
        self._ahead: Any = None  # PendingTokens of the queued step
        self._seqs: list = []  # the sequences it advanced, in batch order
        self._inputs: list[int] | None = None  # the tokens it was fed (known once the previous step is read)
        self._samplers: dict[int, Any] = {}  # id(run) → DeviceSampler (its RNG key lives across steps)
        self.stats = {"steps": 0, "hits": 0, "settled": 0}

    @staticmethod
    def usable(runner, runs: Sequence[Any]) -> bool:
        if not getattr(runner, "pipelines_decode", False):
            return False
        from hf2q.engine.sampling import device_capable

        return all(r.constraint is None and device_capable(r.sampler.params) for r in runs)

    def settled(self, job: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``job`` run after :meth:`settle`: a job other than a step sees caches holding only fed tokens."""
        def settled_job(runner):
            self.settle()
            return job(runner)
        return settled_job

    def holds(self, seq) -> bool:
        """Whether the queued step wrote a speculative position into ``seq``."""
        return self._ahead is not None and any(s is seq for s in self._seqs)

    def settle(self) -> None:
        """Drop the queued step (if any): its caches lose the position it wrote."""
        if self._ahead is None:
            return
        for s in self._seqs:
            s.trim(s.length - 1)
        self._ahead, self._seqs, self._inputs = None, [], None
        self.stats["settled"] += 1

    def step(self, runner, runs: Sequence[Any], tokens: Sequence[int]) -> list[Sampled]:
        """Decode ``runs`` fed ``tokens``; returns one ``Sampled`` per run, queues the step after."""
        from hf2q.engine.sampling.device import DeviceSampler

        seqs = [r.seq for r in runs]
        self.stats["steps"] += 1
        live = {id(r) for r in runs}
        for key in [k for k in self._samplers if k not in live]:
            del self._samplers[key]
        samplers = [self._samplers.setdefault(id(r), DeviceSampler(r.sampler.params)) for r in runs]
        if (self._ahead is not None and len(seqs) == len(self._seqs)
                and all(a is b for a, b in zip(seqs, self._seqs)) and self._inputs == list(tokens)):
            current = self._ahead
            self.stats["hits"] += 1
        else:
            self.settle()
            current = runner.decode_async(seqs, list(tokens), samplers)
        if all(s.length < runner.n_ctx for s in seqs):  # speculation: the same rows go on
            self._ahead, self._seqs = runner.decode_async(seqs, current, samplers), seqs
        else:
            self._ahead, self._seqs = None, []
        ids, logprobs = current.result()
        self._inputs = [int(t) for t in ids]
        return [Sampled(int(t), float(lp), ()) for t, lp in zip(ids, logprobs)]
