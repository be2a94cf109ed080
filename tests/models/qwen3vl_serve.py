"""The tiny Qwen3-VL served in-process over real HTTP, for the image tests: its mmproj, test images, a server."""

from __future__ import annotations

import base64
import io
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import trio

from tests.models.qwen3vl import checkpoint, f32_gguf


def png(seed: int | None, size=(256, 256), fmt: str = "PNG") -> bytes:
    """Random pixels (a flat grey for ``seed`` None: a large image in few bytes), encoded as ``fmt``."""
    from PIL import Image

    shape = (size[1], size[0], 3)
    pixels = np.full(shape, 128, np.uint8) if seed is None else \
        np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_uri(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def mmproj_f32(directory: Path) -> Path:
    """The tiny checkpoint's vision tower as an F32 mmproj GGUF in ``directory``."""
    from hf2q.convert.mmproj import convert_mmproj

    path = directory / "mmproj-tiny-f32.gguf"
    convert_mmproj(checkpoint("qwen3vl"), path, "f32")
    return path


@asynccontextmanager
async def vision_server(mmproj_path: Path | None, *, slots: int = 2, ctx: int = 1024, prefill_chunk: int = 32,
                        kv_dir: Path | None = None):
    """``hf2q serve``'s runtime and HTTP app over the tiny F32 GGUF (``mmproj_path`` None: no images);
    yields ``(url, chat model, runtime)``. With ``kv_dir``, ``--kv-persist`` there, drained on the way out."""
    from hf2q.actors.runtime import open_runtime
    from hf2q.api.app import ServerContext
    from hf2q.api.command import _vision, kv_store_opener, runner_factory
    from hf2q.api.server import serve
    from hf2q.api.textbridge import GGUFChatModel
    from hf2q.sched.contracts import RuntimeConfig

    path = f32_gguf("qwen3vl")
    model = GGUFChatModel.from_gguf(path, "vl")
    vision = _vision(SimpleNamespace(mmproj_path=mmproj_path, mmproj_line=""), model)
    opener = None if kv_dir is None else kv_store_opener(
        SimpleNamespace(kv_persist=str(kv_dir), kv_persist_budget=None), path, model.template_source)
    config = RuntimeConfig(slots=slots, ctx=ctx, queue_capacity=4, gpu_deadline_s=600, prefill_chunk=prefill_chunk)
    async with open_runtime(runner_factory(path, ctx, vision=vision), config, kv_store_opener=opener) as runtime, \
            trio.open_nursery() as nursery:
        assert await runtime.wait_ready(), runtime.readiness()
        ctx_ = ServerContext(runtime=runtime, chat_model=model, model_id="vl")
        handle = await nursery.start(lambda task_status: serve(ctx_, "127.0.0.1", 0, graceful_timeout=1,
                                                               task_status=task_status))
        try:
            yield handle.url, model, runtime
            if kv_dir is not None:
                assert await runtime.drain(60)  # every persisted block written before a restart
        finally:
            handle.request_stop()
            with trio.move_on_after(30):
                await handle.closed.wait()
            nursery.cancel_scope.cancel()
