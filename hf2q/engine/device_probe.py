"""Which device MLX will run on and how much memory it has — found without importing MLX.

``hf2q serve`` checks that a model fits (``memory_plan``) in the main thread, before the
engine thread exists; only code reached from the engine thread imports MLX, so the check
cannot ask ``mlx.core``. MLX's default device is its GPU whenever its GPU back-end is
installed and finds a device: Metal on macOS (``mlx-metal``, memory shared with the system),
CUDA on Linux (an ``mlx-cuda-*`` wheel and a visible NVIDIA device, whose total memory we read from
NVML, as MLX's own CUDA ``device_info`` does).
Otherwise it is the CPU and the system's RAM. ``tests/test_memory_plan.py`` checks this guess
against MLX itself.
"""

from __future__ import annotations

import ctypes
import os
import platform
from importlib import metadata

import attrs

#: ``HF2Q_EXACT_SCALES=1`` keeps quantization scales in float32 on GPUs too (``engine.layers``)
EXACT_GPU_SCALES = os.environ.get("HF2Q_EXACT_SCALES", "0") not in ("", "0")


@attrs.frozen
class DeviceFacts:
    kind: str  # "cpu" | "gpu": MLX's default device type
    backend: str  # "cpu" | "cuda" | "metal"
    memory: int  # bytes a model may live in (GPU memory, or system RAM)

    @property
    def on_cpu(self) -> bool:
        return self.kind == "cpu"

    def activation_bytes(self) -> int:
        """Bytes per activation / KV element of the engine on this device (``runner.compute_dtype``:
        float32 on the CPU, float16 or bfloat16 on a GPU)."""
        return 4 if self.on_cpu else 2

    def scale_bytes(self) -> int:
        """Bytes per quantization scale once loaded (float32 on the CPU or with ``HF2Q_EXACT_SCALES``)."""
        return 4 if self.on_cpu or EXACT_GPU_SCALES else self.activation_bytes()


#: the wheels that give MLX a GPU back-end (``mlx[cuda]``, ``mlx[cuda12]``, ``mlx[cuda13]``; macOS)
CUDA_WHEELS = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")
METAL_WHEELS = ("mlx-metal",)


def _installed(names: tuple[str, ...]) -> bool:
    for name in names:
        try:
            metadata.version(name)
            return True
        except metadata.PackageNotFoundError:
            continue
    return False


def _system_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _first_visible_index() -> int | None:
    """The NVML index of the device CUDA numbers 0 (None when ``CUDA_VISIBLE_DEVICES`` hides all)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return 0
    first = visible.split(",")[0].strip()
    if not first or first.startswith("-"):
        return None
    return int(first) if first.isdigit() else 0


def nvidia_memory() -> int | None:
    """Total memory of the first visible NVIDIA GPU (NVML), None without one or without the driver."""
    index = _first_visible_index()
    if index is None:
        return None
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or index >= count.value:
            return None
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            return None
        mem = _NvmlMemory()
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            return None
        return int(mem.total)
    finally:
        nvml.nvmlShutdown()


def probe() -> DeviceFacts:
    """MLX's default device and its memory, as MLX would report them (see the module docstring)."""
    if platform.system() == "Darwin" and _installed(METAL_WHEELS):
        return DeviceFacts("gpu", "metal", _system_memory())
    if platform.system() == "Linux" and _installed(CUDA_WHEELS):
        gpu = nvidia_memory()
        if gpu is not None:
            return DeviceFacts("gpu", "cuda", gpu)
    return DeviceFacts("cpu", "cpu", _system_memory())
