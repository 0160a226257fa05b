"""The device and its queue: the process's engine set, a bounded FIFO queue in front of it, cancel on
disconnect and a per-request timeout. An engine dir exported with ``--max-batch 1`` runs one request at a
time (below); one exported with ``--max-batch N > 1`` runs N sequences together (``BatchLoop``, runtime/serve/batch_loop.py).

Batch 1, latency first: the engines, their KV buffers and the Generator are opened once per process and
live on one worker thread (torch work never runs on the event loop). The event loop admits requests:
one holds the device slot, at most ``max_queue`` wait for it in arrival order (``asyncio.Lock`` wakes
its waiters first come, first served), and the next one is refused (HTTP 429). A running request's
cancel event is set when its client goes away or its deadline passes; the Generator checks it once
per speculative round, so the device is free again within one round. The slot is released when the
worker thread is done, never earlier, so the next request never queues behind an invisible one.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from xcompile.runtime.common.errors import EngineError, XcompileError
from xcompile.runtime.decoding.registry import DrafterSpec
from xcompile.runtime.serve.batch_loop import BatchLoop
from xcompile.runtime.serve.jobs import DONE, Job
from xcompile.runtime.serve.protocol import ServeError


@dataclass(frozen=True)
class ServeConfig:
    """What ``xrun serve`` runs: the engine dir and drafter, and the server's limits."""

    engine_dir: str
    backend: str = "auto"
    device: str | None = None                   # default: cuda if available
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    served_model_name: str | None = None        # default: the manifest's model name
    api_key: str | None = None                  # required as "Authorization: Bearer KEY" on /v1 when set
    max_queue: int = 64                         # requests waiting for the device (a batch slot on batch dirs)
    request_timeout: float | None = None        # seconds from arrival to the last token; None: no limit
    cuda_graphs: bool = True
    warm_up: bool = True                        # run every kernel and graph once before reporting ready
    kv_cache_dtype: str = "auto"                # or fp8: the target's KV cache in e4m3 (fast and torch backends)
    row_invariant: bool = False                 # the fast target's KernelConfig.row_invariant

    def kernels(self):
        """The fast backend's KernelConfig asked for (None: the defaults)."""
        from xcompile.runtime.engines.kernels.config import KernelConfig
        return KernelConfig(row_invariant=True) if self.row_invariant else None


class EngineWorker:
    """The engine set, tokenizer and Generator of the process. ``run`` is called on the worker thread
    only; ``encode`` and ``check_prompt`` only read and may run on the event loop."""

    def __init__(self, config: ServeConfig):
        from xcompile.runtime.api import LLM

        self.llm = LLM(config.engine_dir, backend=config.backend, device=config.device, drafter=config.drafter,
                       cuda_graphs=config.cuda_graphs, kv_cache_dtype=config.kv_cache_dtype, kernels=config.kernels())
        llm = self.llm
        self.es, self.text, self.spec, self.drafter, self.gen = llm.engines, llm.tokenizer, llm.spec, llm.drafter, llm.generator
        self.batch = llm.batch                      # the continuous-batching loop (None: batch 1, self.gen)
        self.target = self.es.engines["target"]
        m = self.es.manifest
        self.model_name = config.served_model_name or m.name
        self.max_seq_len = m.max_seq_len
        # characters a text prompt may hold before it is tokenized (encode): a scan of the vocabulary, done here
        # rather than inside the first text request
        self.max_chars = m.max_seq_len * self.text.longest_token if self.text is not None else None
        self.vocab_size = m.models["target"].config["vocab_size"]

    def encode(self, prompt: str | list[int] | list[dict], param: str) -> list[int]:
        """Token ids of a text, token-id or chat-messages prompt, checked against the engine's limits."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            ids = list(prompt)
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                raise ServeError(400, f"token ids must lie in [0, {self.vocab_size}) for this model", param)
        elif self.text is None:
            raise ServeError(400, "the engine dir has no tokenizer: send the prompt as token ids", param)
        else:
            # a text too long for the context whatever its tokens, refused before tokenizing it (on the event loop:
            # 8 million characters took 6 s, every other request waiting)
            chars = len(prompt) if isinstance(prompt, str) else sum(len(m.get("content") or "") for m in prompt)
            if chars > self.max_chars:
                raise ServeError(400, f"a prompt of {chars} characters holds more than the {self.max_seq_len} tokens "
                                      f"of this model's context (a token covers at most {self.text.longest_token}); "
                                      "shorten it", param, "context_length_exceeded")
            try:
                ids = self.text.chat(prompt) if isinstance(prompt, list) else self.text.encode(prompt)
            except EngineError as e:
                raise ServeError(400, str(e), param) from None
        try:
            self.llm.loop.check_prompt(ids)
        except EngineError as e:
            raise ServeError(400, str(e), param, "context_length_exceeded") from None
        return ids

    def warm_up(self) -> list:
        """LLM.warm_up on the worker thread, logging one line per part as it finishes; returns the parts."""
        return self.llm.warm_up(lambda part: log.info("warmed %s in %.2f s", part.what, part.seconds))

    def decode(self, ids: list[int]) -> str:
        return self.text.decode(ids) if self.text else ""

    def run(self, job: Job, post: Callable[[tuple], None]) -> None:
        """Every generation of ``job`` in order (worker thread): posts ``("tokens", i, ids)`` per round
        and ``("done", i, Result)`` per generation, until the job is cancelled."""
        for i, g in enumerate(job.generations):
            if job.cancel.is_set():
                return
            result = self.gen.generate(g.prompt, g.max_new_tokens, stop=g.stop, sampling=g.sampling, index=g.index,
                                       cancel=job.cancel, on_tokens=lambda tokens, i=i, post=post: post(("tokens", i, tokens)))
            if result.finish_reason != "cancelled":
                post(("done", i, result))

    def close(self) -> None:
        self.es.close()


log = logging.getLogger("xcompile.serve")
# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The engine thread gives
# the GIL up at each graph replay and host read; with the event loop busy parsing a burst of requests, each take
# back waits up to the interval: a 16-request burst's first prefill took 13.955 ms against 6.92 alone (H100,
# 2026-12-06), and 300 waits of 20 µs beside a busy thread take 1,570 ms at 5 ms against 211 at 0.5 (26 alone;
# benchmarks/gil_handoff.py, 2-core CPU).
SWITCH_INTERVAL = 0.0005


class Scheduler:
    """The device slot and its queue (module docstring)."""

    def __init__(self, config: ServeConfig, open_worker: Callable[[ServeConfig], EngineWorker] = EngineWorker):
        self.config, self.open_worker = config, open_worker
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="xcompile-engine")
        self.slot = asyncio.Lock()
        self.waiting = 0
        self.active = 0                             # batch mode: jobs with a sequence in a slot
        self.inflight = 0                           # batch mode: jobs admitted and not yet ended
        self.running: Job | None = None
        self.worker: EngineWorker | None = None
        self.batch_loop: BatchLoop | None = None
        self.on_step: Callable[[str, float], None] | None = None     # BatchLoop's (the app's metrics)
        self.load_error: str | None = None
        self.warming = False                        # the engines are open, the warm-up runs: not ready yet

    def busy(self) -> float:
        """Requests on the device: 0 or 1 at batch 1, the jobs in slots when batching."""
        return float(self.active if self.batch_loop is not None else self.slot.locked())

    async def load(self) -> None:
        """Open the engines on the worker thread and warm them up there (unless ``--no-warm-up``: ServeConfig
        .warm_up); ``load_error`` holds the one-line reason if either fails. A batching worker's loop then runs
        on that thread until ``close``."""
        loop = asyncio.get_running_loop()
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        try:
            self.worker = await loop.run_in_executor(self.executor, self.open_worker, self.config)
            if self.config.warm_up:
                self.warming = True
                start = time.perf_counter()
                parts = await loop.run_in_executor(self.executor, self.worker.warm_up)
                log.info("warm-up done in %.2f s (%d parts): no request waits on a compile or a capture",
                         time.perf_counter() - start, len(parts))
            else:
                log.info("warm-up skipped (--no-warm-up): a request may wait on kernel compiles and graph captures")
            self.warming = False
            if self.worker.batch is not None:
                # a step's events reach the jobs' queues in one call on the event loop (BatchLoop.send)
                self.batch_loop = BatchLoop(self.worker.batch, self.on_step,
                                            lambda pairs: loop.call_soon_threadsafe(_deliver, pairs))
                self.executor.submit(self.batch_loop.run).add_done_callback(self._loop_ended)
        except XcompileError as e:
            self.load_error = f"{'warm-up: ' if self.warming else ''}{e}"
        except Exception as e:              # a backend's own error (e.g. ONNX Runtime's): report it, keep the cause
            log.exception("%s %s failed", "warming up" if self.warming else "opening", self.config.engine_dir)
            self.load_error = f"{self.config.engine_dir}: {'warm-up: ' if self.warming else ''}{type(e).__name__}: {e}"

    def _loop_ended(self, future) -> None:
        """The batch loop's thread returned: on a stop, or on an error of its own (its jobs failed by then), after
        which the server answers 503 rather than queue requests no thread will run."""
        if future.exception() is not None:
            self.load_error = f"the batch loop failed: {type(future.exception()).__name__}: {future.exception()}"

    def ready(self) -> EngineWorker:
        """The worker, or ServeError 503 while the engines load and warm up (or after either failed)."""
        if self.load_error:
            raise ServeError(503, f"engines failed to load: {self.load_error}")
        if self.worker is None:
            raise ServeError(503, "engines are loading; retry shortly")
        if self.warming:
            raise ServeError(503, "warming up: compiling kernels and recording CUDA graphs before the first request; "
                                  "retry shortly", code="warming_up")
        return self.worker

    def deadline(self) -> float | None:
        return time.monotonic() + self.config.request_timeout if self.config.request_timeout else None

    async def run(self, job: Job) -> AsyncIterator[tuple]:
        """Admit ``job`` (ServeError 429 when the queue is full) and yield ``("admitted", None, None)``;
        then wait for the device in FIFO order, run the job there and yield the worker's events
        (``EngineWorker.run``); ServeError 504 past the deadline. Leaving early (client gone) cancels
        the job within one round."""
        worker = self.ready()
        if self.batch_loop is not None:
            async for event in self._batched(job):
                yield event
            return
        if self.slot.locked() and self.waiting >= self.config.max_queue:
            raise ServeError(429, f"server busy: {self.waiting} requests already wait for the device "
                                  f"(--max-queue {self.config.max_queue}); retry later")
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            yield "admitted", None, None
            async with asyncio.timeout(None if job.deadline is None else job.deadline - time.monotonic()):
                await self.slot.acquire()
        except TimeoutError:
            raise self._timeout(job, "waiting for the device") from None
        finally:
            self.waiting -= 1
        # no await from acquire to here: the slot is always handed to the worker or released
        self.running = job
        events: asyncio.Queue = asyncio.Queue()
        post = lambda e: loop.call_soon_threadsafe(events.put_nowait, e)     # noqa: E731 (thread -> loop)

        def work():
            try:
                return worker.run(job, post)
            finally:
                post(DONE)

        future = loop.run_in_executor(self.executor, work)
        future.add_done_callback(self._release)
        timer = None if job.deadline is None else loop.call_later(max(0.0, job.deadline - time.monotonic()),
                                                                  job.expire)
        try:
            while (event := await events.get()) is not DONE:
                yield event
            await future                                    # re-raises what the worker raised
            if job.timed_out:
                raise self._timeout(job, "generating")
        finally:
            job.cancel.set()                                # a no-op once the worker is done
            if timer is not None:
                timer.cancel()

    async def _batched(self, job: Job) -> AsyncIterator[tuple]:
        """``run`` on a batching worker: the job's generations join the batch loop as slots free up. Admission
        counts requests, not sequences: max_batch of them run and --max-queue more wait, the next is refused
        (a request of n choices takes n slots, so then more wait than that)."""
        limit = self.batch_loop.batch.max_batch + self.config.max_queue
        if self.inflight >= limit:
            raise ServeError(429, f"server busy: {self.inflight} requests are running or waiting for a batch slot "
                                  f"({self.batch_loop.batch.max_batch} slots + --max-queue {self.config.max_queue}); "
                                  "retry later")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self.waiting += 1
        self.inflight += 1
        started = False
        yield "admitted", None, None
        self.batch_loop.put(job, events.put_nowait)         # called on the event loop (BatchLoop.send)
        timer = None if job.deadline is None else loop.call_later(max(0.0, job.deadline - time.monotonic()),
                                                                  job.expire)
        try:
            while (event := await events.get()) is not DONE:
                if event[0] == "started":
                    started = True
                    self.waiting -= 1
                    self.active += 1
                elif event[0] == "invalid":                # refused by the loop's own request checks
                    raise ServeError(400, event[2])
                elif event[0] == "failed":
                    raise ServeError(500, f"generation {event[1]} failed: {event[2]}")
                else:
                    yield event
            if job.timed_out:
                raise self._timeout(job, "generating" if started else "waiting for a batch slot")
        finally:
            job.cancel.set()                                # the loop drops what is left within one step
            if timer is not None:
                timer.cancel()
            self.inflight -= 1
            if started:
                self.active -= 1
            else:
                self.waiting -= 1

    def _release(self, _future) -> None:
        self.running = None
        self.slot.release()

    def _timeout(self, job: Job, where: str) -> ServeError:
        return ServeError(504, f"request timed out after {time.monotonic() - job.arrived:.1f} s {where} "
                               f"(--request-timeout {self.config.request_timeout} s)", code="timeout")

    async def close(self) -> None:
        """Cancel what runs, then close the engines on the worker thread once it is done."""
        if self.running is not None:
            self.running.cancel.set()
        if self.batch_loop is not None:
            self.batch_loop.stop()                          # the engine thread leaves the loop within one step
        if self.worker is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.worker.close)
        self.executor.shutdown(wait=True)


def _deliver(pairs: list) -> None:
    """A batch step's events into their jobs' queues (on the event loop)."""
    for post, event in pairs:
        post(event)
