"""``hf2q completions``: each shell's script parses in that shell, names every command, and — in bash
and fish, whose completion machinery runs without a terminal — completes what the parser accepts."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from hf2q.cli import build_parser
from hf2q.completions import SHELLS
from hf2q.convert.quant_names import MLX_QUANTS

COMMANDS = list(build_parser()._subparsers._group_actions[0].choices)


def _script(cli, shell: str) -> str:
    r = cli("completions", shell)
    assert r.code == 0, r.err
    return r.out


@pytest.mark.parametrize("shell", SHELLS)
def test_script_names_every_command_and_parses(cli, shell, tmp_path):
    text = _script(cli, shell)
    assert text.strip()
    for name in COMMANDS:
        assert name in text, (shell, name)
    assert "ignore-eos" in text and "chat-template" in text
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed: syntax not checked")
    path = tmp_path / f"hf2q.{shell}"
    path.write_text(text)
    check = [shell, "-n", str(path)] if shell != "fish" else ["fish", "--no-execute", str(path)]
    done = subprocess.run(check, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def _bash_complete(script: str, *words: str) -> list[str]:
    line = " ".join(f"'{w}'" for w in words)
    prog = f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _hf2q; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    done = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_bash_completes_commands_flags_and_choices(cli):
    script = _script(cli, "bash")
    assert sorted(_bash_complete(script, "hf2q", "g")) == ["generate", "gguf-patch"]
    assert set(_bash_complete(script, "hf2q", "")) >= set(COMMANDS)
    assert _bash_complete(script, "hf2q", "-v", "convert", "--format", "") == ["gguf", "mlx"]
    assert sorted(_bash_complete(script, "hf2q", "gguf-patch", "--d")) == ["--drop", "--dry-run"]
    assert sorted(_bash_complete(script, "hf2q", "generate", "--ig")) == ["--ignore-eos"]
    assert _bash_complete(script, "hf2q", "completions", "") == list(SHELLS)
    assert sorted(_bash_complete(script, "hf2q", "convert", "-q", "q4_k")) == ["q4_k_m", "q4_k_s"]


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completes_commands_flags_and_choices(cli, tmp_path):
    path = tmp_path / "hf2q.fish"
    path.write_text(_script(cli, "fish"))

    def complete(line: str) -> list[str]:
        done = subprocess.run(["fish", "-c", f"source {path}; complete -C '{line}'"], capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, done.stderr
        return [row.split("\t")[0] for row in done.stdout.splitlines()]

    assert sorted(complete("hf2q g")) == ["generate", "gguf-patch"]
    assert sorted(complete("hf2q cache ")) == ["clear", "list", "size"]
    assert sorted(complete("hf2q serve --operator-ui ")) == ["auto", "dashboard", "plain"]
    assert "--ignore-eos" in complete("hf2q generate --ig")
    assert sorted(complete("hf2q convert --quant mlx-mixed")) == sorted(q for q in MLX_QUANTS if "mixed" in q)
