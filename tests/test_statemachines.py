"""Every declared machine: each legal transition works, illegal ones raise, exports stay current."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET

import pytest

from hf2q.errors import InputError
from hf2q.statemachines import export
from hf2q.statemachines.base import IllegalTransition, Lifecycle
from hf2q.statemachines.registry import all_machines

MACHINES = all_machines()
OURS = ["supervisor", "admission", "slot", "prefill_transaction", "gpu_owner", "kv_prefix"]


def _reach(spec, target: str) -> list[str]:
    """Triggers that drive a fresh machine from its initial state to ``target`` (BFS)."""
    from collections import deque

    start = spec.initial.name
    paths = {start: []}
    queue = deque([start])
    while queue:
        s = queue.popleft()
        for r in spec.rows:
            if "*" in r.sources or s in r.sources:
                if r.dest not in paths:
                    paths[r.dest] = paths[s] + [r.trigger]
                    queue.append(r.dest)
    return paths[target]


def _at(spec, state: str) -> Lifecycle:
    m = Lifecycle(spec)
    for trig in _reach(spec, state):
        m.fire(trig)
    assert m.state == state
    return m


def test_registry_lists_our_machines():
    assert set(OURS) <= set(MACHINES)


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_state_reachable_and_every_legal_transition_works(name):
    spec = MACHINES[name]
    for state in spec.state_names:
        _reach(spec, state)  # KeyError = an unreachable state
    n = 0
    for r in spec.rows:
        sources = spec.state_names if r.sources == ("*",) else r.sources
        for src in sources:
            m = _at(spec, src)
            m.fire(r.trigger)
            assert m.state == r.dest, (name, src, r.trigger)
            n += 1
    assert n >= len(spec.rows)


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_illegal_transitions_raise(name):
    spec = MACHINES[name]
    triggers = {r.trigger for r in spec.rows}
    checked = 0
    for state in spec.state_names:
        illegal = sorted(triggers - spec.legal(state))
        for trig in illegal[:3]:
            m = _at(spec, state)
            with pytest.raises(IllegalTransition):
                m.fire(trig)
            assert m.state == state  # an illegal trigger changes nothing
            checked += 1
    assert checked > 0
    with pytest.raises(IllegalTransition):
        Lifecycle(spec).fire("no_such_trigger")


def test_specific_lifecycles():
    slot = MACHINES["slot"]
    m = Lifecycle(slot)
    for t in ("assigned", "prefill_started", "chunk_prefilled", "prefilled", "stop_reached",
              "released"):
        m.fire(t)
    assert m.state == "idle"
    assert [h[1] for h in m.history][-1] == "released"
    # a finished slot cannot be released twice, an idle slot cannot be cancelled
    with pytest.raises(IllegalTransition):
        m.fire("released")
    with pytest.raises(IllegalTransition):
        m.fire("client_gone")
    # poisoning is one way: nothing leaves `poisoned`
    sup = MACHINES["supervisor"]
    assert sup.legal("poisoned") == set()
    assert MACHINES["gpu_owner"].legal("faulted") == set()


def test_docs_statemachines_md_is_current():
    assert export.DOCS_PATH.read_text() == export.markdown(), (
        "docs/STATEMACHINES.md is stale: run python -m hf2q.statemachines.export --write-docs")


def test_mermaid_text_lists_every_transition():
    spec = MACHINES["slot"]
    text = spec.to_mermaid()
    assert text.startswith("stateDiagram-v2")
    for r in spec.rows:
        for s in r.sources:
            assert f"{s} --> {r.dest}: {r.trigger}" in text


def _args(**kw):
    return argparse.Namespace(**{"format": "mermaid", "output": None, "machine": None, **kw})


def test_diagrams_command_writes_all_formats(tmp_path, capsys):
    for fmt, ext in (("mermaid", "mmd"), ("dot", "dot"), ("svg", "svg")):
        assert export.run(_args(format=fmt, output=str(tmp_path / fmt))) == 0
        files = sorted(p.stem for p in (tmp_path / fmt).iterdir())
        assert files == sorted(MACHINES)
        assert all(p.suffix == f".{ext}" for p in (tmp_path / fmt).iterdir())
    # SVG is well-formed XML (parsed by the standard library) and names every state
    spec = MACHINES["supervisor"]
    root = ET.parse(tmp_path / "svg" / "supervisor.svg").getroot()
    assert root.tag.endswith("svg")
    texts = {"".join(t.itertext()) for t in root.iter() if t.tag.endswith("text")}
    assert set(spec.state_names) <= texts
    assert {r.trigger for r in spec.rows} <= texts
    dot = (tmp_path / "dot" / "slot.dot").read_text()
    assert dot.startswith('digraph "slot"') and '"idle" -> "admitted" [label="assigned"];' in dot


def test_diagrams_single_machine_and_unknown_name(capsys):
    assert export.run(_args(machine="supervisor")) == 0
    out = capsys.readouterr().out
    assert "starting --> ready: engine_loaded" in out and "idle --> admitted" not in out
    with pytest.raises(InputError, match="did you mean slot"):
        export.run(_args(machine="slto"))


def test_cli_diagrams_exit_codes(capsys):
    from hf2q.cli import main

    assert main(["diagrams", "--machine", "slot"]) == 0
    assert "idle --> admitted: assigned" in capsys.readouterr().out
    assert main(["diagrams", "--machine", "nope"]) == 3
    assert "hf2q: error: unknown state machine" in capsys.readouterr().err
