"""The serve batch loop (runtime/serve/batch_loop.py) on the tiny reference batch loop (CPU fp32), its thread driven
as the Scheduler drives it: every job's events arrive in order and complete (tokens that make its batch-1 answer,
then "done" and DONE); a job the loop's checks refuse gets "invalid" and DONE without touching the others; a step
that raises fails the jobs it held; a step's events go out in one ``send`` (one wake-up of the event loop); and an
idle loop woken by one job waits for the jobs the event loop has admitted and not yet put, never for nothing."""

from __future__ import annotations

import threading
import time

import pytest
import tiny_engines as T

from xcompile.runtime.decoding.batch import BatchGenerator
from xcompile.runtime.decoding.drafters import NoDrafter
from xcompile.runtime.decoding.generator import Generator
from xcompile.runtime.serve.batch_loop import BatchLoop
from xcompile.runtime.serve.jobs import DONE, Generation, Job

MAX_SEQ_LEN, BATCH, NEW = 64, 4, 6
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN)


class Outbox:
    """What the Scheduler's send does, minus the event loop: each send's pairs kept as one batch."""

    def __init__(self):
        self.sends: list[list] = []
        self.events: dict[int, list] = {}
        self.ended = threading.Event()
        self.jobs = 0

    def send(self, pairs: list) -> None:
        self.sends.append(pairs)
        for post, event in pairs:
            post(event)

    def post_for(self, key: int):
        self.events[key] = []

        def post(event):
            self.events[key].append(event)
            if event is DONE and sum(e[-1] is DONE for e in self.events.values() if e) == self.jobs:
                self.ended.set()
        return post


def run_jobs(tiny, jobs: list[Job], fail_step: int | None = None, **loop_args) -> Outbox:
    batch = BatchGenerator(T.qwen3_engine(tiny.target, batch=BATCH), [], MAX_SEQ_LEN, chunk=8)
    if fail_step is not None:
        step, calls = batch.step, [0]

        def failing():
            calls[0] += 1
            if calls[0] == fail_step:
                raise RuntimeError("the device fell over")
            return step()
        batch.step = failing
    out = Outbox()
    out.jobs = len(jobs)
    loop = BatchLoop(batch, send=out.send, **loop_args)
    for k, job in enumerate(jobs):
        loop.put(job, out.post_for(k))
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        assert out.ended.wait(60), out.events
    finally:
        loop.stop()
        thread.join(30)
    out.batch = batch
    return out


def job(prompt: list[int], new: int = NEW) -> Job:
    return Job([Generation(prompt, new, [])])


def tokens_of(events: list) -> list[int]:
    return [t for e in events if e is not DONE and e[0] == "tokens" for t in e[2]]


def test_each_job_gets_its_batch_1_tokens_and_a_step_sends_its_events_at_once(tiny):
    prompts = T.random_prompts((3, 9, 17, 5), seed=3)
    g = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN)
    out = run_jobs(tiny, [job(p) for p in prompts])
    for k, p in enumerate(prompts):
        events = out.events[k]
        assert events[0] == ("started", None, None) and events[-1] is DONE and events[-2][0] == "done"
        assert tokens_of(events) == events[-2][2].tokens == g.generate(p, NEW).tokens
    # four sequences in step together: their tokens of one step go out in one send, not four
    assert max(sum(e is not DONE and e[0] == "tokens" for _, e in pairs) for pairs in out.sends) == 4
    assert len(out.sends) < sum(len(e) for e in out.events.values()) / 2


def test_a_refused_job_gets_invalid_and_done_and_the_others_go_on(tiny):
    ok = T.random_prompts((4,), seed=4)[0]
    out = run_jobs(tiny, [job([1] * MAX_SEQ_LEN), job(ok)])
    (what, i, why), done = out.events[0]
    assert what == "invalid" and i == 0 and "max_seq_len" in why and done is DONE
    assert out.events[1][-2][0] == "done" and len(tokens_of(out.events[1])) == NEW


def test_a_step_that_raises_fails_the_jobs_it_held(tiny):
    prompts = T.random_prompts((3, 6), seed=6)
    out = run_jobs(tiny, [job(p) for p in prompts], fail_step=2)
    for k in range(2):
        failed = [e for e in out.events[k] if e is not DONE and e[0] == "failed"]
        assert failed and "the device fell over" in failed[0][2] and out.events[k][-1] is DONE


def test_an_idle_loop_gathers_a_burst_admitted_on_the_event_loop_into_its_first_step(tiny):
    a, b = T.random_prompts((5, 5), seed=7)
    batch = BatchGenerator(T.qwen3_engine(tiny.target, batch=BATCH), [], MAX_SEQ_LEN, chunk=8)
    out, admitted = Outbox(), [1]           # b admitted on the event loop, its put not yet made
    out.jobs = 2
    loop = BatchLoop(batch, send=out.send, arriving=lambda: admitted[0], gather=30.0)   # the test's pace, not 5 ms
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        loop.put(job(a), out.post_for(0))
        time.sleep(0.2)                     # the loop holds a and waits for b
        admitted[0] = 0                     # the Scheduler's order: counted out, then put
        loop.put(job(b), out.post_for(1))
        assert out.ended.wait(60), out.events
    finally:
        loop.stop()
        thread.join(30)
    # equal prompts and budgets, no EOS: from the first step to the last both rows ran, never one alone
    assert batch.stats.rows_used[0] == 0 and batch.stats.rows_used[1] == batch.stats.steps > 0
    assert [tokens_of(out.events[k]) for k in (0, 1)] == [out.events[k][-2][2].tokens for k in (0, 1)]


@pytest.mark.parametrize("admitted", [0, 1])
def test_a_lone_job_never_waits_for_nothing_and_a_gather_ends(tiny, admitted):
    # admitted 0: nothing else admitted, so no wait at all (a 30 s gather would show); admitted 1 and its put never
    # comes (its client left): the loop goes on once the gather's 0.3 s are up
    gather = 30.0 if admitted == 0 else 0.3
    start = time.perf_counter()
    out = run_jobs(tiny, [job(T.random_prompts((4,), seed=8)[0])], arriving=lambda: admitted, gather=gather)
    took = time.perf_counter() - start
    assert out.events[0][-2][0] == "done"
    assert took < 10 if admitted == 0 else took >= gather
