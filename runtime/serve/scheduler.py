"""The device and its queue: the process's engine set (``EngineWorker``, runtime/serve/worker.py), a bounded FIFO
queue in front of it, cancel on disconnect and a per-request timeout. An engine dir exported with ``--max-batch 1``
runs one request at a time (below); one exported with ``--max-batch N > 1`` runs N sequences together
(``BatchLoop``, runtime/serve/batch_loop.py).

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
import contextlib
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from xcompile.runtime.common.errors import XcompileError
from xcompile.runtime.serve.batch_loop import BatchLoop
from xcompile.runtime.serve.jobs import DONE, Job
from xcompile.runtime.serve.protocol import ServeError
from xcompile.runtime.serve.worker import EngineWorker, ServeConfig

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
        self.arriving = 0                           # batch mode: jobs admitted and not yet put to the loop
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
            start = time.perf_counter()
            frozen = freeze_heap()
            log.info("heap frozen: %d objects kept out of later collections (%.0f ms)", frozen,
                     1e3 * (time.perf_counter() - start))
            if self.worker.batch is not None:
                # a step's events reach the jobs' queues in one call on the event loop (BatchLoop.send)
                self.batch_loop = BatchLoop(self.worker.batch, self.on_step,
                                            lambda pairs: loop.call_soon_threadsafe(_deliver, pairs),
                                            lambda: self.arriving)
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
            async with contextlib.aclosing(self._batched(job)) as events:      # closed with this one
                async for event in events:
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
        self.arriving += 1                                  # admitted, not yet put: an idle loop waits for it
        started, timer = False, None
        try:                            # the finally counts the job out even if its response never starts
            try:
                yield "admitted", None, None
            finally:
                self.arriving -= 1                          # before the put: a loop never waits for one it holds
            self.batch_loop.put(job, events.put_nowait)     # called on the event loop (BatchLoop.send)
            if job.deadline is not None:
                timer = loop.call_later(max(0.0, job.deadline - time.monotonic()), job.expire)
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
        gc.unfreeze()                   # what the closed engines held may be collected again


def freeze_heap() -> int:
    """Collect once, then move every object alive (modules, engines, compiled kernels: some 320,000 with the demo
    dir open) to the collector's permanent generation, so that later full collections walk only what requests
    create; returns how many were moved. A full collection of that heap took 156 ms on the 2-core CPU; with the
    heap frozen the 8B server's 64 prompt lengths on an H100 met no full one (2026-12-07, run J)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _deliver(pairs: list) -> None:
    """A batch step's events into their jobs' queues (on the event loop)."""
    for post, event in pairs:
        post(event)
