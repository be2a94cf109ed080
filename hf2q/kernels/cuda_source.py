"""One custom CUDA kernel built from its source file on first use (``mx.fast.cuda_kernel``).

The kernel bodies live in ``csrc/*.cu``; MLX writes each signature from the input and output names and
compiles the body on the first call (per set of template arguments), so building is deferred until a
GPU call needs it and happens once per process, under a lock (the engine thread and a warm-up may race).
"""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx

CSRC = Path(__file__).resolve().with_name("csrc")


class CudaKernel:
    def __init__(self, name: str, source: str, inputs: list[str], outputs: list[str],
                 ensure_row_contiguous: bool = True):
        self.name, self.path = name, CSRC / source
        self.inputs, self.outputs, self.ensure_row_contiguous = inputs, outputs, ensure_row_contiguous
        self._kernel = None
        self._lock = threading.Lock()

    def __call__(self, **launch):
        if self._kernel is None:
            with self._lock:
                if self._kernel is None:
                    self._kernel = mx.fast.cuda_kernel(
                        name=self.name, input_names=self.inputs, output_names=self.outputs,
                        source=self.path.read_text(encoding="utf-8"), ensure_row_contiguous=self.ensure_row_contiguous)
        return self._kernel(**launch)
