"""A model that turns a token window into every position's logits: a GGUF on our engine, or an
mlx-lm directory on mlx-lm.

Scoring needs the logits of every position of a window in one forward, from a fresh context each
time; both kinds give exactly that and nothing else, so the scorer never knows which it holds.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUF_MAGIC

log = logging.getLogger("hf2q.quality")

MLX_LM_HINT = "scoring an mlx-lm directory needs mlx-lm: pip install 'hf2q[mlx-lm]'"


class GGUFLogits:
    """Our engine (``hf2q.engine``) over a GGUF; each window runs in a new sequence."""

    kind = "gguf"

    def __init__(self, path: Path, n_ctx: int):
        from hf2q.engine.factory import load_runner

        self.path = Path(path)
        self.runner = load_runner(self.path, ctx=n_ctx)
        if self.runner.is_embedding_model:
            raise InputError(f"{self.path.name} is an embedding model; it has no next-token distribution to score")
        self.vocab_size = self.runner.vocab_size

    def logits(self, window: np.ndarray) -> np.ndarray:
        return self.runner.verify(self.runner.new_sequence(), [int(t) for t in window])


def _import_mlx_lm():
    from hf2q.engine.factory import prepare_mlx

    prepare_mlx()
    try:
        import mlx_lm
    except ImportError:
        raise InputError(MLX_LM_HINT) from None
    return mlx_lm


class MlxLmLogits:
    """An mlx-lm directory through ``mlx_lm.load`` — the tool that directory is made for."""

    kind = "mlx"

    def __init__(self, path: Path):
        mlx_lm = _import_mlx_lm()
        import mlx.core as mx

        self._mx = mx
        self.path = Path(path)
        try:
            self.model, _ = mlx_lm.load(str(self.path))
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"mlx-lm cannot load {self.path}: {e}") from None

    def logits(self, window: np.ndarray) -> np.ndarray:
        mx = self._mx
        out = self.model(mx.array(np.asarray(window, dtype=np.int32)[None]))[0].astype(mx.float32)
        mx.eval(out)
        return np.array(out)


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@contextlib.contextmanager
def gguf_of(model: Path, scratch: Path, threads: int | None = None, *, prefix: str = ".hf2q-f16-",
            what: str = "model") -> Iterator[Path]:
    """``model`` itself when it is a GGUF file; for an HF checkpoint directory, an F16 GGUF our
    converter writes into a temporary directory ``prefix*`` under ``scratch`` (removed on exit).
    ``what`` names the argument in errors."""
    model = Path(model)
    if model.is_file() and is_gguf(model):
        yield model
        return
    if not model.is_dir():
        raise InputError(f"{what} {model} is neither a GGUF file nor an HF checkpoint directory")
    from hf2q.convert.pipeline import convert_gguf
    from hf2q.convert.quant_names import parse_gguf_quant

    with tempfile.TemporaryDirectory(prefix=prefix, dir=scratch) as tmp:
        out = Path(tmp) / f"{model.name}-f16.gguf"
        log.info("converting %s to a temporary F16 GGUF", model)
        convert_gguf(model, out, parse_gguf_quant("f16"), threads=threads, integrity=False,
                     report_path=Path(tmp) / "report.json")
        yield out


def converted_kind(path: Path) -> str:
    """``"gguf"`` or ``"mlx"`` — checked before any model runs, so a wrong path or a missing
    mlx-lm is reported before the reference has been scored."""
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"{path} is a directory without config.json (not an mlx-lm directory)")
        _import_mlx_lm()
        return "mlx"
    if not path.exists():
        raise InputError(f"no such file or directory: {path}")
    if not is_gguf(path):
        raise InputError(f"{path} is neither a GGUF file nor an mlx-lm directory")
    return "gguf"


def open_converted(path: Path, n_ctx: int):
    """The scorer's view of CONVERTED: a GGUF file or an mlx-lm directory."""
    if converted_kind(path) == "mlx":
        return MlxLmLogits(Path(path))
    return GGUFLogits(Path(path), n_ctx)
