"""``hf2q serve`` whose engine can be made to fail or hang on a signal, for the reliability suite.

The real command, model and runtime; only the loaded runner is wrapped, the way the runtime
tests wrap it (tests/test_runtime_real.py's ``ArmableFault``, the fake runner's
``inject_fault`` / ``inject_hang``): after SIGUSR1 its next forward pass raises, as a device
error would; after SIGUSR2 it blocks for good, as a hung GPU step would.

    python bench/reliability_faulty_serve.py --model M.gguf --port 0 --gpu-deadline 3
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf2q.api import command  # noqa: E402

ARMED: dict[str, str | None] = {"mode": None}
NEVER = threading.Event()


class InjectedEngineFault(RuntimeError):
    """What the armed runner raises in place of a device error."""


class ArmableRunner:
    """The loaded runner, except once armed (no pipelined decode, so every step passes here)."""

    pipelines_decode = False

    def __init__(self, runner):
        self._runner = runner
        if hasattr(runner, "decode_with_prefill"):  # the step asks for it by hasattr
            self.decode_with_prefill = self._gated(runner.decode_with_prefill)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def _gate(self) -> None:
        if ARMED["mode"] == "fault":
            raise InjectedEngineFault("injected engine fault (reliability suite)")
        if ARMED["mode"] == "hang":
            NEVER.wait()

    def decode(self, *a, **k):
        self._gate()
        return self._runner.decode(*a, **k)

    def _gated(self, fn):
        def call(*a, **k):
            self._gate()
            return fn(*a, **k)
        return call

    def prefill(self, *a, **k):
        self._gate()
        return self._runner.prefill(*a, **k)


def _armed_factory(original):
    def factory(*a, **k):
        build = original(*a, **k)
        return lambda: ArmableRunner(build())
    return factory


def main() -> int:
    command.runner_factory = _armed_factory(command.runner_factory)
    signal.signal(signal.SIGUSR1, lambda *_: ARMED.update(mode="fault"))
    signal.signal(signal.SIGUSR2, lambda *_: ARMED.update(mode="hang"))
    from hf2q.cli import main as cli_main

    return cli_main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
