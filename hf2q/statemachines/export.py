"""``hf2q diagrams``: render every declared state machine as Mermaid, DOT or SVG.

Also writes ``docs/STATEMACHINES.md`` (``python -m hf2q.statemachines.export --write-docs``)
so the Mermaid text reviewers read is generated from the specs, never hand-drawn;
a test fails when the file is stale.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from hf2q.errors import ConversionError, InputError, did_you_mean
from hf2q.statemachines.base import MachineSpec
from hf2q.statemachines.registry import all_machines

EXTENSIONS = {"mermaid": "mmd", "dot": "dot", "svg": "svg"}
DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "STATEMACHINES.md"


def render(spec: MachineSpec, fmt: str) -> str:
    if fmt == "mermaid":
        return spec.to_mermaid()
    if fmt == "dot":
        return spec.to_dot()
    if fmt == "svg":
        dot = shutil.which("dot")
        if dot:
            done = subprocess.run([dot, "-Tsvg"], input=spec.to_dot(), capture_output=True, text=True)
            if done.returncode == 0:
                return done.stdout
        from hf2q.statemachines.svg import to_svg

        return to_svg(spec)
    raise InputError(f"unknown diagram format {fmt!r}{did_you_mean(fmt, EXTENSIONS)}")


def markdown() -> str:
    """The full text of docs/STATEMACHINES.md."""
    parts = ["# State machines\n",
             "Generated from `hf2q/statemachines/` by `python -m hf2q.statemachines.export --write-docs`",
             "(the same text `hf2q diagrams` prints). Do not edit by hand: a test checks it is current.\n",
             "Triggers are past-tense events; any trigger not drawn from a state raises",
             "`IllegalTransition`.\n"]
    for name, spec in all_machines().items():
        parts.append(f"## {name}\n")
        if spec.description:
            parts.append(f"{spec.description}.\n")
        parts.append("```mermaid\n" + spec.to_mermaid() + "```\n")
    return "\n".join(parts)


def run(args) -> int:
    machines = all_machines()
    fmt = getattr(args, "format", "mermaid") or "mermaid"
    if getattr(args, "machine", None):
        if args.machine not in machines:
            raise InputError(f"unknown state machine {args.machine!r}{did_you_mean(args.machine, machines)}"
                             f" (known: {', '.join(machines)})")
        machines = {args.machine: machines[args.machine]}
    output = getattr(args, "output", None)
    if output:
        out_dir = Path(output)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            for name, spec in machines.items():
                (out_dir / f"{name}.{EXTENSIONS[fmt]}").write_text(render(spec, fmt))
        except OSError as e:
            raise ConversionError(f"cannot write diagrams to {out_dir}: {e.strerror or e}") from None
        print(f"wrote {len(machines)} {fmt} diagram(s) to {out_dir}")
        return 0
    for name, spec in machines.items():
        if fmt == "mermaid":
            sys.stdout.write(f"%% {name}\n")
        elif fmt == "dot":
            sys.stdout.write(f"// {name}\n")
        sys.stdout.write(render(spec, fmt))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        DOCS_PATH.write_text(markdown())
        print(f"wrote {DOCS_PATH}")
    else:
        print("usage: python -m hf2q.statemachines.export --write-docs", file=sys.stderr)
        sys.exit(2)
