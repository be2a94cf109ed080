"""Declaring actor lifecycles as data and driving them with ``transitions``.

A machine is a ``MachineSpec``: an Enum of states, an initial state, and a table of
``(trigger, sources, dest)`` rows. ``spec.attach(model)`` binds a sync
``transitions.Machine`` to an attrs model (``slots=False``, not frozen) — the sync machine
is a pure table that trio tasks drive; ``AsyncMachine`` is asyncio-only.
Triggers are past-tense events. Any trigger not valid in the current state raises
``IllegalTransition``: an illegal transition is a bug, never silently ignored.
"""

from __future__ import annotations

import enum
from typing import Iterable

import attrs
from transitions import Machine, MachineError


class IllegalTransition(MachineError):
    """A trigger fired in a state that has no such transition."""


def _names(states) -> tuple[str, ...]:
    if isinstance(states, (str, enum.Enum)):
        states = (states,)
    return tuple(s.name if isinstance(s, enum.Enum) else s for s in states)


@attrs.frozen
class Row:
    trigger: str
    sources: tuple[str, ...]  # state names, or ("*",) for any
    dest: str


@attrs.frozen
class MachineSpec:
    name: str
    states: type[enum.Enum]
    initial: enum.Enum
    rows: tuple[Row, ...]
    description: str = ""

    @classmethod
    def declare(cls, name: str, states: type[enum.Enum], initial: enum.Enum,
                table: Iterable[tuple[str, object, enum.Enum | str]], description: str = "") -> "MachineSpec":
        rows = []
        for trigger, sources, dest in table:
            src = ("*",) if sources == "*" else _names(sources)
            rows.append(Row(trigger, src, _names(dest)[0]))
        spec = cls(name, states, initial, tuple(rows), description)
        spec.validate()
        return spec

    def validate(self) -> None:
        names = {s.name for s in self.states}
        for r in self.rows:
            for s in (*r.sources, r.dest):
                if s != "*" and s not in names:
                    raise ValueError(f"{self.name}: unknown state {s!r} in row {r}")

    @property
    def state_names(self) -> list[str]:
        return [s.name for s in self.states]

    def legal(self, state: str) -> set[str]:
        """Triggers allowed in ``state``."""
        return {r.trigger for r in self.rows if "*" in r.sources or state in r.sources}

    def attach(self, model, *, after_state_change=None) -> Machine:
        """Bind a sync ``transitions.Machine`` to ``model``; its ``state`` attribute holds the state name."""
        machine = Machine(
            model=model,
            states=self.state_names,
            initial=self.initial.name,
            transitions=[{"trigger": r.trigger, "source": list(r.sources) if r.sources != ("*",) else "*",
                          "dest": r.dest} for r in self.rows],
            auto_transitions=False,
            ignore_invalid_triggers=False,
            queued=True,
            send_event=False,
            after_state_change=after_state_change,
            model_attribute="state",
        )
        return machine

    # ---- export (pure text; used by `hf2q diagrams` and docs/) -------------------------

    def to_mermaid(self) -> str:
        lines = ["stateDiagram-v2", f"    [*] --> {self.initial.name}"]
        for r in self.rows:
            srcs = self.state_names if r.sources == ("*",) else r.sources
            for s in srcs:
                if s == r.dest and r.sources == ("*",):
                    continue
                lines.append(f"    {s} --> {r.dest}: {r.trigger}")
        return "\n".join(lines) + "\n"

    def to_dot(self) -> str:
        lines = [f'digraph "{self.name}" {{', "    rankdir=LR;", '    node [shape=box, style=rounded];',
                 '    "__start" [shape=point];', f'    "__start" -> "{self.initial.name}";']
        for r in self.rows:
            srcs = self.state_names if r.sources == ("*",) else r.sources
            for s in srcs:
                if s == r.dest and r.sources == ("*",):
                    continue
                lines.append(f'    "{s}" -> "{r.dest}" [label="{r.trigger}"];')
        lines.append("}")
        return "\n".join(lines) + "\n"


def fire(model, trigger: str) -> None:
    """Fire ``trigger`` on ``model``, turning transitions' errors into ``IllegalTransition``."""
    try:
        getattr(model, trigger)()
    except AttributeError:
        raise IllegalTransition(f"{type(model).__name__}: no trigger {trigger!r}") from None
    except MachineError as e:
        if isinstance(e, IllegalTransition):
            raise
        raise IllegalTransition(f"{type(model).__name__}: {trigger!r} is illegal in state "
                                f"{getattr(model, 'state', '?')!r}") from None


class Lifecycle:
    """The model object of one machine instance: an actor holds one (``self.fsm``).

    Keeping the machine on its own object means trigger names (which ``transitions``
    installs as methods) can never collide with an actor's own methods. ``history``
    keeps the last transitions as ``(source, trigger, dest)`` for tests and debugging.
    """

    HISTORY = 64

    def __init__(self, spec: MachineSpec):
        self.spec = spec
        self.state: str = spec.initial.name
        self.machine = spec.attach(self)
        self.history: list[tuple[str, str, str]] = []

    def fire(self, trigger: str) -> None:
        before = self.state
        fire(self, trigger)
        self.history.append((before, trigger, self.state))
        del self.history[:-self.HISTORY]

    def can(self, trigger: str) -> bool:
        return trigger in self.spec.legal(self.state)

    def __repr__(self) -> str:
        return f"<{self.spec.name} {self.state}>"
