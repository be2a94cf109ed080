"""The Quart (quart-trio) application: routes, auth, CORS, request ids, limits, errors.

``create_app(server)`` builds the app around a ``ServerContext`` (the runtime handle, the
served model's text side, settings). Nothing here imports MLX or touches the engine thread:
``/health`` answers from the process alone, ``/readyz`` and the gauges come from the
runtime's supervisor state (docs/API.md, "Lifecycle").

Cross-cutting rules, applied once in ``before_request`` / ``after_request``:
- every response carries ``x-request-id`` (the client's, if sane, else a fresh one);
- with an API key set, every route but the probes (``/health``, ``/readyz``) needs
  ``Authorization: Bearer <key>`` (constant-time compare; CORS pre-flights excepted because
  browsers never send credentials on them);
- CORS headers only for origins listed with ``--cors-origin`` (``*`` allows any); a POST from
  any other browser origin is refused (403), and a POST body must be ``application/json``
  (415) — together they stop a web page from driving the server through "simple" requests;
- a body whose ``Content-Length`` is over the limit is refused before a byte of it is read;
  a request refused before its body was read is answered at once and its body then drained,
  so the next request on a keep-alive connection is answered;
- parsing, template rendering and tokenization run in worker threads, never on the event
  loop, so a huge body or a slow template cannot stall ``/health``;
- ``MAX_CONTENT_LENGTH`` is raised deliberately (agent tool results are large) and
  ``RESPONSE_TIMEOUT`` is disabled so SSE streams are never cut after 60 s.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import attrs
import numpy as np
import trio
from quart import Response, g, request
from quart_trio import QuartTrio
from quart_trio.wrappers.request import TrioBody, TrioRequest
from werkzeug.exceptions import HTTPException

from hf2q.api import metrics as metrics_mod
from hf2q.api.chatflow import ChatFlow
from hf2q.api.chatmodel import ChatModel
from hf2q.api.errors import HTTP_ERROR_CODES, ApiError, error_body
from hf2q.api.validation import decode_body, parse_chat_request, parse_embeddings_request
from hf2q.sched.contracts import AdmissionRejected, EmbeddingRequest, GenerationRequest

log = logging.getLogger("hf2q.api")

_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
#: routes a load balancer's probe must reach without credentials (as llama-server's)
PROBES = frozenset({"/health", "/readyz"})
#: how long a refused request's unread body may take to arrive (and be dropped) after the refusal
DRAIN_TIMEOUT_S = 60.0


@attrs.define
class ServerContext:
    """Everything the routes need; ``hf2q serve`` and the tests build one."""

    runtime: Any  # hf2q.actors.runtime.Runtime (or a test double with the same methods)
    chat_model: ChatModel | None
    model_id: str
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_request_bytes: int = 64 << 20
    keepalive_s: float = 15.0
    embed_runtime: Any = None
    embed_model: Any = None  # has .model_id and .encode(text) -> list[int]
    kv_store: Any = None  # hf2q.kvstore.BlockStore when --kv-persist is on
    on_shutdown_requested: Callable[[], None] | None = None
    created: int = attrs.field(factory=lambda: int(time.time()))
    draining: bool = False
    metrics: metrics_mod.ServerMetrics | None = None
    #: several models under one memory budget (hf2q.actors.model_registry.ModelRegistry); None = one model
    models: Any = None

    def model_ids(self) -> list[str]:
        if self.models is not None:
            return list(self.models.entries)
        ids = [self.model_id] if self.chat_model is not None else []
        if self.embed_model is not None and self.embed_model.model_id not in ids:
            ids.append(self.embed_model.model_id)
        return ids


class _Body(TrioBody):
    """Quart's request body plus ``ended``: set when the client's body has really ended.

    Quart marks a body complete also when it outgrows the size limit (then drops the rest as
    it arrives); a refusal must wait for the real end before the exchange may finish."""

    def __init__(self, expected_content_length, max_content_length):
        super().__init__(expected_content_length, max_content_length)
        self.ended = trio.Event()
        self._appending = False

    def append(self, data: bytes) -> None:
        self._appending = True
        try:
            super().append(data)
        finally:
            self._appending = False

    def set_complete(self) -> None:
        super().set_complete()
        if not self._appending:  # not the size limit's early "complete"
            self.ended.set()


class _Request(TrioRequest):
    body_class = _Body


def _reject_from_runtime(e: AdmissionRejected) -> ApiError:
    return ApiError(e.status, e.message, code=e.code, retry_after=e.retry_after)


def create_app(ctx: ServerContext) -> QuartTrio:
    app = QuartTrio("hf2q")
    app.request_class = _Request
    app.config["MAX_CONTENT_LENGTH"] = ctx.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # SSE streams run as long as generation does
    app.config["BODY_TIMEOUT"] = 600
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    if ctx.metrics is None:
        def current_store():  # given, or opened by the runtime once the engine is known (--kv-persist)
            return ctx.kv_store if ctx.kv_store is not None else getattr(ctx.runtime, "kv_store", None)

        def disk_bytes() -> int:
            store = current_store()
            return store.stats().bytes_on_disk if store is not None else 0

        ctx.metrics = metrics_mod.ServerMetrics(_safe_snapshot(ctx.runtime), disk_bytes,
                                                lambda: ctx.runtime.readiness()[0] and not ctx.draining)
        ctx.metrics.registry.register(metrics_mod.LazyKVStoreCollector(current_store))
        if ctx.models is not None:
            ctx.metrics.snapshots.engine_gauges = False
            ctx.metrics.registry.register(metrics_mod.ModelRegistryCollector(ctx.models))
    m = ctx.metrics
    app.extensions["hf2q"] = ctx
    key = ctx.api_key.encode() if ctx.api_key else None
    # request work that must not run on the event loop; a few at a time so that a flood of huge
    # bodies queues here instead of starving the probes of CPU
    workers = trio.CapacityLimiter(4)

    async def off_loop(fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=workers, abandon_on_cancel=True)

    # ---- cross-cutting -------------------------------------------------------------------

    @app.before_request
    async def _identify_and_authorize():
        rid = request.headers.get("x-request-id", "")
        g.request_id = rid if _REQUEST_ID_OK.match(rid) else "req-" + secrets.token_hex(8)
        g.t0 = time.perf_counter()
        if request.method == "OPTIONS":
            return _preflight()
        if key is not None and request.path not in PROBES:
            got = request.headers.get("authorization", "")
            scheme, _, token = got.partition(" ")
            ok = hmac.compare_digest(token.strip().encode(), key) if scheme.lower() == "bearer" else False
            if not ok:
                raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                               code="invalid_api_key")
        if request.method == "POST":
            _check_post()
        return None

    def _check_post() -> None:
        """What a state-changing request must satisfy before its body is read."""
        origin = request.headers.get("origin")
        if origin and not _origin_allowed(origin) and not _same_origin(origin):
            raise ApiError(403, f"requests from origin {origin!r} are not allowed (start the server with "
                                f"--cors-origin {origin} to allow them)", code="origin_not_allowed")
        length = request.content_length
        if length is not None and length > ctx.max_request_bytes:
            raise ApiError(413, f"request body of {length} bytes is larger than the limit of "
                                f"{ctx.max_request_bytes} bytes", code="request_too_large")
        has_body = (length or 0) > 0 or "chunked" in request.headers.get("transfer-encoding", "").lower()
        if has_body and request.mimetype != "application/json":
            got = request.headers.get("content-type") or "none"
            raise ApiError(415, f"request body must be JSON (Content-Type: application/json), got {got}",
                           code="unsupported_media_type")

    def _same_origin(origin: str) -> bool:
        return origin in (f"http://{request.host}", f"https://{request.host}")

    def _preflight():
        origin = request.headers.get("origin")
        if not origin:
            return _json(error_body(405, "OPTIONS is only answered as a CORS pre-flight (send an Origin)",
                                    code="method_not_allowed"), 405)
        if not _origin_allowed(origin):
            return _json(error_body(403, f"origin {origin!r} is not allowed (--cors-origin)",
                                    code="origin_not_allowed"), 403)
        resp = Response("", status=204)
        resp.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        resp.headers["Access-Control-Allow-Headers"] = request.headers.get(
            "access-control-request-headers", "authorization, content-type, x-request-id")
        resp.headers["Access-Control-Max-Age"] = "600"
        return resp

    def _origin_allowed(origin: str) -> bool:
        return "*" in ctx.cors_origins or origin in ctx.cors_origins

    @app.after_request
    async def _stamp(resp: Response):
        resp.headers["x-request-id"] = getattr(g, "request_id", None) or "req-" + secrets.token_hex(8)
        origin = request.headers.get("origin")
        if origin and _origin_allowed(origin):
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Access-Control-Expose-Headers"] = "x-request-id, retry-after"
            resp.headers["Vary"] = "Origin"
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        m.requests.labels(rule, str(resp.status_code)).inc()
        return await _drain_unread_body(resp)

    async def _drain_unread_body(resp: Response) -> Response:
        """A refusal sent while the client still sends its body: answer at once, then keep
        receiving (and dropping: the body buffer stops at the size limit) until the body ends.
        Ending the exchange earlier leaves the rest of the body queued in front of the next
        request on a keep-alive connection, which then is never answered."""
        body = request.body
        if body.ended.is_set():
            return resp
        data = await resp.get_data()

        async def answer_then_drain():
            yield data
            with trio.move_on_after(DRAIN_TIMEOUT_S):
                await body.ended.wait()
        out = Response(answer_then_drain(), status=resp.status_code, headers=resp.headers)
        out.headers["Content-Length"] = str(len(data))
        out.timeout = None
        return out

    @app.errorhandler(ApiError)
    async def _api_error(e: ApiError):
        if e.status in (429, 503) or e.code in ("context_length_exceeded", "kv_budget_unsatisfiable"):
            m.rejections.labels(e.code or str(e.status)).inc()
        return _json(e.body(), e.status, e.headers())

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException):
        code = HTTP_ERROR_CODES.get(e.code or 500)
        msg = {404: f"no route {request.method} {request.path}",
               405: f"method {request.method} not allowed on {request.path}",
               413: f"request body larger than {ctx.max_request_bytes} bytes"}.get(e.code or 500, e.description)
        return _json(error_body(e.code or 500, msg, code=code), e.code or 500)

    @app.errorhandler(Exception)
    async def _internal(e: Exception):
        log.exception("internal error", extra={"request_id": getattr(g, "request_id", None)})
        return _json(error_body(500, f"internal error: {type(e).__name__}", code="internal_error"), 500)

    # ---- probes and metrics ------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return _json({"status": "ok"})

    @app.get("/readyz")
    async def readyz():
        ready, detail = ctx.runtime.readiness()
        if ctx.draining:
            ready, detail = False, "draining"
        return _json({"ready": ready, "detail": detail}, 200 if ready else 503,
                     {} if ready else {"Retry-After": "1"})

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), status=200, content_type=metrics_mod.CONTENT_TYPE)

    # ---- models ------------------------------------------------------------------------------

    def _model_card(mid: str) -> dict:
        card = {"id": mid, "object": "model", "created": ctx.created, "owned_by": "hf2q"}
        if ctx.models is not None:
            entry = ctx.models.entries[mid]
            card.update(state=entry.state, kind=entry.kind, memory_bytes=entry.need_bytes,
                        active_requests=entry.active)
            rt = entry.runtime if entry.state == "ready" else None
        else:
            rt = ctx.runtime if mid == ctx.model_id and ctx.chat_model is not None else ctx.embed_runtime
        try:
            n_ctx = rt.runner_info.get("ctx") if rt is not None else None
        except Exception:  # noqa: BLE001 — before the model loaded
            n_ctx = None
        if n_ctx:
            card["max_model_len"] = int(n_ctx)  # vLLM's name; launchers read it for client limits
        return card

    @app.get("/v1/models")
    async def models():
        return _json({"object": "list", "data": [_model_card(i) for i in ctx.model_ids()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str):
        if model_id not in ctx.model_ids():
            raise ApiError(404, f"model {model_id!r} not found", code="model_not_found", param="model")
        return _json(_model_card(model_id))

    if ctx.models is not None:
        @app.post("/v1/models/<path:model_id>/load")
        async def load_model(model_id: str):
            entry = _registry_entry(model_id, None)
            _refuse_if_draining()
            try:
                await ctx.models.load(entry)
            except AdmissionRejected as e:
                raise _reject_from_runtime(e) from None
            return _json(_model_card(model_id))

        @app.post("/v1/models/<path:model_id>/unload")
        async def unload_model(model_id: str):
            entry = _registry_entry(model_id, None)
            try:
                await ctx.models.unload(entry)
            except AdmissionRejected as e:
                raise _reject_from_runtime(e) from None
            return _json(_model_card(model_id))

    def _registry_entry(model_id: str | None, kind: str | None):
        """The registry's entry for a request's ``model`` (404 ``model_not_found`` if unknown or
        of the other kind: a chat request naming an embedding model, or the reverse)."""
        entry = ctx.models.find(model_id, kind or "chat")
        if entry is None or (kind is not None and entry.kind != kind):
            served = [e.model_id for e in ctx.models.entries.values() if kind in (None, e.kind)]
            raise ApiError(404, f"model {model_id!r} not found; this server serves {kind + ' ' if kind else ''}"
                                f"models {', '.join(served) or '(none)'}", code="model_not_found", param="model")
        return entry

    async def _lease(entry) -> Callable[[], None]:
        """Pin ``entry`` until the returned ``release()`` (idempotent) is called."""
        try:
            await ctx.models.acquire(entry)
        except AdmissionRejected as e:
            raise _reject_from_runtime(e) from None
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                ctx.models.release(entry)
        return release

    # ---- chat ----------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions():
        body = await _read_json()
        creq = parse_chat_request(body)
        entry = None
        if ctx.models is not None:
            entry = _registry_entry(creq.model, "chat")
            chat_model, model_id = entry.text, entry.model_id
        else:
            chat_model, model_id = ctx.chat_model, ctx.model_id
            if ctx.chat_model is None:
                raise ApiError(404, "this server has no chat model", code="model_not_found", param="model")
            if creq.model and creq.model not in (ctx.model_id, "default"):
                raise ApiError(404, f"model {creq.model!r} not found; this server serves {ctx.model_id!r}",
                               code="model_not_found", param="model")
        if creq.has_images and getattr(chat_model, "vision", None) is None:
            raise ApiError(400, f"model {model_id!r} does not accept image input (a text-only model, or served "
                                f"without its mmproj: hf2q serve --mmproj FILE)", code="invalid_value",
                           param=creq.images[0][0])
        _refuse_if_draining()
        release = await _lease(entry) if entry is not None else (lambda: None)
        try:
            runtime = entry.runtime if entry is not None else ctx.runtime
            info = runtime.runner_info
            prepared = await off_loop(chat_model.prepare, creq, info.get("ctx"),  # render + tokenize
                                      not info.get("trims_prefix", False))
            if creq.has_images:  # the request's images stay in the store until it ends
                release = _releasing_images(release, chat_model.vision, prepared.prompt_tokens)
            rid = g.request_id
            try:
                events = await runtime.submit(GenerationRequest(rid, prepared.prompt_tokens, prepared.params,
                                                                prepared.stable_prefix))
            except AdmissionRejected as e:
                raise _reject_from_runtime(e) from None
        except BaseException:
            release()
            raise
        flow = ChatFlow(events, prepared.new_decoder(), model_id, len(prepared.prompt_tokens),
                        want_logprobs=creq.logprobs, include_usage=creq.include_usage,
                        keepalive_s=ctx.keepalive_s, token_text=chat_model.decode_tokens)
        if not creq.stream:
            try:
                out = await flow.collect()
            finally:
                release()
                _record(flow, rid)
            return _json(out)

        async def frames():
            try:
                async with aclosing(flow.sse()) as sse:  # closed now, not at garbage collection
                    async for frame in sse:
                        yield frame
            finally:
                flow.events.close()  # the cancel signal, even if the generator never started
                release()  # the model may be evicted once its last stream ended
                _record(flow, rid)

        resp = Response(frames(), status=200, content_type="text/event-stream; charset=utf-8")
        resp.headers["Cache-Control"] = "no-cache"
        resp.headers["X-Accel-Buffering"] = "no"
        resp.timeout = None
        return resp

    def _releasing_images(release, vision, prompt):
        def both() -> None:
            if held[0]:
                held[0] = False
                vision.release(prompt)
            release()
        held = [True]
        return both

    def _record(flow: ChatFlow, rid: str) -> None:
        r = flow.result
        m.prompt_tokens.inc(r.prompt_tokens)
        m.cached_tokens.inc(r.cached_tokens)
        m.completion_tokens.inc(r.completion_tokens)
        if r.ttft_s is not None:
            m.ttft.observe(r.ttft_s)
        if r.decode_tps > 0:
            m.decode_rate.observe(r.decode_tps)
        if r.cancelled:
            m.cancellations.labels(r.cancelled).inc()
        if r.error_code:
            m.rejections.labels(r.error_code).inc()
        log.debug("chat done", extra={"request_id": rid, "finish": r.finish_reason, "prompt": r.prompt_tokens,
                                     "cached": r.cached_tokens, "completion": r.completion_tokens,
                                     "ttft_ms": round(r.ttft_s * 1000, 1) if r.ttft_s else None,
                                     "cancelled": r.cancelled, "error": r.error_code})

    def _refuse_if_draining():
        if ctx.draining:
            raise ApiError(503, "server is shutting down", code="not_ready")

    # ---- embeddings ------------------------------------------------------------------------------

    @app.post("/v1/embeddings")
    async def embeddings():
        body = await _read_json()
        ereq = parse_embeddings_request(body)
        if ctx.models is not None:
            entry = _registry_entry(ereq.model, "embedding")
            embed_model = entry.text
        else:
            entry, embed_model = None, ctx.embed_model
            if ctx.embed_model is None or ctx.embed_runtime is None:
                raise ApiError(404, "this server has no embedding model (start it with --embedding-model)",
                               code="model_not_found", param="model")
            if ereq.model and ereq.model not in (ctx.embed_model.model_id, "default"):
                raise ApiError(404, f"model {ereq.model!r} not found; embeddings use {ctx.embed_model.model_id!r}",
                               code="model_not_found", param="model")
        _refuse_if_draining()

        def tokenize():
            return tuple(tuple(x) if isinstance(x, tuple) else tuple(embed_model.encode(x))
                         for x in ereq.inputs)
        inputs = await off_loop(tokenize)
        release = await _lease(entry) if entry is not None else (lambda: None)
        try:
            runtime = entry.runtime if entry is not None else ctx.embed_runtime
            vecs = await runtime.embed(EmbeddingRequest(g.request_id, inputs))
        except AdmissionRejected as e:
            err = _reject_from_runtime(e)
            if e.status == 400:
                err.param = "input"
            raise err from None
        finally:
            release()
        vecs = np.asarray(vecs, dtype=np.float32)
        if ereq.dimensions is not None and ereq.dimensions < vecs.shape[1]:
            vecs = vecs[:, : ereq.dimensions]
            vecs = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
        data = []
        for i, v in enumerate(vecs):
            emb: Any = (base64.b64encode(v.astype("<f4").tobytes()).decode() if ereq.encoding_format == "base64"
                        else [float(x) for x in v])
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(x) for x in inputs)
        m.prompt_tokens.inc(n)
        return _json({"object": "list", "data": data, "model": embed_model.model_id,
                      "usage": {"prompt_tokens": n, "total_tokens": n}})

    # ---- lifecycle ---------------------------------------------------------------------------------

    @app.post("/shutdown")
    async def shutdown():
        first = not ctx.draining
        ctx.draining = True
        if first and ctx.on_shutdown_requested is not None:
            ctx.on_shutdown_requested()
        return _json({"status": "draining"}, 202)

    async def _read_json() -> Any:
        raw = await request.get_data(cache=False)
        return await off_loop(decode_body, raw)

    return app


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    resp = Response(json.dumps(obj, ensure_ascii=False), status=status, content_type="application/json")
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def _safe_snapshot(runtime) -> Callable[[], Any]:
    def snap():
        try:
            return runtime.snapshot()
        except Exception:  # noqa: BLE001 — a scrape must answer even while the runtime starts
            return None
    return snap
