"""How Qwen3-VL's image processor cuts an image into patch rows — numpy and Pillow only, no MLX, so the
request side of the server prepares images while the engine thread runs (``hf2q.engine.vision.qwen3vl``
encodes the rows; its module docstring describes the row layout)."""

from __future__ import annotations

import math

import numpy as np

from hf2q.errors import InputError

#: the frames one patch spans (llama.cpp's graph and the converter's Conv3D split assume two)
TEMPORAL_PATCH = 2
#: Qwen3-VL's processor bounds on the resized image's pixels (its ``size``; the mmproj does not store them)
MIN_PIXELS, MAX_PIXELS = 65536, 16777216
#: the widest aspect ratio the processor accepts
MAX_ASPECT = 200


def merge_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch in merge-block order over an ``h × w`` patch grid."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(0, 2, 1, 3).ravel()


def patchify(frames: np.ndarray, patch: int, merge: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``frames [T, C, H, W]`` (normalised; T a multiple of two, H and W of ``patch · merge``) →
    (rows ``[t·h·w, C·2·patch·patch]``, grid ``(t, h, w)``) in the processor's layout."""
    T, C, H, W = frames.shape
    if T % TEMPORAL_PATCH or H % (patch * merge) or W % (patch * merge):
        raise InputError(f"image of {T}×{H}×{W}: frames must pair up and sides be multiples of {patch * merge}")
    t, h, w = T // TEMPORAL_PATCH, H // patch, W // patch
    x = frames.reshape(t, TEMPORAL_PATCH, C, h // merge, merge, patch, w // merge, merge, patch)
    # → t, block row, block column, row in block, column in block, C, time, patch row, patch column
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * h * w, C * TEMPORAL_PATCH * patch * patch)), (t, h, w)


def smart_resize(height: int, width: int, factor: int, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The processor's target size: both sides multiples of ``factor`` (patch × merge), the aspect
    ratio kept as nearly as rounding allows, the area brought within ``[min_pixels, max_pixels]``."""
    if min(height, width) < 1:
        raise InputError(f"image of {height}×{width} pixels is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InputError(f"image of {height}×{width} pixels: aspect ratio above {MAX_ASPECT}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def normalise(image: np.ndarray, mean, std) -> np.ndarray:
    """``image [H, W, C]`` in 0..255 → ``[C, H, W]`` float32 scaled and normalised as the processor."""
    x = image.astype(np.float32) / 255.0
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def prepare_image(image: np.ndarray, patch: int, merge: int, mean, std, min_pixels: int = MIN_PIXELS,
                  max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, tuple[int, int, int]]:
    """An RGB image ``[H, W, 3]`` (uint8) → patch rows and grid, as Qwen3-VL's processor makes them:
    bicubic resize to :func:`smart_resize`'s size (Pillow), scale, normalise, a still frame doubled."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise InputError(f"expected an RGB uint8 image [H, W, 3], got {image.dtype} {list(image.shape)}")
    try:
        from PIL import Image
    except ImportError:
        raise InputError("images need Pillow (pip install pillow)") from None
    h, w = smart_resize(image.shape[0], image.shape[1], patch * merge, min_pixels, max_pixels)
    if (h, w) != image.shape[:2]:
        image = np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.BICUBIC))
    frame = normalise(image, mean, std)
    return patchify(np.stack([frame] * TEMPORAL_PATCH), patch, merge)
