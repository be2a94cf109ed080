"""``hf2q serve``: load a GGUF, start the actor runtime, serve the OpenAI API until told to stop.

Order matters for clear failures: the model path and the port are checked before
anything heavy starts (missing/invalid model → exit 3, busy port → exit 1, both one line).
The model then loads in the GPU-owner thread while the server already answers
``/health`` (200) and ``/readyz`` (503 until loaded). A model that fails to load stops
the server with exit 1. SIGTERM, SIGINT and ``POST /shutdown`` drain gracefully; a second
SIGINT stops at once.

This module never imports MLX: the runner factory imports the engine inside the
GPU-owner thread when the runtime calls it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import trio

from hf2q.errors import ConversionError, InputError, UsageError
from hf2q.logs import log_format

log = logging.getLogger("hf2q.serve")


def check_gguf(path: Path, flag: str = "--model") -> Path:
    if not path.exists():
        raise InputError(f"{flag}: model file not found: {path}")
    if not path.is_file():
        raise InputError(f"{flag}: not a file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InputError(f"{flag}: cannot read {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise InputError(f"{flag}: {path} is not a GGUF file")
    return path


def check_model_kind(header, path: Path, flag: str) -> None:
    """``--model`` must be a generating model and ``--embedding-model`` an encoder (exit 3 at
    start): the wrong kind would load and then fail every request of its route."""
    encoder = header.hparams.is_encoder
    if flag == "--model" and encoder:
        raise InputError(f"--model: {path.name} is an embedding model ({header.arch}); serve it with "
                         f"--embedding-model next to a chat model")
    if flag == "--embedding-model" and not encoder:
        raise InputError(f"--embedding-model: {path.name} is a {header.arch or 'unknown'} text-generation "
                         f"model, not an embedding model; serve it with --model")


def check_kv_cache_type(header, args) -> None:
    """``--kv-cache-type`` the model's family and the server's layout can hold, checked before loading."""
    from hf2q.engine.kv_layout import check_kv_type
    from hf2q.formats.gguf_keys import Keys

    kv_type = getattr(args, "kv_cache_type", "f16")
    hp = header.hparams
    swa = hp.stored(Keys.Attention.KEY_LENGTH_SWA)  # gemma4's sliding layers have their own head size
    check_kv_type(kv_type, (hp.key_length, hp.value_length, *([int(swa)] if swa else [])), header.arch)


def check_kv_budget(header, args) -> None:
    """A ``--kv-cache-budget`` below what a one-token prompt and a one-token answer need would
    refuse every request; say so at start (exit 2)."""
    if args.kv_cache_budget is None:
        return
    from hf2q.engine.device_probe import probe
    from hf2q.engine.memory_plan import kv_need

    elem, kv_type = probe().activation_bytes(), getattr(args, "kv_cache_type", "f16")
    per_token = kv_need(header.hparams, elem, kv_type=kv_type,
                        mtp=getattr(args, "speculative", "off") == "mtp").per_token
    if args.kv_cache_budget < 2 * per_token:
        raise UsageError(f"--kv-cache-budget {args.kv_cache_budget} bytes is too small: one token of KV takes "
                         f"{per_token} bytes for this model, and a request needs at least 2 tokens "
                         f"(use e.g. {_size_hint(per_token * (args.ctx or header.hparams.n_ctx_train))} "
                         f"for one slot's full context)")


def _size_hint(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{-(-n // (1 << shift))}{unit}"
    return str(n)


def check_memory(model, args):
    """Refuse (exit 3) a model whose weights + KV budget exceed what one rank may use."""
    from hf2q.engine.memory_plan import check_model
    from hf2q.engine.speculative import draft_model
    from hf2q.sched.transactions import transaction_tokens

    return check_model(model, args.tensor_parallel, ctx=args.ctx, slots=args.slots, kv_budget=args.kv_cache_budget,
                       limit=args.memory_limit, prefill_chunk=transaction_tokens(model.arch, args.prefill_chunk),
                       kv_type=getattr(args, "kv_cache_type", "f16"), mtp=getattr(args, "speculative", "off") == "mtp",
                       kv_persist=bool(getattr(args, "kv_persist", None)), draft=draft_model(args))


def runner_factory(path: Path, ctx: int | None, tensor_parallel: int = 1, args=None, vision=None):
    """Called inside the GPU-owner thread: the only place the serving path touches MLX.

    ``vision``: ``(mmproj path, ImageStore)`` — the runner then encodes the images the store holds.

    With ``tensor_parallel > 1`` the runner is rank 0 of a group that
    ``hf2q.engine.tp_launch`` starts (docs/TENSOR_PARALLEL.md).
    """
    if tensor_parallel > 1:
        from hf2q.engine.tp_launch import runner_factory as tp_runner_factory

        load = tp_runner_factory(path, tensor_parallel, ctx, getattr(args, "tp_hosts", None),
                                 getattr(args, "tp_timeout", 600.0), getattr(args, "kv_cache_type", "f16"))
    else:
        def load():
            from hf2q.engine.factory import load_runner

            return load_runner(path, ctx, getattr(args, "kv_cache_type", "f16"))  # readies the process for MLX (the fast BLAS) first

    def build():
        from hf2q.engine.runner import warm_up

        runner = load()
        if getattr(args, "speculative", "off") == "mtp":
            # before any sequence: the head keeps K/V rows of its own (deepseek4's from --model-draft)
            from hf2q.engine.speculative import draft_model

            runner.enable_mtp(draft_model(args))
        if vision is not None:
            from hf2q.engine.vision.qwen3vl import Qwen3VLVisionEncoder
            from hf2q.formats.gguf_file import open_gguf

            from hf2q.engine.vision.prompt_images import warm_up_images

            runner.attach_vision(Qwen3VLVisionEncoder(open_gguf(vision[0]), runner.dtype), vision[1])
            warm_up_images(runner)
        warm_up(runner)  # first-use kernel compilation happens before /readyz says ready
        return runner
    return build


def kv_store_opener(args, model_path: Path, chat_template: str | None):
    """With ``--kv-persist``: check the directory and the model now (exit 3 before loading) and
    return ``opener(kv_identity) -> BlockStore`` for the runtime, which calls it once the engine
    has loaded — the fingerprint includes the engine's identity (backend, device, KV dtype), so
    blocks written by a CPU server are never imported by a GPU one. None without the flag."""
    if not args.kv_persist:
        return None
    import os

    from hf2q.kvstore.blockfile import FORMAT_VERSION
    from hf2q.kvstore.fingerprint import gguf_content_hash, model_fingerprint
    from hf2q.kvstore.store import BlockStore

    root = Path(args.kv_persist).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--kv-persist: cannot use {str(root)!r}: {e.strerror or e}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise InputError(f"--kv-persist: {str(root)!r} is not writable")
    if args.kv_persist_budget is not None and args.kv_persist_budget < 0:
        raise InputError(f"--kv-persist-budget must not be negative: {args.kv_persist_budget}")
    gguf_content_hash(model_path)  # memoised: the opener's fingerprint reuses it

    def open_store(kv_identity: str):
        fp = model_fingerprint(model_path, None, chat_template, FORMAT_VERSION, kv_identity=kv_identity)
        return BlockStore.open(root, fp, args.kv_persist_budget,
                               payload_kind=getattr(args, "kv_persist_payload", None) or "kv")
    return open_store


def preflight(args) -> tuple[Path, Path | None]:
    """The start-up checks, in the main thread and without MLX (the device's memory comes from
    ``engine.device_probe``): the model files, the tensor-parallel split, the memory plan, the port.
    Returns ``(model_path, embedding_model_path)``; any refusal is an ``InputError`` (exit 3)."""
    from hf2q.api.server import check_port_free

    if args.model:
        model_path = check_gguf(Path(args.model if isinstance(args.model, str) else args.model[0]).expanduser())
    else:
        from hf2q.fetch import default_chat_model

        model_path = check_gguf(default_chat_model())
    embed_path = check_gguf(Path(args.embedding_model).expanduser(), "--embedding-model") \
        if args.embedding_model else None
    from hf2q.formats.gguf_check import check_servable
    from hf2q.formats.gguf_file import open_gguf

    header = open_gguf(model_path)  # parsed once for the start-up checks
    check_model_kind(header, model_path, "--model")
    check_servable(header)  # what `hf2q info` reports: no defect reaches the engine
    check_kv_cache_type(header, args)
    from hf2q.engine.speculative import check_speculative

    check_speculative(header, args)  # --speculative mtp needs the file's nextn block
    if embed_path is not None:
        embed_header = open_gguf(embed_path)
        check_model_kind(embed_header, embed_path, "--embedding-model")
        check_servable(embed_header)
    check_kv_budget(header, args)
    from hf2q.engine.vision.mmproj_match import choose_mmproj

    named = check_gguf(Path(args.mmproj).expanduser(), "--mmproj") if getattr(args, "mmproj", None) else None
    args.mmproj_path, args.mmproj_line = choose_mmproj(header, named)  # at TP > 1, rank 0 encodes
    from hf2q.engine.tp_hosts import group_size, hosts_from_args

    args.tp_hosts = hosts_from_args(args)  # --hostfile / --hosts: one rank per host
    if args.tp_hosts is not None:
        args.tensor_parallel = group_size(args.tensor_parallel, args.tp_hosts)
    if args.tensor_parallel > 1:
        from hf2q.engine.tp_launch import plan_split

        plan_split(header, args.tensor_parallel)  # a model that cannot split N ways: exit 3 before starting
    check_memory(header, args)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be 0..65535, got {args.port}")
    check_port_free(args.host, args.port)
    return model_path, embed_path


def run(args) -> int:
    model_path, embed_path = preflight(args)
    from hf2q.api.textbridge import GGUFChatModel, GGUFEmbeddingModel

    model_id = args.model_name or model_path.stem
    chat_model = GGUFChatModel.from_gguf(model_path, model_id)
    embed_model = GGUFEmbeddingModel.from_gguf(embed_path, embed_path.stem) if embed_path else None
    args.vision = _vision(args, chat_model)
    opener = kv_store_opener(args, model_path, getattr(chat_model, "template_source", None))
    failure = trio.run(partial(_serve, args, model_path, chat_model, embed_path, embed_model, opener))
    if failure:
        raise ConversionError(failure)
    from hf2q.actors.engine_thread import leave_if_engine_busy

    leave_if_engine_busy()  # stopped while loading (or stuck): finalizing would abort under it
    return 0


def _vision(args, chat_model):
    """``(mmproj path, ImageStore)`` for the runner, with the chat model's image side set; None without one."""
    if getattr(args, "mmproj_path", None) is None:
        return None
    return vision_for(args.mmproj_path, chat_model)


def vision_for(mmproj_path: Path, chat_model):
    """Serve images with ``chat_model`` through ``mmproj_path``: its image side set on the chat model,
    and the ``(mmproj path, ImageStore)`` its runner factory takes (a store of its own per model)."""
    from hf2q.api.images import VisionInput
    from hf2q.engine.vision.prompt_images import ImageStore
    from hf2q.formats.gguf_file import open_gguf

    store = ImageStore()
    chat_model.vision = VisionInput.from_mmproj(open_gguf(mmproj_path), chat_model.tokenizer, store)
    return mmproj_path, store


async def _serve(args, model_path: Path, chat_model, embed_path, embed_model, kv_opener) -> str | None:
    """Run until stopped; returns a failure message (model failed to load) or None."""
    from hf2q.sched.contracts import RuntimeConfig
    from hf2q.actors.runtime import open_runtime
    from hf2q.api.app import ServerContext
    from hf2q.api.operator import (
        EventLogger,
        choose_mode,
        run_dashboard,
        run_status_lines,
    )
    from hf2q.api.server import serve
    from hf2q.engine.speculative import draft_tokens_arg

    mode = choose_mode(args.operator_ui, log_format())
    # the operator needs to see serving events even without -v (the dashboard replaces them on a TTY)
    for name in ("hf2q.serve", "hf2q.api", "hf2q.operator", "hf2q.kvstore"):
        lg = logging.getLogger(name)
        if lg.getEffectiveLevel() > logging.INFO:
            lg.setLevel(logging.INFO)
    if getattr(args, "mmproj_line", ""):
        log.info(args.mmproj_line)  # which vision projector serves the model's images, or why none

    config = RuntimeConfig(slots=args.slots, ctx=args.ctx, kv_budget_bytes=args.kv_cache_budget,
                           queue_capacity=args.queue_capacity, prefill_chunk=args.prefill_chunk,
                           gpu_deadline_s=args.gpu_deadline, draft_tokens=draft_tokens_arg(args))
    failure: list[str] = []
    # with an embedding model beside the chat model both engines run in one thread (docs/ARCHITECTURE.md)
    engine_thread = None
    if embed_path is not None and args.tensor_parallel == 1:
        from hf2q.actors.shared_engine import SharedEngineThread

        engine_thread = SharedEngineThread()
    async with AsyncExitStack() as stack:
        if engine_thread is not None:
            stack.callback(engine_thread.close)
        runtime = await stack.enter_async_context(
            open_runtime(runner_factory(model_path, args.ctx, args.tensor_parallel, args, getattr(args, "vision", None)),
                         config,
                         kv_store_opener=kv_opener, engine_thread=engine_thread and engine_thread.lane))
        embed_runtime = None
        if embed_path is not None:
            embed_runtime = await stack.enter_async_context(
                open_runtime(runner_factory(embed_path, None), RuntimeConfig(slots=1, queue_capacity=64,
                                                                              gpu_deadline_s=args.gpu_deadline),
                             engine_thread=engine_thread and engine_thread.lane))
        if mode != "dashboard":
            runtime.add_event_hook(EventLogger())
        ctx = ServerContext(runtime=runtime, chat_model=chat_model, model_id=chat_model.model_id,
                            api_key=args.api_key or None, cors_origins=tuple(args.cors_origin),
                            max_request_bytes=args.max_request_bytes, embed_runtime=embed_runtime,
                            embed_model=embed_model)  # the KV store, if any, is the runtime's
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(partial(serve, ctx, args.host, args.port))
            if log_format() == "json":
                log.info("listening", extra={"url": handle.url, "model": chat_model.model_id, "slots": args.slots})
            else:
                print(f"hf2q serve: {handle.url} model {chat_model.model_id} ({model_path}) slots {args.slots}"
                      f"{' auth on' if args.api_key else ''}", file=sys.stderr, flush=True)
            nursery.start_soon(_watch_signals, handle, nursery.cancel_scope)
            nursery.start_soon(_watch_load, runtime, handle, failure, "model")
            if embed_runtime is not None:
                nursery.start_soon(_watch_load, embed_runtime, handle, failure, "embedding model")
            if mode == "dashboard":
                nursery.start_soon(partial(run_dashboard, runtime, model_id=chat_model.model_id, url=handle.url))
            else:
                nursery.start_soon(run_status_lines, runtime)
            await handle.closed.wait()
            nursery.cancel_scope.cancel()
    return failure[0] if failure else None


async def _watch_load(runtime, handle, failure: list[str], what: str) -> None:
    if await runtime.wait_ready():
        log.info(f"{what} loaded; ready", extra={"url": handle.url})
        return
    _, detail = runtime.readiness()
    failure.append(f"{what} failed to load: {detail}")
    handle.request_stop()


async def _watch_signals(handle, scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        first = True
        async for signum in signals:
            if first:
                log.info("signal received; draining", extra={"signal": signal.Signals(signum).name})
                handle.request_stop()
                first = False
            else:
                scope.cancel()  # second signal: stop now
                return
