"""Shared pytest fixtures: test models, the llama.cpp oracle, and a CLI runner.

Models are built/fetched once per machine into the hf2q cache (see ``tests/models/``)
and handed out as session-scoped fixtures; nothing here copies them per test, so tests
that write must write elsewhere (``tmp_path``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests.models` / `tests.tools` importable however pytest is started
    sys.path.insert(0, str(ROOT))

from hf2q.paths import cache_root

# Subprocesses (llama.cpp's convert script, `python -m hf2q`) must see the same cache as we do;
# a value set by the caller (CI, an engineer) wins.
os.environ.setdefault("HF2Q_CACHE", str(cache_root()))

# Engine tests build runners themselves, not through hf2q.engine.factory.load_runner: ready the
# process for MLX (the fast CPU BLAS) the same way, before any test module imports mlx.
from hf2q.engine.factory import prepare_mlx  # noqa: E402

prepare_mlx()


def _host_line() -> str:
    """The machine the float tolerances were met on: results of BLAS and of llama.cpp's CPU kernels round
    by instruction set and core count, so a failing comparison starts from what this host was."""
    from hf2q.kernels import cpu_blas
    from hf2q.kernels.cpu_info import cpu_model
    from tests.tools import llama_cpp

    return (f"host: {cpu_model()}, {os.cpu_count()} CPUs; llama.cpp oracle built for {llama_cpp.built_isa()}; "
            f"blas: {cpu_blas.status()}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus and not hasattr(config, "workerinput"):  # after a failure, at the end (shown under -q too)
        terminalreporter.write_line(_host_line())


# ---------------------------------------------------------------------------- test models

@pytest.fixture(scope="session")
def tiny_checkpoint() -> Callable[[str], Path]:
    """Factory: ``tiny_checkpoint("qwen3")`` → folder of the tiny random-weight HF checkpoint.

    Families: llama, qwen3, qwen3_moe, gemma3, bert. The folder is shared: do not write into it.
    """
    from tests.models.tiny import checkpoint

    return checkpoint


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from tests.models import real

    return real.smollm2_gguf()


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    from tests.models import real

    return real.gemma3_gguf()


@pytest.fixture(scope="session")
def minilm_hf() -> Path:
    from tests.models import real

    return real.minilm_hf_dir()


@pytest.fixture(scope="session")
def smollm2_hf() -> Path:
    from tests.models import real

    return real.smollm2_hf_dir()


@pytest.fixture(scope="session")
def gemma3_hf() -> Path:
    from tests.models import real

    return real.gemma3_hf_dir()


# ---------------------------------------------------------------------------- llama.cpp oracle

@pytest.fixture(scope="session")
def llama_cpp_bin() -> Path:
    """Directory of the stock llama.cpp build (llama-quantize, llama-completion, …); skips if absent.

    Run the tools with ``env=tests.tools.llama_cpp.env()`` (shared libs + passive OpenMP waits).
    """
    from tests.tools import llama_cpp

    if not llama_cpp.available():
        pytest.skip(f"stock llama.cpp is not built in {llama_cpp.bin_dir()} "
                    "(build it once with `python -m tests.tools.llama_cpp`)")
    return llama_cpp.bin_dir()


# ---------------------------------------------------------------------------- CLI runner

@attrs.frozen
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys) -> Callable[..., CliResult]:
    """``cli("convert", src, "-q", "q8_0")`` → CliResult(code, out, err) of ``hf2q.cli.main``.

    Runs in-process; argparse exits (usage errors, ``--version``) are returned as codes.
    """
    from hf2q.cli import main

    def run(*argv: str | os.PathLike) -> CliResult:
        capsys.readouterr()  # drop anything printed before this call
        try:
            code = main([os.fspath(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(int(code), captured.out, captured.err)

    return run
