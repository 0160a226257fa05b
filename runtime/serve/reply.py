"""One request's answer in the OpenAI shapes: stream chunks (SSE ``data:`` lines) or the whole body,
built from the worker's events (runtime/serve/worker.py ``EngineWorker.run``), with the metrics
each choice adds."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from xcompile.runtime.serve.jobs import Job
from xcompile.runtime.serve.metrics import Metrics
from xcompile.runtime.serve.protocol import FINISH_REASONS, ServeError, TextStream, error_body, usage
from xcompile.runtime.serve.worker import EngineWorker

log = logging.getLogger("xcompile.serve")


class Reply:
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
