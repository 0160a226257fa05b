"""The OpenAI-compatible app: routes, SSE streaming, the API key, OpenAI-style errors and metrics.

    POST /v1/completions, /v1/chat/completions    JSON, or with "stream": SSE chunks then `data: [DONE]`
    GET  /v1/models                               the one model this process serves
    GET  /health                                  200 once the engines are loaded and warmed up, 503 before
    GET  /metrics                                 Prometheus text (runtime/serve/metrics.py)

What the process holds (scheduler, engines, metrics) is made in the app's lifespan, not by
``create_app``: a Ray Serve replica receives the app by value and opens engines of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.serve.jobs import Generation, Job
from xcompile.runtime.serve.metrics import Metrics
from xcompile.runtime.serve.protocol import ChatCompletionRequest, CompletionRequest, ServeError, error_body
from xcompile.runtime.serve.reply import Reply
from xcompile.runtime.serve.scheduler import Scheduler
from xcompile.runtime.serve.worker import EngineWorker, ServeConfig

log = logging.getLogger("xcompile.serve")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
CLIENT_GONE = 499           # status recorded for a request whose client disconnected (nginx's convention)


def create_app(config: ServeConfig, *, open_worker: Callable[[ServeConfig], EngineWorker] = EngineWorker,
               background_load: bool = True, on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """The app over ``config``'s engine dir. Its engines load once it starts: in the background, the
    server answering 503 meanwhile (``on_load_error(message)`` if loading fails), or, with
    ``background_load=False``, before it takes requests (a Ray replica is ready when loaded, and fails
    to start if loading fails). ``open_worker`` opens them (tests wrap it)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # anyio imports its asyncio backend on first use, and the first is a streamed response's task group: the
        # first request after ready paid for it (its server time 17.5-19.8 ms against 12.0-14.2 with this line,
        # demo dir on the 2-core CPU, 2026-12-07). One task group here, before the port opens, pays instead.
        async with anyio.create_task_group():
            pass
        sched = app.state.scheduler = Scheduler(config, open_worker)
        app.state.metrics = Metrics(lambda: sched.waiting, sched.busy)
        sched.on_step = app.state.metrics.step
        unwatch = app.state.metrics.watch_gc()
        loading = asyncio.create_task(_load(sched, on_load_error))
        try:
            if not background_load:
                await loading
                if sched.load_error:
                    raise EngineError(sched.load_error)
            yield
        finally:
            unwatch()
            await loading
            await sched.close()

    app = FastAPI(title="xcompile", lifespan=lifespan)
    app.add_middleware(_CountResponses)
    # every handler async: Starlette runs a plain def one on its thread pool, a thread hop for each refused
    # request (a burst's 429s and 404s) that waits for the GIL while the engine thread holds it
    app.add_exception_handler(ServeError, _refused)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _failed)

    # async: FastAPI runs a plain def dependency on its thread pool, a thread hop a request that waits for the GIL
    # while the engine thread holds it
    async def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
            raise ServeError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (--api-key)",
                             code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(request, body, "text_completion", body.prompts(), "prompt")

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = [m.as_template_input() for m in body.messages]
        return await _answer(request, body, "chat.completion", [messages], "messages")

    @v1.get("/models")
    async def models(request: Request):
        worker = request.app.state.scheduler.ready()
        return {"object": "list", "data": [{"id": worker.model_name, "object": "model", "created": 0,
                                            "owned_by": "xcompile", "max_model_len": worker.max_seq_len}]}

    app.include_router(v1)

    @app.get("/health")
    async def health(request: Request):
        worker = request.app.state.scheduler.ready()
        es = worker.es
        return {"status": "ok", "model": worker.model_name, "backend": es.backend, "device": str(es.device),
                "drafter": worker.spec.label, "pid": os.getpid()}

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(request.app.state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _load(sched: Scheduler, on_load_error: Callable[[str], None] | None) -> None:
    await sched.load()
    if sched.load_error:
        if on_load_error is not None:       # the caller reports it (xrun serve: its one error line, on exit)
            on_load_error(sched.load_error)
        else:
            log.error("engines failed to load: %s", sched.load_error)
        return
    w = sched.worker
    batch = w.es.manifest.max_batch
    steps = f" (batch steps: {w.llm.batch_spec.label})" if w.batch is not None else ""
    log.info("serving %s: %s on %s, drafter %s, batch %d%s", w.model_name, w.es.backend, w.es.device, w.spec.label,
             batch if w.batch is not None else 1, steps)


async def _refused(request: Request, e: ServeError) -> JSONResponse:
    return JSONResponse(e.body(), e.status)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(e.status_code, str(e.detail)), e.status_code)


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    """pydantic's complaints as one OpenAI-style 400 (FastAPI's default is a 422 of its own shape)."""

    def where(err: dict) -> str | None:
        if err["type"] == "json_invalid":
            return None
        return ".".join(str(p) for p in err["loc"] if p != "body") or None

    def say(err: dict) -> str:
        if err["type"] == "json_invalid":
            return f"the body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})"
        return f"{where(err) or 'body'}: {err['msg']}"

    errors = e.errors()
    return JSONResponse(error_body(400, "; ".join(map(say, errors[:5])), where(errors[0]) if errors else None), 400)


async def _failed(request: Request, e: Exception) -> JSONResponse:
    """Anything unforeseen: an OpenAI-style 500 (uvicorn logs the traceback); the server keeps serving."""
    return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), 500)


class _CountResponses:
    """ASGI middleware counting each response by route and status as it starts (a stream's status is
    its first line's; how its generations ended is in xcompile_generations_total), and noting when each request
    reached the app (``request.state.arrived``, time.monotonic()): a job's TTFT counts from there, its body's
    parse, checks and tokenizing included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrived"] = time.monotonic()

        async def counted(message):
            if message["type"] == "http.response.start":
                route = scope["path"] if scope["path"] in ROUTES else "other"
                scope["app"].state.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def _check(body, worker: EngineWorker) -> None:
    """What the request model alone cannot say: the model name, fields not implemented."""
    if body.model is not None and body.model != worker.model_name:
        raise ServeError(404, f"model {body.model!r} not found; this server serves {worker.model_name!r}",
                         "model", "model_not_found")
    body.check_fields()


def _max_tokens(body, prompt_tokens: int, max_seq_len: int) -> int:
    """Tokens each choice may generate after its prompt (the longest: ``prompt_tokens``). A budget the
    request names (max_completion_tokens, else max_tokens) must fit the engine's context with the prompt,
    as vLLM and OpenAI check: a 400 context_length_exceeded, not a silent cap. Without one, chat generates
    to the context's end (finish_reason "length" there) and completions take OpenAI's default of 16,
    capped at the room left. ``encode`` has checked that the prompt leaves room for a round."""
    room = max_seq_len - prompt_tokens
    for name in ("max_completion_tokens", "max_tokens"):
        asked = getattr(body, name, None)
        if asked is None or name not in body.model_fields_set:
            continue
        if asked > room:
            raise ServeError(400, f"{name} {asked} after a prompt of {prompt_tokens} tokens exceeds this model's "
                                  f"context of {max_seq_len} tokens (the engine's max_seq_len); ask for at most "
                                  f"{room} or shorten the prompt", name, "context_length_exceeded")
        return asked
    return room if body.max_tokens is None else min(body.max_tokens, room)


async def _answer(request: Request, body, kind: str, prompts: list, param: str):
    sched: Scheduler = request.app.state.scheduler
    worker = sched.ready()
    _check(body, worker)
    ids = [worker.encode(p, param) for p in prompts]
    max_tokens = _max_tokens(body, max(map(len, ids)), worker.max_seq_len)
    sampling = body.sampling()
    job = Job([Generation(p, max_tokens, body.stop, sampling, j) for p in ids for j in range(body.n)],
              sched.deadline(), arrived=getattr(request.state, "arrived", time.monotonic()))
    reply = Reply(kind, body, worker, ids, request.app.state.metrics, job, sampling.seed)
    events = sched.run(job)
    await anext(events)                     # admitted (or ServeError 429 as an HTTP error, before any stream)
    reply.metrics.prompt_tokens.inc(reply.prompt_tokens)
    if body.stream:
        return StreamingResponse(reply.sse(events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    collect = asyncio.ensure_future(reply.collect(events))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not collect.done():                  # the client left: cancel (the scheduler frees the device)
        collect.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collect
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(collect.result())


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is read by now, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
