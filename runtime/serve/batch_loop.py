"""The continuous-batching loop of ``xrun serve`` on a ``--max-batch N`` engine dir (the batch loop itself:
runtime/decoding/batch.py), on the engine thread the Scheduler (runtime/serve/scheduler.py) runs it on."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.serve.jobs import DONE, Job

log = logging.getLogger("xcompile.serve")
# How long an idle loop woken by one job waits for jobs the event loop has admitted and not yet put. A burst's first
# request prefilled alone held the other fifteen of 16 for its 13.955 ms (H100, 2026-12-06): its put comes an event-
# loop turn after the others' admissions, theirs right behind it (the fifteen within 1.4 ms of it on the 2-core CPU).
# A lone request never waits: nothing is admitted beside it.
GATHER_S = 0.005


class BatchLoop:
    """The continuous-batching loop on the engine thread (runtime/decoding/batch.py): jobs arrive from the
    event loop through ``put``, their generations are submitted between steps and take slots first come,
    first served; each step's tokens, each generation's end and a job's end are posted back as ``run``
    describes, plus ``("started", None, None)`` once a job's first generation holds a slot,
    ``("invalid", i, why)`` when the loop's request checks refuse generation i (a 400) and ``("failed", i, why)``
    when it failed (its callback, its stop check, or the engine's step: a 500).
    A job's cancel event ends its generations before the next step.

    A step's posts go out together, in one ``send(pairs)`` of (post, event) pairs after it (the Scheduler's: one
    call_soon_threadsafe for them all, which wakes the event loop once), not one wake-up a row; default: each post
    called here."""

    def __init__(self, batch, on_step: Callable[[str, float], None] | None = None,
                 send: Callable[[list], None] | None = None, arriving: Callable[[], int] = lambda: 0,
                 gather: float = GATHER_S):
        self.batch = batch
        # arriving(): jobs the event loop has admitted and not yet put (the Scheduler's count); gather: how long an
        # idle loop woken by one job waits for those (_take)
        self.arriving, self.gather = arriving, gather
        self.send = send or (lambda pairs: [post(event) for post, event in pairs])
        self.outbox: list[tuple[Callable[[tuple], None], tuple]] = []
        # on_step(kind, seconds) after each step: "prompt" (a lone sequence's prefill), "round" (its speculative
        # round), "batch_prompt" (a batch step carrying prompt chunks) or "batch" (one of decoding rows alone); the
        # server's xcompile_engine_step_seconds (metrics.py)
        self.on_step = on_step
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()     # (job, post), or None: stop
        self.owner: dict = {}                   # BatchSequence -> (job, generation index)
        self.jobs: dict[int, list] = {}         # id(job) -> [post, sequences left, started?]
        self.stopped = False

    def put(self, job: Job, post: Callable[[tuple], None]) -> None:
        self.inbox.put((job, post))

    def stop(self) -> None:
        self.stopped = True
        self.inbox.put(None)

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:          # a bug of the loop's own: fail every job, never leave one waiting
            log.exception("the batch loop failed")
            for post, *_ in list(self.jobs.values()):
                self.outbox += [(post, ("failed", 0, f"the batch loop failed: {type(e).__name__}: {e}")), (post, DONE)]
            self.jobs.clear()
            self._flush()
            raise

    def _loop(self) -> None:
        while not self.stopped:
            self._take(wait=self.batch.idle)
            if self.batch.idle:
                continue
            solo, stats, began = self.batch.solo, self.batch.stats, time.perf_counter()
            starting, counts = solo is None or solo.seq is None, (stats.steps, stats.solo_rounds)
            prefilled = stats.prefill_tokens
            try:
                ended = self.batch.step()
            except Exception as e:          # the engine failed: no row of the step can be trusted
                log.exception("a batched step failed")
                ended = self.batch.abort(f"{type(e).__name__}: {e}")
            else:
                if self.on_step is not None and (stats.steps, stats.solo_rounds) != counts:
                    kind = ("batch_prompt" if stats.prefill_tokens != prefilled else "batch") \
                        if stats.steps != counts[0] else "prompt" if starting else "round"
                    self.on_step(kind, time.perf_counter() - began)
            for q in self.batch.running:
                self._started(self.owner[q][0])
            for q in ended:
                self._ended(q)
            self._flush()
        for q in self.batch.abort("the server is shutting down"):
            self._ended(q)
        self._flush()

    def _flush(self) -> None:
        if self.outbox:
            pairs, self.outbox = self.outbox, []
            self.send(pairs)

    def _take(self, wait: bool) -> None:
        """Submit every job that arrived (blocking for the first when ``wait``: nothing else to do, its posts sent).
        Woken from idle, it goes on waiting while the event loop holds admitted jobs not yet put (a burst's), up to
        ``gather`` seconds, so that they share the first step instead of queueing behind a lone prefill."""
        if wait:
            self._flush()
        until = None                    # after the first job: when the gather ends (now, unless woken from idle)
        while True:
            left = None
            if until is not None:
                left = until - time.perf_counter()
                wait = left > 0 and self.arriving() > 0
            try:
                item = self.inbox.get(block=wait, timeout=left if wait else None)
            except queue.Empty:
                return
            if item is None:
                return
            job, post = item
            state = self.jobs[id(job)] = [post, 0, False]
            for i, g in enumerate(job.generations):
                def on_tokens(tokens, i=i, post=post, job=job):
                    self._started(job)
                    self.outbox.append((post, ("tokens", i, tokens)))
                try:
                    q = self.batch.submit(g.prompt, g.max_new_tokens, g.stop, g.sampling, g.index, job.cancel,
                                          on_tokens)
                except EngineError as e:
                    self.outbox.append((post, ("invalid", i, str(e))))
                    job.cancel.set()
                    break
                self.owner[q] = (job, i)
                state[1] += 1
            if state[1] == 0:
                del self.jobs[id(job)]
                self.outbox.append((post, DONE))
            if until is None:
                until = time.perf_counter() + (self.gather if wait else 0.0)

    def _started(self, job: Job) -> None:
        """("started", None, None) once for ``job``: before its first tokens, or after the step that seated it."""
        state = self.jobs[id(job)]
        if not state[2]:
            state[2] = True
            self.outbox.append((state[0], ("started", None, None)))

    def _ended(self, q) -> None:
        job, i = self.owner.pop(q)
        state = self.jobs[id(job)]
        post = state[0]
        r = q.result
        if r.finish_reason == "error":
            self.outbox.append((post, ("failed", i, q.error)))
            job.cancel.set()                # the request fails as a whole: its other generations leave too
        elif r.finish_reason != "cancelled":
            self.outbox.append((post, ("done", i, r)))
        state[1] -= 1
        if state[1] == 0:
            del self.jobs[id(job)]
            self.outbox.append((post, DONE))
