"""``hf2q completions``: each shell's script parses in that shell, names every command, and completes
what the parser accepts — bash and fish driven directly, zsh through a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import time

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


def _zsh_complete(setup: str, line: str) -> str:
    """What an interactive ``zsh -f`` prints for ``line`` + TAB after ``setup`` (run in a pseudo-terminal)."""
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.environ["TERM"] = "dumb"
        os.execvp("zsh", ["zsh", "-f", "-i"])

    def read(quiet: float, limit: float = 10.0) -> str:
        out, end, last = b"", time.monotonic() + limit, time.monotonic()
        while time.monotonic() < end and time.monotonic() - last < quiet:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    break
                last = time.monotonic()
        return out.decode(errors="replace")

    try:
        os.write(fd, f"{setup}; PS1='> '\n".encode())
        read(1.0)
        os.write(fd, line.encode() + b"\t")
        return read(0.7)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
@pytest.mark.parametrize("how", ["sourced", "fpath"])
def test_zsh_completes_commands_and_choices(cli, tmp_path, how):
    (tmp_path / "_hf2q").write_text(_script(cli, "zsh"))
    init = "autoload -U compinit && compinit -u -D"
    setup = f"{init}; source {tmp_path / '_hf2q'}" if how == "sourced" else f"fpath=({tmp_path} $fpath); {init}"
    commands = _zsh_complete(setup, "hf2q g")
    assert "generate" in commands and "gguf-patch" in commands and "convert" not in commands
    assert all(word in _zsh_complete(setup, "hf2q cache ") for word in ("clear", "list", "size"))
