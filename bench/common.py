"""What the benchmark scripts share: the model they run by default, a process's CPU time, and how every
one of them ends (the report as indented JSON on stdout, and in a file when asked)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def emit(report: dict, out: str | None) -> int:
    """Print ``report``; also write it to ``out`` when given. Returns the exit code (0)."""
    text = json.dumps(report, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
    return 0


def chat_model(arg: str | None) -> Path:
    """The GGUF a ``--model`` argument names, else the built-in default chat model (fetched on first use)."""
    if arg:
        return Path(arg)
    from hf2q.fetch import default_chat_model

    return Path(default_chat_model())


def process_cpu_s(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``; this one by default)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def synth_file(work: Path, shape: str, layers: int, mix: str, vocab: str | None = None) -> Path:
    """A random-weight GGUF of ``shape`` from ``bench/synth_gguf.py``, made once under ``work`` (the loader
    needs a real tokenizer: llama.cpp's Qwen2 vocabulary GGUF unless ``vocab`` names one)."""
    import subprocess
    import sys

    if vocab is None:
        from tests.tools import llama_cpp

        vocab = str(llama_cpp.source_dir() / "models" / "ggml-vocab-qwen2.gguf")
    path = work / f"{shape}-{layers}l-{mix}.gguf"
    if not path.exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("synth_gguf.py")), "--shape", shape, "--layers",
                        str(layers), "--mix", mix, "--vocab-gguf", vocab, "-o", str(path)],
                       check=True, stdout=subprocess.DEVNULL)
    return path
