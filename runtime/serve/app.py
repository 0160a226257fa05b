"""The OpenAI-compatible app: routes, SSE streaming, the API key, OpenAI-style errors and metrics.

    POST /v1/completions, /v1/chat/completions    JSON, or with "stream": SSE chunks then `data: [DONE]`
    GET  /v1/models                               the one model this process serves
    GET  /health                                  200 when the engines are loaded, 503 before
    GET  /metrics                                 Prometheus text (runtime/serve/metrics.py)

What the process holds (scheduler, engines, metrics) is made in the app's lifespan, not by
``create_app``: a Ray Serve replica receives the app by value and opens engines of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from xcompile.runtime.errors import EngineError
from xcompile.runtime.serve.metrics import Metrics
from xcompile.runtime.serve.protocol import (FINISH_REASONS, ChatCompletionRequest, CompletionRequest, ServeError,
                                             TextStream, error_body, usage)
from xcompile.runtime.serve.scheduler import EngineWorker, Generation, Job, Scheduler, ServeConfig

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
        sched = app.state.scheduler = Scheduler(config, open_worker)
        app.state.metrics = Metrics(lambda: sched.waiting, lambda: float(sched.slot.locked()))
        loading = asyncio.create_task(_load(sched, on_load_error))
        try:
            if not background_load:
                await loading
                if sched.load_error:
                    raise EngineError(sched.load_error)
            yield
        finally:
            await loading
            await sched.close()

    app = FastAPI(title="xcompile", lifespan=lifespan)
    app.add_middleware(_CountResponses)
    app.add_exception_handler(ServeError, lambda r, e: JSONResponse(e.body(), e.status))
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, lambda r, e: JSONResponse(error_body(e.status_code, str(e.detail)),
                                                                        e.status_code))
    app.add_exception_handler(Exception, _failed)

    def authorize(request: Request) -> None:
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
        log.error("engines failed to load: %s", sched.load_error)
        if on_load_error is not None:
            on_load_error(sched.load_error)
        return
    w = sched.worker
    log.info("serving %s: %s on %s, drafter %s, batch 1", w.model_name, w.es.backend, w.es.device, w.drafter.name)


def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
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


def _failed(request: Request, e: Exception) -> JSONResponse:
    """Anything unforeseen: an OpenAI-style 500 (uvicorn logs the traceback); the server keeps serving."""
    return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), 500)


class _CountResponses:
    """ASGI middleware counting each response by route and status as it starts (a stream's status is
    its first line's; how its generations ended is in xcompile_generations_total)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

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
    if (name := body.refused()) is not None:
        raise ServeError(400, f"{name}: not implemented by this server; leave it out", name)


async def _answer(request: Request, body, kind: str, prompts: list, param: str):
    sched: Scheduler = request.app.state.scheduler
    worker = sched.ready()
    _check(body, worker)
    ids = [worker.encode(p, param) for p in prompts]
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or worker.max_seq_len
    sampling = body.sampling()
    job = Job([Generation(p, max_tokens, body.stop, sampling, j) for p in ids for j in range(body.n)],
              sched.deadline())
    reply = _Reply(kind, body, worker, ids, request.app.state.metrics, job, sampling.seed)
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


class _Reply:
    """One request's answer as it forms: per choice its text stream, first-token time and result;
    renders the OpenAI stream chunks or the whole response body."""

    def __init__(self, kind: str, body, worker: EngineWorker, prompt_ids: list[list[int]], metrics: Metrics,
                 job: Job, seed: int | None):
        self.kind, self.body, self.worker, self.metrics, self.job, self.seed = kind, body, worker, metrics, job, seed
        self.chat = kind == "chat.completion"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        n = len(job.generations)
        self.prompt_ids = [p for p in prompt_ids for _ in range(body.n)]     # per choice
        self.prompt_tokens = sum(map(len, prompt_ids))                      # each prompt once
        self.opened = [False] * n
        self.streams = [TextStream(worker.decode, body.stop) for _ in range(n)]
        self.first: list[float | None] = [None] * n
        self.results: list = [None] * n

    def on_event(self, what: str, i: int, value) -> dict | None:
        """A worker event -> the stream choice it adds (None: nothing to send yet)."""
        now = time.monotonic()
        if what == "tokens":
            if all(t is None for t in self.first):
                self.metrics.ttft.observe(now - self.job.arrived)
            self.first[i] = self.first[i] or now
            text = self.streams[i].push(value)
            if text or not self.opened[i] or self.body.return_token_ids:
                return self._choice(i, text, value, None)
            return None
        self.results[i] = value
        self.metrics.finished(value, self.first[i] or now, now)
        return self._choice(i, self.streams[i].finish(), [], FINISH_REASONS[value.finish_reason])

    def _choice(self, i: int, text: str, ids: list[int], finish: str | None) -> dict:
        if self.chat:
            # OpenAI's chat stream: the role once, in the choice's first chunk; {} beside the finish reason
            delta = {} if self.opened[i] else {"role": "assistant"}
            if text or not self.opened[i]:
                delta["content"] = text
            self.opened[i] = True
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        if self.body.return_token_ids:
            choice["token_ids"] = ids
        return choice

    def _chunk(self, choices: list[dict], **extra) -> str:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.worker.model_name, "choices": choices, **extra}
        if self.body.include_usage:
            chunk.setdefault("usage", None)
        return f"data: {json.dumps(chunk)}\n\n"

    def usage(self) -> dict:
        return usage(self.prompt_tokens, [r.stats for r in self.results if r is not None], self.seed)

    async def sse(self, events: AsyncIterator[tuple]) -> AsyncIterator[str]:
        try:
            async for event in events:
                if (choice := self.on_event(*event)) is not None:
                    yield self._chunk([choice])
            if self.body.include_usage:
                yield self._chunk([], usage=self.usage())
        except asyncio.CancelledError:          # the client left; the scheduler cancels the job
            self.metrics.generations.labels("cancelled").inc()
            raise
        except ServeError as e:                 # the 200 is sent: the error is the stream's last event
            self.metrics.generations.labels("timeout" if e.status == 504 else "error").inc()
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:                  # an engine failure mid-stream: report it, keep serving
            log.exception("generation failed")
            self.metrics.generations.labels("error").inc()
            yield f"data: {json.dumps(error_body(500, f'generation failed: {e}'))}\n\n"
        yield "data: [DONE]\n\n"

    async def collect(self, events: AsyncIterator[tuple]) -> dict:
        try:
            async for event in events:
                self.on_event(*event)
        except asyncio.CancelledError:
            self.metrics.generations.labels("cancelled").inc()
            raise
        except ServeError as e:
            self.metrics.generations.labels("timeout" if e.status == 504 else "error").inc()
            raise
        choices = []
        for i, r in enumerate(self.results):
            text, finish = self.streams[i].text, FINISH_REASONS[r.finish_reason]
            choice = ({"index": i, "message": {"role": "assistant", "content": text}} if self.chat else
                      {"index": i, "text": text})
            choice.update(logprobs=None, finish_reason=finish)
            if self.body.return_token_ids:
                choice.update(token_ids=r.tokens, prompt_token_ids=self.prompt_ids[i])
            choices.append(choice)
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.worker.model_name,
                "choices": choices, "usage": self.usage()}
