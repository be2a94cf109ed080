"""``hf2q serve --model A.gguf --model B.gguf … --models-memory SIZE``: several models, one server.

The start-up checks of one model (``command.py``) run for each, in the main thread and
without MLX; each model's memory figure is the memory plan's weights + KV budget for the
server's settings (what ``hf2q info`` prints). A budget that cannot hold every model alone
is refused (exit 3) — such a model could never be served. Then a ``ModelRegistry`` loads
models on demand (docs/API.md, "Several models"); nothing is loaded before a request or
``POST /v1/models/{id}/load`` asks for it. Encoder GGUFs among the models serve
``/v1/embeddings``; ``--embedding-model`` adds one more.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from pathlib import Path

import trio

from hf2q.api.command import (_size_hint, _watch_signals, check_gguf, check_kv_budget, check_kv_cache_type,
                               check_model_kind, runner_factory, vision_for)
from hf2q.errors import InputError, UsageError
from hf2q.logs import log_format

log = logging.getLogger("hf2q.serve")


def model_args(args) -> list[str]:
    """``--model`` values (repeatable; a plain string from callers that build ``args`` themselves)."""
    m = args.model
    return [] if not m else [m] if isinstance(m, str) else list(m)


def wants_several(args) -> bool:
    return len(model_args(args)) > 1 or getattr(args, "models_memory", None) is not None


def run_serve(args) -> int:
    """``hf2q serve``: several models here, one model as ever (``command.run``)."""
    if wants_several(args):
        return run(args)
    from hf2q.api.command import run as run_one

    return run_one(args)


class RegistryRuntime:
    """What the app's probes and drain call ``ctx.runtime`` when a registry serves the models:
    ready while the registry runs (models load on demand), draining every resident model."""

    def __init__(self, registry):
        self._registry = registry
        self.kv_store = None
        self.runner_info: dict = {}

    def readiness(self) -> tuple[bool, str]:
        if self._registry.stopping:
            return False, "draining"
        return True, "ready"

    def snapshot(self):
        return None  # per-engine gauges are per model here: see the hf2q_model_* metrics

    async def drain(self, timeout: float) -> bool:
        return await self._registry.drain(timeout)


def _refuse_flags(args) -> None:
    for flag, value, default in (("--tensor-parallel", args.tensor_parallel, 1),
                                 ("--kv-persist", args.kv_persist, None),
                                 ("--model-name", args.model_name, None),
                                 ("--hostfile", getattr(args, "hostfile", None), None),
                                 ("--hosts", getattr(args, "hosts", None), None)):
        if value != default:
            raise UsageError(f"{flag} is for a single --model; with several models each is served "
                             f"by its file name and alone on its device")


def assign_mmprojs(headers: dict[str, object], named: Path | None,
                   lines: list[str] | None = None) -> dict[str, Path]:
    """model id → the vision projector it serves images through: ``--mmproj`` goes to the one chat
    model it fits (refused when it fits none or several), every other vision model takes the one
    found beside it by name (``engine.vision.mmproj_match``). Text-only models get none. ``lines``
    collects what the operator is told about each vision model."""
    from hf2q.engine.vision.mmproj_match import PROJECTORS, choose_mmproj, misfit
    from hf2q.formats.gguf_file import open_gguf

    out: dict[str, Path] = {}
    if named is not None:
        projector = open_gguf(named)
        fits = [mid for mid, h in headers.items() if h.arch in PROJECTORS and misfit(h, projector) is None]
        if not fits:
            raise InputError(f"--mmproj: {named.name} fits none of the models "
                             f"({', '.join(headers)}); it needs a vision model of its embedding width")
        if len(fits) > 1:
            raise UsageError(f"--mmproj: {named.name} fits {' and '.join(fits)}; put each model's projector "
                             f"beside it as mmproj-*.gguf instead")
        out[fits[0]] = named
        if lines is not None:
            lines.append(f"{fits[0]}: vision projector {named} (--mmproj)")
    for mid, header in headers.items():
        if mid not in out:
            path, line = choose_mmproj(header, None)
            if path is not None:
                out[mid] = path
            if line and lines is not None:
                lines.append(f"{mid}: {line}")
    return out


def plan_models(args):
    """Check every model and measure it: ``[(path, model_id, kind, need_bytes)]`` and the budget
    (and ``args.mmprojs``: model id → its vision projector)."""
    from hf2q.api.command import check_memory
    from hf2q.engine.memory_plan import DEFAULT_FRACTION, check_model, device_memory
    from hf2q.formats.gguf_check import check_servable
    from hf2q.formats.gguf_file import open_gguf

    _refuse_flags(args)
    paths = [(check_gguf(Path(p).expanduser()), "--model") for p in model_args(args)]
    if args.embedding_model:
        paths.append((check_gguf(Path(args.embedding_model).expanduser(), "--embedding-model"),
                      "--embedding-model"))
    plans, seen, chat_headers = [], {}, {}
    for path, flag in paths:
        model_id = path.stem
        if model_id in seen:
            raise UsageError(f"{flag}: two models would both be served as {model_id!r} "
                             f"({seen[model_id]} and {path}); rename one file")
        seen[model_id] = path
        header = open_gguf(path)
        check_servable(header)
        encoder = header.hparams.is_encoder
        if flag == "--embedding-model":
            check_model_kind(header, path, flag)
        if encoder:
            need = check_model(header, 1, ctx=None, slots=1, kv_budget=None, limit=args.memory_limit)
        else:
            check_kv_budget(header, args)
            check_kv_cache_type(header, args)
            from hf2q.engine.speculative import check_speculative

            check_speculative(header, args)  # --speculative mtp: every chat model needs its nextn block
            need = check_memory(header, args)
            chat_headers[model_id] = header
        plans.append((path, model_id, "embedding" if encoder else "chat", need.total))
    named = check_gguf(Path(args.mmproj).expanduser(), "--mmproj") if getattr(args, "mmproj", None) else None
    args.mmproj_lines = []
    args.mmprojs = assign_mmprojs(chat_headers, named, args.mmproj_lines)
    budget = args.models_memory
    if budget is None:
        budget = args.memory_limit or int(device_memory() * DEFAULT_FRACTION)
    smallest = min(plans, key=lambda p: p[3])
    if budget < smallest[3]:
        raise InputError(f"--models-memory {_size_hint(budget)} is smaller than the smallest model: "
                         f"{smallest[1]} needs {_size_hint(smallest[3])} (weights + KV budget at these "
                         f"--ctx/--slots)")
    for _, model_id, _, need in plans:
        if need > budget:
            raise InputError(f"--models-memory {_size_hint(budget)} cannot hold {model_id}, which needs "
                             f"{_size_hint(need)} (weights + KV budget); raise it or lower --ctx/--slots")
    return plans, budget


def run(args) -> int:
    from hf2q.actors.model_registry import Entry
    from hf2q.api.server import check_port_free
    from hf2q.api.textbridge import GGUFChatModel, GGUFEmbeddingModel
    from hf2q.engine.speculative import draft_tokens_arg
    from hf2q.sched.contracts import RuntimeConfig

    plans, budget = plan_models(args)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be 0..65535, got {args.port}")
    check_port_free(args.host, args.port)
    chat_config = RuntimeConfig(slots=args.slots, ctx=args.ctx, kv_budget_bytes=args.kv_cache_budget,
                                queue_capacity=args.queue_capacity, prefill_chunk=args.prefill_chunk,
                                gpu_deadline_s=args.gpu_deadline, draft_tokens=draft_tokens_arg(args))
    embed_config = RuntimeConfig(slots=1, queue_capacity=64, gpu_deadline_s=args.gpu_deadline)
    entries = []
    for path, model_id, kind, need in plans:
        chat = kind == "chat"
        text = GGUFChatModel.from_gguf(path, model_id) if chat else GGUFEmbeddingModel.from_gguf(path, model_id)
        mmproj = args.mmprojs.get(model_id)
        vision = vision_for(mmproj, text) if mmproj is not None else None
        entries.append(Entry(model_id, path, kind, need, text, chat_config if chat else embed_config,
                             partial(runner_factory, path, args.ctx, 1, args, vision) if chat
                             else partial(runner_factory, path, None)))
    trio.run(partial(_serve, args, entries, budget))
    from hf2q.actors.engine_thread import leave_if_engine_busy

    leave_if_engine_busy()  # as one model's serve: a stop during a load must not abort at exit
    return 0


async def _serve(args, entries, budget: int) -> None:
    from hf2q.actors.model_registry import ModelRegistry
    from hf2q.api.app import ServerContext
    from hf2q.api.operator import EventLogger, choose_mode, run_models_dashboard
    from hf2q.api.server import serve

    for name in ("hf2q.serve", "hf2q.api", "hf2q.operator"):
        lg = logging.getLogger(name)
        if lg.getEffectiveLevel() > logging.INFO:
            lg.setLevel(logging.INFO)
    mode = choose_mode(getattr(args, "operator_ui", "plain"), log_format())
    for line in args.mmproj_lines:
        log.info(line)  # which vision projector serves each vision model's images, or why none
    if mode != "dashboard":  # the dashboard's rows replace the per-request lines
        for entry in entries:
            entry.on_loaded = lambda runtime: runtime.add_event_hook(EventLogger())
    registry = ModelRegistry(entries, budget, args.models_wait)
    chat = next((e for e in entries if e.kind == "chat"), None)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        ctx = ServerContext(runtime=RegistryRuntime(registry), chat_model=chat.text if chat else None,
                            model_id=chat.model_id if chat else entries[0].model_id,
                            api_key=args.api_key or None, cors_origins=tuple(args.cors_origin),
                            max_request_bytes=args.max_request_bytes, models=registry)
        handle = await nursery.start(partial(serve, ctx, args.host, args.port))
        ids = ", ".join(e.model_id for e in entries)
        if log_format() == "json":
            log.info("listening", extra={"url": handle.url, "models": ids, "models_memory": budget})
        else:
            print(f"hf2q serve: {handle.url} models {ids} (loaded on demand within {budget} bytes) "
                  f"slots {args.slots}{' auth on' if args.api_key else ''}", file=sys.stderr, flush=True)
        nursery.start_soon(_watch_signals, handle, nursery.cancel_scope)
        if mode == "dashboard":
            nursery.start_soon(partial(run_models_dashboard, registry, url=handle.url))
        await handle.closed.wait()
        nursery.cancel_scope.cancel()
