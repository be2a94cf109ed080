"""Images in chat requests: ``image_url`` data URIs decoded, bounded, cut into patches, and turned into prompt tokens.

Only ``data:image/png;base64,…`` and ``data:image/jpeg;base64,…`` are taken: the server has no network
by default, so an ``http(s)://`` URL is refused rather than fetched. Every refusal is a 400 naming the
content part (``messages[1].content[0]``). The limits (docs/API.md, "Images"): ``MAX_IMAGES`` per
request, ``MAX_SOURCE_PIXELS`` per decoded image (checked from the header, before the pixels are
decoded), and each image resized so that it is encoded at no more than ``MAX_ENCODED_PIXELS``.

An image becomes ``<|vision_start|>``, one token per merged patch (ids of
``hf2q.engine.vision.prompt_images``, which name the image by its bytes, so prefix reuse follows the
image), and ``<|vision_end|>`` — where Qwen3-VL's chat template puts ``<|image_pad|>``, which the
processor then repeats once per merged patch.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

import attrs
import numpy as np

from hf2q.api.errors import ApiError
from hf2q.engine.vision.patches import MIN_PIXELS, prepare_image
from hf2q.engine.vision.prompt_images import ImageStore, PreparedImage, content_key, image_keys, image_token
from hf2q.errors import InputError

#: images one request may carry
MAX_IMAGES = 8
#: pixels of one decoded image (width × height), above which it is refused
MAX_SOURCE_PIXELS = 4096 * 4096
#: pixels an image is encoded at, at most (larger ones are scaled down, aspect kept): 1024 merged tokens
#: for Qwen3-VL's 32-pixel merged patches
MAX_ENCODED_PIXELS = 1024 * 1024
#: where an image sat in a message's text (between its text parts), until the prompt is tokenized
IMAGE_MARKER = "\ue000"
_DATA_URI = re.compile(r"data:(image/[a-z.+-]+)?(;[^,;]*=[^,;]*)*;base64,", re.I)
_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg"}
#: the template's wrapping of an image, as Qwen3-VL writes it
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", code="invalid_value", param=param)


def decode_image_url(url: str, param: str) -> tuple[np.ndarray, bytes]:
    """An ``image_url`` → (RGB pixels ``[H, W, 3]`` uint8, the encoded bytes)."""
    if url.lower().startswith(("http://", "https://")):
        raise _refuse(param, "image URLs are not fetched (this server has no network access); send the image "
                             "inline as a data:image/png;base64,… or data:image/jpeg;base64,… URI")
    m = _DATA_URI.match(url)
    if m is None:
        raise _refuse(param, "expected a data:image/png;base64,… or data:image/jpeg;base64,… URI")
    try:
        data = base64.b64decode(url[m.end():], validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(param, "the image's base64 data is malformed") from None
    try:
        from PIL import Image
    except ImportError:
        raise ApiError(400, "this server cannot read images: Pillow is not installed", code="invalid_value",
                       param=param) from None
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in _FORMATS:
                raise _refuse(param, f"image format {im.format or 'unknown'} is not supported (PNG, JPEG)")
            w, h = im.size
            if w * h > MAX_SOURCE_PIXELS:
                raise _refuse(param, f"image of {w}×{h} pixels is over the {MAX_SOURCE_PIXELS} pixel limit")
            pixels = np.asarray(im.convert("RGB"))
    except ApiError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise _refuse(param, "the image data cannot be decoded as PNG or JPEG") from None
    return pixels, data


@attrs.define
class VisionInput:
    """A chat model's image side: the mmproj's cut and the store the engine reads the images from."""

    store: ImageStore
    patch: int
    merge: int
    mean: list
    std: list
    start_id: int
    end_id: int
    source: Path

    @classmethod
    def from_mmproj(cls, header, tokenizer, store: ImageStore) -> "VisionInput":
        from hf2q.formats.gguf_keys import Keys

        md = header.metadata

        def single(text: str) -> int:
            ids = tokenizer.encode(text, add_special=False, parse_special=True)
            if len(ids) != 1:
                raise InputError(f"the model's tokenizer has no {text} token; it cannot take images")
            return ids[0]
        return cls(store, int(md[Keys.ClipVision.PATCH_SIZE]), int(md.get(Keys.ClipVision.SPATIAL_MERGE_SIZE) or 2),
                   list(md.get(Keys.ClipVision.IMAGE_MEAN) or [0.5] * 3),
                   list(md.get(Keys.ClipVision.IMAGE_STD) or [0.5] * 3), single(VISION_START), single(VISION_END),
                   header.path)

    def release(self, prompt: list[int] | tuple[int, ...]) -> None:
        """The request whose prompt is ``prompt`` ended (or was refused): its images may be evicted."""
        self.store.release(image_keys(prompt))

    def tokens(self, url: str, param: str) -> list[int]:
        """The prompt tokens of one image part (its image registered in the store)."""
        pixels, data = decode_image_url(url, param)
        try:
            patches, grid = prepare_image(pixels, self.patch, self.merge, self.mean, self.std,
                                          min(MIN_PIXELS, MAX_ENCODED_PIXELS), MAX_ENCODED_PIXELS)
            image = PreparedImage(patches, grid, self.merge)
            key = content_key(data)
            self.store.add(key, image)
        except InputError as e:
            raise _refuse(param, str(e)) from None
        return [self.start_id, *(image_token(key, i) for i in range(image.n_tokens)), self.end_id]
