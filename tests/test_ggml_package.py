"""``hf2q.ggml`` (the conversion-time codecs) stands without MLX: converting needs no GPU stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hf2q

GGML = Path(hf2q.__file__).resolve().parent / "ggml"


def test_ggml_imports_without_mlx():
    # the numba modules (jit_*) compile their kernels on import; their imports are numpy and numba
    # alone, which the import-graph and the static check below cover
    modules = sorted(p.stem for p in GGML.glob("*.py") if p.stem != "__init__" and not p.stem.startswith("jit_"))
    assert "codec" in modules
    code = ("import sys\n"
            + "".join(f"import hf2q.ggml.{m}\n" for m in modules)
            + "from hf2q.ggml import codec\n"
            + "import numpy as np, gguf\n"
            + "x = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)\n"
            + "codec.dequantize(codec.numpy_quantize(x, gguf.GGMLQuantizationType.Q4_K), "
              "gguf.GGMLQuantizationType.Q4_K, x.shape)\n"
            + "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=GGML.parent.parent)
    assert out.stdout.strip() == "[]", out.stdout


def test_ggml_sources_name_no_mlx_or_serving_kernels():
    for path in GGML.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "import mlx" not in text and "from mlx" not in text, path.name
        assert "hf2q.kernels" not in text and "hf2q.engine" not in text, path.name
