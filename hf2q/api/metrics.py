"""Prometheus metrics for ``GET /metrics`` (prometheus-client, one registry per app).

Two kinds: event counters the HTTP layer increments as requests finish (requests,
rejections by code, tokens, TTFT, decode speed, cancellations), and gauges read from the
runtime's ``snapshot()`` at scrape time (slots, queue, KV bytes, readiness, supervisor
state) so a scrape never waits on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_STATES = ("starting", "ready", "draining", "stopped", "poisoned")


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], object | None], disk_bytes: Callable[[], int],
                 readiness: Callable[[], bool]):
        self._snapshot = snapshot
        self._disk_bytes = disk_bytes
        self._readiness = readiness
        self.engine_gauges = True

    def collect(self):
        snap = self._snapshot()
        ready = GaugeMetricFamily("hf2q_ready", "1 when generation requests are admitted")
        state = GaugeMetricFamily("hf2q_engine_state", "engine supervisor state (1 = current)", labels=["state"])
        active = GaugeMetricFamily("hf2q_slots_active", "slots serving a request")
        total = GaugeMetricFamily("hf2q_slots_total", "configured slots")
        queued = GaugeMetricFamily("hf2q_requests_queued", "requests waiting for a slot")
        kv = GaugeMetricFamily("hf2q_kv_bytes_resident", "KV cache bytes held by slots")
        budget = GaugeMetricFamily("hf2q_kv_budget_bytes", "shared KV budget")
        disk = GaugeMetricFamily("hf2q_kv_bytes_on_disk", "persistent prefix KV store bytes")
        ratio = GaugeMetricFamily("hf2q_cached_token_ratio", "cached prompt tokens / prompt tokens, since start")
        phases = GaugeMetricFamily("hf2q_slot_phase", "slots per phase", labels=["phase"])
        steps = CounterMetricFamily("hf2q_gpu_steps", "GPU steps run (each: one batched decode and/or one prefill)")
        gpu_busy = CounterMetricFamily("hf2q_gpu_busy_seconds",
                                       "seconds the engine thread spent running GPU transactions (/ wall time = utilisation)")
        batches = CounterMetricFamily("hf2q_decode_batches", "GPU steps that ran a batched decode")
        batch_tokens = CounterMetricFamily("hf2q_decode_batch_tokens",
                                           "decode rows over all batched decodes (/ batches = mean batch size)")
        drafted = CounterMetricFamily("hf2q_drafted_tokens", "speculative draft tokens verified (--speculative)")
        accepted = CounterMetricFamily("hf2q_accepted_draft_tokens", "speculative draft tokens accepted")
        ready.add_metric([], 1 if self._readiness() else 0)
        if snap is None and not self.engine_gauges:  # several models: their gauges are per model
            yield ready
            return
        if snap is None:
            state.add_metric(["starting"], 1)
        else:
            for s in ENGINE_STATES if snap.state in ENGINE_STATES else (*ENGINE_STATES, snap.state):
                state.add_metric([s], 1 if s == snap.state else 0)
            busy = [s for s in snap.slots if s.phase not in ("idle",)]
            active.add_metric([], len(busy))
            total.add_metric([], len(snap.slots))
            queued.add_metric([], snap.queue_depth)
            kv.add_metric([], snap.kv_bytes_resident)
            budget.add_metric([], snap.kv_budget_bytes)
            counts: dict[str, int] = {}
            for s in snap.slots:
                counts[s.phase] = counts.get(s.phase, 0) + 1
            for phase, n in sorted(counts.items()):
                phases.add_metric([phase], n)
            c = snap.counters
            ratio.add_metric([], (c.get("cached_tokens", 0) / c["prompt_tokens"]) if c.get("prompt_tokens") else 0.0)
            steps.add_metric([], c.get("gpu_steps", 0))
            gpu_busy.add_metric([], c.get("gpu_busy_s", 0.0))
            batches.add_metric([], c.get("decode_batches", 0))
            batch_tokens.add_metric([], c.get("decode_batch_tokens", 0))
            drafted.add_metric([], c.get("drafted_tokens", 0))
            accepted.add_metric([], c.get("accepted_draft_tokens", 0))
        disk.add_metric([], self._disk_bytes())
        yield from (ready, state, active, total, queued, kv, budget, disk, ratio, phases)
        if snap is not None:
            yield from (steps, gpu_busy, batches, batch_tokens, drafted, accepted)


class ModelRegistryCollector:
    """A several-model server's registry at scrape time: each model's residency state, its
    loads and evictions, its active requests, and the model memory in use against the budget."""

    def __init__(self, registry):
        self._registry = registry

    def describe(self):
        return []

    def collect(self):
        from hf2q.statemachines.model_residency import ResidencyState

        reg = self._registry
        state = GaugeMetricFamily("hf2q_model_state", "residency state of each model (1 = current)",
                                  labels=["model", "state"])
        active = GaugeMetricFamily("hf2q_model_active_requests", "requests using (or waiting for) each model",
                                   labels=["model"])
        loads = CounterMetricFamily("hf2q_model_loads", "times each model finished loading", labels=["model"])
        evictions = CounterMetricFamily("hf2q_model_evictions",
                                        "times each model was evicted to make room for another", labels=["model"])
        for entry in reg.entries.values():
            for s in ResidencyState:
                state.add_metric([entry.model_id, s.name], 1 if entry.state == s.name else 0)
            active.add_metric([entry.model_id], entry.active)
            loads.add_metric([entry.model_id], entry.loads)
            evictions.add_metric([entry.model_id], entry.evictions)
        resident = GaugeMetricFamily("hf2q_models_memory_resident_bytes",
                                     "model memory (weights + KV budget) of the loading, ready and draining models")
        resident.add_metric([], reg.resident_bytes)
        budget = GaugeMetricFamily("hf2q_models_memory_budget_bytes", "--models-memory")
        budget.add_metric([], reg.budget_bytes)
        yield from (state, active, loads, evictions, resident, budget)


class LazyKVStoreCollector:
    """``hf2q.kvstore.metrics.KVStoreCollector`` over whichever store ``get_store()`` returns at
    scrape time: with ``--kv-persist`` the runtime opens the store only once the engine has
    loaded (its fingerprint includes the engine's ``kv_identity``)."""

    def __init__(self, get_store: Callable[[], object | None]):
        self._get_store = get_store

    def describe(self):
        return []  # collected lazily; nothing to pre-declare

    def collect(self):
        store = self._get_store()
        if store is None:
            return
        from hf2q.kvstore.metrics import KVStoreCollector

        yield from KVStoreCollector(store).collect()


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], object | None], disk_bytes: Callable[[], int] = lambda: 0,
                 readiness: Callable[[], bool] = lambda: False):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("hf2q_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.rejections = Counter("hf2q_rejections", "requests refused, by error code", ["code"], registry=r)
        self.prompt_tokens = Counter("hf2q_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("hf2q_cached_prompt_tokens", "prompt tokens reused from a slot or disk",
                                     registry=r)
        self.completion_tokens = Counter("hf2q_completion_tokens", "generated tokens", registry=r)
        self.cancellations = Counter("hf2q_cancellations", "requests ended early: by the client, a stop string or the reply's tool calls",
                                     ["why"], registry=r)
        self.ttft = Histogram("hf2q_time_to_first_token_seconds", "arrival → first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.decode_rate = Histogram("hf2q_decode_tokens_per_second", "per-request decode speed", registry=r,
                                     buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
        self.snapshots = _SnapshotCollector(snapshot, disk_bytes, readiness)
        r.register(self.snapshots)

    def render(self) -> bytes:
        return generate_latest(self.registry)
