"""The operator's picture of the runtime, assembled from what each actor owns (cheap, never touches the engine).

Slots report their phase, progress and the KV they hold; admission its queue and budget;
the supervisor readiness; the counters are the union of each owner's.
"""

from __future__ import annotations

from hf2q.sched.contracts import RuntimeSnapshot, SlotSnapshot


def slot_snapshot(a) -> SlotSnapshot:
    p = a.progress
    active = a.state != "idle"
    rate = p.prefill_rate()
    remaining = max(p.new_tokens - p.prefilled_tokens, 0)
    return SlotSnapshot(
        slot=a.index, phase=a.state, request_id=p.request_id if active else None,
        cached_tokens=p.cached_tokens if active else 0, new_tokens=p.new_tokens if active else 0,
        prefilled_tokens=p.prefilled_tokens if active else 0,
        prefill_percent=(100.0 * p.prefilled_tokens / p.new_tokens) if active and p.new_tokens else 0.0,
        prefill_eta_s=(remaining / rate) if active and rate > 0 and remaining else None,
        generated_tokens=p.generated_tokens if active else 0,
        decode_tokens_per_sec=p.decode_rate() if active else 0.0,
        resident_tokens=a.resident_tokens)


def runtime_snapshot(supervisor, admission, slots, gpu, kv_prefix) -> RuntimeSnapshot:
    views = tuple(slot_snapshot(a) for a in slots)
    budget = admission.budget
    bpt = budget.bytes_per_token if budget else 0
    ready, detail = supervisor.readiness()
    counters = {**admission.counters, **gpu.counters, **kv_prefix.counters, "gpu_busy_s": gpu.busy_s}
    return RuntimeSnapshot(ready=ready, state=supervisor.state, detail=detail, slots=views,
                           queue_depth=len(admission.queue),
                           kv_bytes_resident=sum(s.resident_tokens for s in views) * bpt,
                           kv_budget_bytes=budget.budget_bytes if budget else 0,
                           ctx=admission.facts.ctx if admission.facts else 0, counters=counters)
