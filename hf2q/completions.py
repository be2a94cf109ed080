"""``hf2q completions bash|zsh|fish``: a shell completion script written from the CLI's own parser.

The script is generated from :func:`hf2q.cli.build_parser` on every call, so a new command or flag
completes as soon as it exists. What completes: command names (with their help in zsh and fish),
each command's flags, the fixed choices of a flag or positional (``--format gguf|mlx``, the quant
names), and file names for any other value. (``shtab`` writes bash and zsh scripts from argparse but not fish, so
one small generator serves all three.)
"""

from __future__ import annotations

import argparse
import sys

import attrs

SHELLS = ("bash", "zsh", "fish")


@attrs.frozen
class Option:
    flags: tuple[str, ...]
    help: str
    takes_value: bool
    choices: tuple[str, ...] | None
    repeatable: bool


@attrs.frozen
class Command:
    name: str
    help: str
    options: tuple[Option, ...]
    #: the first positional's fixed choices, or None when it is a file (or there is none)
    positional_choices: tuple[str, ...] | None
    has_positional: bool


def _clean(text: str | None) -> str:
    """Help text safe inside any of the three shells' quoting: one line, no quotes or brackets."""
    text = (text or "").replace("%%", "%").split("\n")[0]
    for a, b in (("'", "’"), ('"', "”"), ("[", "("), ("]", ")"), ("`", "’"), ("\\", "/"), ("$", "")):
        text = text.replace(a, b)
    return text


def _value_choices() -> dict[tuple[str, str], tuple[str, ...]]:
    """Finite value sets the parser checks later rather than through ``choices`` (command, dest)."""
    from hf2q.convert.mlx_policy import DWQ_QUANT_NAMES
    from hf2q.convert.quant_names import GGUF_QUANTS, MLX_QUANTS, TIER_QUANTS

    return {("convert", "quant"): tuple(GGUF_QUANTS) + tuple(TIER_QUANTS) + tuple(MLX_QUANTS) + DWQ_QUANT_NAMES}


def _options(parser: argparse.ArgumentParser, command: str = "") -> tuple[Option, ...]:
    extra = _value_choices()
    out = []
    for a in parser._actions:
        if not a.option_strings or a.help == argparse.SUPPRESS:
            continue
        choices = tuple(str(c) for c in a.choices) if a.choices else extra.get((command, a.dest))
        out.append(Option(tuple(a.option_strings), _clean(a.help), a.nargs != 0, choices,
                          isinstance(a, (argparse._AppendAction, argparse._CountAction))))
    return tuple(out)


def describe(parser: argparse.ArgumentParser) -> tuple[tuple[Option, ...], tuple[Command, ...]]:
    """(top-level options, commands) of ``parser``."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    commands = []
    for name, p in sub.choices.items():
        positionals = [a for a in p._actions if not a.option_strings]
        first = positionals[0] if positionals else None
        commands.append(Command(name, _clean(helps.get(name)), _options(p, name),
                                tuple(str(c) for c in first.choices) if first is not None and first.choices else None,
                                first is not None))
    return _options(parser), tuple(commands)


# ---- bash -------------------------------------------------------------------------------------

def _bash_values(options: tuple[Option, ...], indent: str) -> list[str]:
    lines = [f"{indent}case \"$prev\" in"]
    for o in options:
        if o.takes_value:
            reply = f"compgen -W \"{' '.join(o.choices)}\" -- \"$cur\"" if o.choices else "compgen -f -- \"$cur\""
            lines.append(f"{indent}    {'|'.join(o.flags)}) mapfile -t COMPREPLY < <({reply}); return ;;")
    lines.append(f"{indent}esac")
    return lines


def bash(top: tuple[Option, ...], commands: tuple[Command, ...]) -> str:
    names = " ".join(c.name for c in commands)
    top_flags = " ".join(f for o in top for f in o.flags)
    lines = ["# bash completion for hf2q (written by `hf2q completions bash`)",
             "_hf2q() {",
             "    local cur prev cmd i",
             "    cur=\"${COMP_WORDS[COMP_CWORD]}\"",
             "    prev=\"${COMP_WORDS[COMP_CWORD-1]}\"",
             "    cmd=\"\"",
             "    for ((i = 1; i < COMP_CWORD; i++)); do",
             f"        case \" {names} \" in *\" ${{COMP_WORDS[i]}} \"*) cmd=\"${{COMP_WORDS[i]}}\"; break ;; esac",
             "    done",
             "    case \"$cmd\" in",
             "    \"\")",
             *_bash_values(top, "        "),
             f"        mapfile -t COMPREPLY < <(compgen -W \"{top_flags} {names}\" -- \"$cur\") ;;"]
    for c in commands:
        flags = " ".join(f for o in c.options for f in o.flags)
        if c.positional_choices:
            rest = f"compgen -W \"{' '.join(c.positional_choices)}\" -- \"$cur\""
        elif c.has_positional:
            rest = "compgen -f -- \"$cur\""
        else:
            rest = f"compgen -W \"{flags}\" -- \"$cur\""
        lines += [f"    {c.name})",
                  *_bash_values(c.options, "        "),
                  "        if [[ \"$cur\" == -* ]]; then",
                  f"            mapfile -t COMPREPLY < <(compgen -W \"{flags}\" -- \"$cur\")",
                  "        else",
                  f"            mapfile -t COMPREPLY < <({rest})",
                  "        fi ;;"]
    lines += ["    esac", "}", "complete -o filenames -F _hf2q hf2q", ""]
    return "\n".join(lines)


# ---- zsh --------------------------------------------------------------------------------------

def _zsh_specs(options: tuple[Option, ...]) -> list[str]:
    specs = []
    for o in options:
        value = ""
        if o.takes_value:
            value = f":value:({' '.join(o.choices)})" if o.choices else ":value:_files"
        for flag in o.flags:
            specs.append(f"'{'*' if o.repeatable else ''}{flag}[{o.help}]{value}'")
    return specs


def zsh(top: tuple[Option, ...], commands: tuple[Command, ...]) -> str:
    lines = ["#compdef hf2q",
             "# zsh completion for hf2q (written by `hf2q completions zsh`)",
             "_hf2q() {",
             "    local curcontext=\"$curcontext\" state line",
             "    typeset -A opt_args",
             "    _arguments -C \\",
             *[f"        {s} \\" for s in _zsh_specs(top)],
             "        '1:command:->command' \\",
             "        '*::argument:->argument'",
             "    case $state in",
             "    command)",
             "        local -a commands",
             "        commands=(",
             *[f"            '{c.name}:{c.help}'" for c in commands],
             "        )",
             "        _describe -t commands 'hf2q command' commands ;;",
             "    argument)",
             "        case $line[1] in"]
    for c in commands:
        specs = _zsh_specs(c.options)
        if c.positional_choices:
            specs.append(f"'1:argument:({' '.join(c.positional_choices)})'")
        elif c.has_positional:
            specs.append("'1:file:_files'")
        body = " \\\n                ".join(specs)
        lines += [f"        {c.name})", f"            _arguments \\\n                {body} ;;"]
    lines += ["        esac ;;", "    esac", "}",
              "# autoloaded from $fpath: complete now; sourced: register",
              "if [[ \"$funcstack[1]\" == _hf2q ]]; then _hf2q \"$@\"; else compdef _hf2q hf2q; fi", ""]
    return "\n".join(lines)


# ---- fish -------------------------------------------------------------------------------------

def _fish_option(o: Option, condition: str) -> str:
    parts = [f"complete -c hf2q -n '{condition}'"]
    for flag in o.flags:
        parts.append(f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}")
    if o.takes_value:
        parts.append(f"-x -a '{' '.join(o.choices)}'" if o.choices else "-r -F")
    parts.append(f"-d '{o.help}'")
    return " ".join(parts)


def fish(top: tuple[Option, ...], commands: tuple[Command, ...]) -> str:
    lines = ["# fish completion for hf2q (written by `hf2q completions fish`)", "complete -c hf2q -f"]
    lines += [_fish_option(o, "__fish_use_subcommand") for o in top]
    lines += [f"complete -c hf2q -n '__fish_use_subcommand' -a {c.name} -d '{c.help}'" for c in commands]
    for c in commands:
        seen = f"__fish_seen_subcommand_from {c.name}"
        lines += [_fish_option(o, seen) for o in c.options]
        if c.positional_choices:
            lines.append(f"complete -c hf2q -n '{seen}' -a '{' '.join(c.positional_choices)}'")
        elif c.has_positional:
            lines.append(f"complete -c hf2q -n '{seen}' -F")
    return "\n".join(lines) + "\n"


def script(shell: str) -> str:
    from hf2q.cli import build_parser

    top, commands = describe(build_parser())
    return {"bash": bash, "zsh": zsh, "fish": fish}[shell](top, commands)


def run(args) -> int:
    sys.stdout.write(script(args.shell))
    return 0
