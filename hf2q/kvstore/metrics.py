"""Prometheus view of a ``BlockStore``: register ``KVStoreCollector(store)`` on the server's registry.

Read at scrape time from ``store.stats()`` and ``store.recovery`` (both cheap, lock-guarded
copies), so the store never pushes metrics and never imports the HTTP layer.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_COUNTERS = (
    ("hits", "hf2q_kv_persist_block_hits", "prompt blocks found on disk"),
    ("misses", "hf2q_kv_persist_lookup_misses", "prefix lookups that stopped before the prompt's last full block"),
    ("skipped", "hf2q_kv_persist_blocks_skipped", "blocks the writer queue refused because it was full"),
    ("not_written", "hf2q_kv_persist_blocks_not_written",
     "blocks of finished requests never written: their KV was overwritten first, or the server stopped"),
    ("errors", "hf2q_kv_persist_errors", "I/O errors and blocks failing verification"),
    ("quarantined", "hf2q_kv_persist_blocks_quarantined", "bad blocks moved to quarantine/"),
    ("written", "hf2q_kv_persist_blocks_written", "blocks made durable"),
    ("evicted", "hf2q_kv_persist_blocks_evicted", "blocks removed to stay under the disk budget"),
)


class KVStoreCollector:
    def __init__(self, store):
        self.store = store

    def describe(self):
        return []  # collected lazily; nothing to pre-declare

    def collect(self):
        s = self.store.stats()
        disk = GaugeMetricFamily("hf2q_kv_persist_bytes_on_disk", "persistent prefix KV store bytes")
        disk.add_metric([], s.bytes_on_disk)
        blocks = GaugeMetricFamily("hf2q_kv_persist_blocks", "blocks in the persistent prefix KV store")
        blocks.add_metric([], s.blocks)
        pending = GaugeMetricFamily("hf2q_kv_persist_blocks_pending",
                                    "blocks of finished requests not on disk yet (queued or deferred)")
        pending.add_metric([], s.pending)
        yield disk
        yield blocks
        yield pending
        if s.budget_bytes is not None:
            budget = GaugeMetricFamily("hf2q_kv_persist_budget_bytes", "disk budget of the KV store")
            budget.add_metric([], s.budget_bytes)
            yield budget
        for field, name, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], getattr(s, field))
            yield c
        rec = GaugeMetricFamily("hf2q_kv_persist_recovery", "start-up recovery report", labels=["field"])
        for key, value in self.store.recovery.as_dict().items():
            rec.add_metric([key], float(value))
        yield rec
