"""Who owns what in the actor system: the stop rule runs once per token, in the GPU owner; a
slot reaches neither admission nor its ledger; the KV prefix actor restores and persists.

Expected tokens come from the fake model's own rule (tests/fakes), not from the runtime."""

from __future__ import annotations

import attrs

from hf2q.actors.admission import Admission
from hf2q.sched.contracts import RuntimeConfig
from hf2q.actors.runtime import open_runtime
from hf2q.actors.slot import SlotEnv
from hf2q.actors.system import ActorSystem
from hf2q.kvstore import BLOCK_TOKENS, BlockStore
from hf2q.sched.budget import KvBudget
from hf2q.sched.contracts import Finished, GenerationRequest, SamplingParams
from hf2q.sched.decoding import DecodeLimits
from hf2q.sched.ledger import SlotLedger
from tests.fakes import FakeModelRunner
from tests.test_runtime import collect, greedy, terminal, tokens_of


async def test_the_stop_rule_runs_once_per_sampled_token(monkeypatch):
    calls = []
    real = DecodeLimits.after_token

    def counted(self, token, emitted, resident):
        calls.append((token, emitted))
        return real(self, token, emitted, resident)

    monkeypatch.setattr(DecodeLimits, "after_token", counted)
    fake = FakeModelRunner()
    prompt = [5, 6, 7]
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(GenerationRequest("a", tuple(prompt), SamplingParams(max_tokens=6))))
    expected = greedy(fake, prompt, 6)
    assert tokens_of(ev) == expected and terminal(ev).reason == "length"
    # one verdict per sampled token, with the emitted count it was sampled after: never twice
    assert calls == [(t, i) for i, t in enumerate(expected)]


async def test_a_stop_token_is_judged_once_and_not_sent(monkeypatch):
    calls = []
    real = DecodeLimits.after_token
    monkeypatch.setattr(DecodeLimits, "after_token",
                        lambda self, *a: calls.append(a) or real(self, *a))
    fake = FakeModelRunner(eos_at_length=6)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(GenerationRequest("a", (5, 6, 7), SamplingParams(max_tokens=50))))
    assert terminal(ev).reason == "stop"
    assert len(tokens_of(ev)) == 3  # 3 prompt + 3 generated, then end-of-sequence
    assert len(calls) == 4  # the three tokens sent and the end-of-sequence token, once each


def _reachable(root, depth: int = 4) -> list:
    """Objects reachable from ``root`` through the attributes of hf2q objects (bound methods
    count as the call they are, not as a way into their owner)."""
    seen, out, frontier = {id(root)}, [], [root]
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            if not type(obj).__module__.startswith("hf2q."):
                continue
            values = (vars(obj).values() if hasattr(obj, "__dict__")
                      else [getattr(obj, f.name) for f in attrs.fields(type(obj))] if attrs.has(type(obj)) else [])
            for v in values:
                for item in (v if isinstance(v, (list, tuple)) else [v]):
                    if id(item) not in seen:
                        seen.add(id(item))
                        out.append(item)
                        nxt.append(item)
        frontier = nxt
    return out


async def test_a_slot_never_reaches_admission_or_its_ledger():
    fake = FakeModelRunner()
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        await collect(await rt.submit(GenerationRequest("a", (5, 6, 7), SamplingParams(max_tokens=3))))
        system = rt._system  # noqa: SLF001 — the test looks inside on purpose
        for slot in system.slots:
            kinds = {type(o) for o in _reachable(slot)}
            assert not kinds & {Admission, ActorSystem, SlotLedger, KvBudget}, kinds
            assert not hasattr(slot, "system")
        assert {f.name for f in attrs.fields(SlotEnv)} == {"transact", "gpu_inbox", "kv_prefix", "released"}
        # the ledger learnt what the slot's KV holds from the slot's Released message
        assert system.admission.ledger.tokens(0) == system.slots[0].kv_tokens
        assert len(system.slots[0].kv_tokens) == 3 + 2  # the prompt and the two tokens fed back


async def test_the_kv_prefix_actor_restores_and_persists(tmp_path):
    prompt = tuple((i * 13) % 90 + 3 for i in range(BLOCK_TOKENS + 40))
    store = BlockStore.open(tmp_path, "fp", None)
    async with open_runtime(FakeModelRunner().factory(), RuntimeConfig(slots=1), kv_store=store) as rt:
        await rt.wait_ready()
        await collect(await rt.submit(GenerationRequest("a", prompt, SamplingParams(max_tokens=2))))
        assert await rt.drain(10)
        actor = rt._system.kv_prefix  # noqa: SLF001
        assert [h[1] for h in actor.fsm.history] == ["restore_requested", "restored",
                                                     "persist_requested", "exported"]
        assert actor.state == "idle" and actor.counters["kv_blocks_saved"] == 1
    fresh = FakeModelRunner()
    async with open_runtime(fresh.factory(), RuntimeConfig(slots=1), kv_store=store) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(GenerationRequest("b", prompt, SamplingParams(max_tokens=2))))
        assert ev[0].cached_tokens == BLOCK_TOKENS
        assert isinstance(terminal(ev), Finished) and tokens_of(ev) == greedy(fresh, list(prompt), 2)
        assert rt._system.kv_prefix.counters["kv_blocks_restored"] == 1  # noqa: SLF001
    store.close()


def test_only_the_gpu_owner_imports_the_engine_at_module_level():
    """Only code reached from the engine thread imports ``hf2q.engine``: in actors/, the GPU owner."""
    import ast
    from pathlib import Path

    import hf2q.actors

    found = {}
    for path in Path(hf2q.actors.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module]
        names += [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        if any(name == "hf2q.engine" or name.startswith("hf2q.engine.") for name in names):
            found[path.name] = True
    assert set(found) == {"gpu_owner.py"}


def test_the_contracts_module_is_a_leaf():
    """The API and the actors share ``hf2q.sched.contracts``; it imports neither (stdlib, attrs,
    numpy and ``hf2q.errors`` at most), so it can never close an import loop."""
    import ast
    import sys
    from pathlib import Path

    import hf2q.sched.contracts as contracts

    tree = ast.parse(Path(contracts.__file__).read_text(encoding="utf-8"))
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    allowed = {"attrs", "numpy", "hf2q.errors", "__future__"}
    assert {n for n in names if n.split(".")[0] not in sys.stdlib_module_names} <= allowed, names
