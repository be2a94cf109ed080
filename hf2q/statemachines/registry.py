"""Every declared state machine, by name — what ``hf2q diagrams`` and docs/ render.

Machines live in their own modules; this list names the modules, and every
``MachineSpec`` found at their top level is registered. ``kv_writer`` belongs to the
persistent KV store and is included whenever it is importable.
"""

from __future__ import annotations

import importlib

from hf2q.statemachines.base import MachineSpec

MODULES = (
    "hf2q.statemachines.supervisor",
    "hf2q.statemachines.admission",
    "hf2q.statemachines.slot",
    "hf2q.statemachines.prefill",
    "hf2q.statemachines.image_encode",
    "hf2q.statemachines.gpu_owner",
    "hf2q.statemachines.kv_prefix",
    "hf2q.statemachines.model_residency",
)
OPTIONAL_MODULES = ("hf2q.statemachines.kv_writer",)


def _specs_in(module) -> list[MachineSpec]:
    return [v for v in vars(module).values() if isinstance(v, MachineSpec)]


def all_machines() -> dict[str, MachineSpec]:
    """Name → spec, in a stable order (the order of ``MODULES``, then optional ones)."""
    found: dict[str, MachineSpec] = {}
    for name in MODULES:
        for spec in _specs_in(importlib.import_module(name)):
            found[spec.name] = spec
    for name in OPTIONAL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for spec in _specs_in(module):
            found[spec.name] = spec
    return found
