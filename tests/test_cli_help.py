"""Help texts speak of what a user has: every quant name, no internal documents."""

from __future__ import annotations

import re
import subprocess
import sys

from hf2q.cli import build_parser
from hf2q.convert.quant_names import GGUF_QUANTS, MLX_QUANTS

COMMANDS = ["convert", "info", "generate", "chat", "serve", "diagrams", "doctor", "cache", "gguf-patch", "imatrix",
            "completions"]


def _help(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hf2q", *argv, "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_top_help_describes_the_tool_not_the_parser():
    text = _help()
    assert "OpenAI-compatible" in text and "exit codes" in text
    assert "parser" not in text.lower()


def test_no_help_cites_internal_documents():
    for argv in ([], *[[c] for c in COMMANDS]):
        text = _help(*argv)
        assert not re.search(r"\b(SPEC|STYLE)\b|§", text), (argv, text)


def test_quant_help_lists_every_name():
    convert = next(a for a in build_parser()._subparsers._group_actions[0].choices["convert"]._actions
                   if "--quant" in a.option_strings)
    listed = set(re.findall(r"[a-z0-9_]+", convert.help.replace("mlx-", "mlx_")))
    for name in GGUF_QUANTS:
        assert name in listed, name
    mixed = re.search(r"mlx-mixed-([0-9|-]+)", convert.help).group(1).split("|")
    lo, hi = (int(b) for b in re.search(r"mlx-(\d) … mlx-(\d)", convert.help).groups())
    for name in MLX_QUANTS:
        rest = name.removeprefix("mlx-")
        if rest.startswith("mixed-"):
            assert rest.removeprefix("mixed-") in mixed, name
        else:
            assert lo <= int(rest) <= hi, name
