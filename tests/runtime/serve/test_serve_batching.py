"""``xrun serve`` on a tiny engine dir exported with ``--max-batch 4`` (CPU, ONNX Runtime): the continuous-
batching loop. Concurrent requests each get the tokens the batch-1 Generator gives them alone, while their
steps interleave (far fewer target passes than their own passes added up); a client that leaves frees its
slot within a step or two; beyond the free slots and --max-queue the server answers 429."""

from __future__ import annotations

import asyncio
import json
import re
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (pip install -e '.[serve]')")

import fixtures  # noqa: E402
import httpx2 as httpx  # noqa: E402
import serving  # noqa: E402

from xcompile.runtime.decoding.drafters import NoDrafter  # noqa: E402
from xcompile.runtime.decoding.generator import Generator  # noqa: E402
from xcompile.runtime.decoding.registry import DrafterSpec  # noqa: E402
from xcompile.runtime.engines.load import open_engine_dir  # noqa: E402
from xcompile.runtime.serve.jobs import Generation, Job  # noqa: E402
from xcompile.runtime.serve.metrics import STEP_KINDS  # noqa: E402
from xcompile.runtime.serve.scheduler import Scheduler  # noqa: E402
from xcompile.runtime.serve.worker import ServeConfig  # noqa: E402

PROMPTS = [[5, 6, 7], [9] * 30, [20, 21], [40, 41, 42, 43, 44, 45, 46], [60], [70, 71, 72, 73] * 5]
BUDGETS = [20, 12, 25, 8, 16, 10]


@pytest.fixture(scope="module")
def batch_dir(tiny_target, tmp_path_factory):
    return fixtures.exported_dir(tmp_path_factory, "tiny-batch4", model=str(tiny_target), dtype="fp32", max_batch=4)


@pytest.fixture(scope="module")
def refs(tiny_target, tmp_path_factory):
    """What each prompt gets alone from the batch-1 Generator on the --max-batch 1 export (no EOS: full budgets)."""
    single = fixtures.exported_dir(tmp_path_factory, "tiny-batch1", model=str(tiny_target), dtype="fp32")
    with open_engine_dir(single, "ort", "cpu") as es:
        g = Generator(es.engines["target"], NoDrafter(), [], es.manifest.max_seq_len)
        return [g.generate(p, n).tokens for p, n in zip(PROMPTS, BUDGETS)]


@pytest.fixture(scope="module")
def server(batch_dir):
    config = ServeConfig(str(batch_dir), "ort", "cpu", DrafterSpec("none"), max_queue=2)
    s = serving.ThreadServer(config, open_worker=serving.HeldWorker).start()
    s.scheduler.worker.batch.eos_ids = frozenset()      # the tiny model's EOS comes early: full budgets
    yield s
    s.scheduler.worker.gate.set()
    s.stop()


async def until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def step_counts(url: str) -> dict[str, int]:
    """The server's xcompile_engine_step_seconds counts by kind (GET /metrics), the kinds that ran."""
    text = httpx.get(f"{url}/metrics").text
    found = re.findall(r'^xcompile_engine_step_seconds_count\{kind="(\w+)"\} (\S+)$', text, re.M)
    assert {k for k, _ in found} == set(STEP_KINDS)        # every kind listed from the start, 0 until it runs
    return {k: int(float(n)) for k, n in found if float(n)}


def body(p, n, **kw):
    return {"prompt": p, "max_tokens": n, "temperature": 0, "return_token_ids": True, **kw}


def test_health_says_batch_and_plain(server):
    h = httpx.get(f"{server.url}/health").json()
    assert h["drafter"] == "plain" and h["backend"] == "ort"


def test_concurrent_requests_get_their_batch_1_tokens_interleaved(server, refs):
    worker = server.scheduler.worker
    steps = worker.steps

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body(p, n))
                                          for p, n in zip(PROMPTS, BUDGETS)))

    done = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert [r.status_code for r in done] == [200] * len(PROMPTS)
    assert [r.json()["choices"][0]["token_ids"] for r in done] == refs
    alone = sum(BUDGETS) + 3                            # at least a pass per token (+ the 30-token prompt's chunks)
    assert worker.steps - steps < alone * 0.6, (worker.steps - steps, alone)


def test_streams_interleave_and_match(server, refs):
    async def one(c, p, n):
        tokens = []
        async with c.stream("POST", "/v1/completions", json=body(p, n, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
        return tokens

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(one(c, p, n) for p, n in zip(PROMPTS[:4], BUDGETS[:4])))

    assert asyncio.run(asyncio.wait_for(scenario(), 120)) == refs[:4]


def test_beyond_free_slots_and_the_queue_answers_429(server, refs):
    worker = server.scheduler.worker
    sched = server.scheduler

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            worker.gate.clear()
            worker.entered.clear()
            first = asyncio.create_task(c.post("/v1/completions", json=body(PROMPTS[0], BUDGETS[0])))
            await until(worker.entered.is_set)          # one slot taken, its step held
            rest = [asyncio.create_task(c.post("/v1/completions", json=body(p, n)))
                    for p, n in zip(PROMPTS[1:], BUDGETS[1:])]
            await until(lambda: sched.inflight == 6)    # 4 slots + --max-queue 2
            over = await c.post("/v1/completions", json=body([1, 2], 4))
            worker.gate.set()
            return over, await asyncio.gather(first, *rest)

    over, done = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert over.status_code == 429 and "--max-queue 2" in over.json()["error"]["message"]
    assert [r.json()["choices"][0]["token_ids"] for r in done] == refs
    assert sched.inflight == sched.waiting == sched.active == 0


def test_a_job_whose_response_never_starts_is_counted_out():
    """A client gone between its admission and its stream's start (Starlette then never runs the stream): the job
    is never put and leaves no count behind, where a leaked one would hold a place under the 429 limit for good."""
    sched = Scheduler(ServeConfig("unused"))
    put = []
    sched.worker = object()
    sched.batch_loop = SimpleNamespace(batch=SimpleNamespace(max_batch=4), put=lambda job, post: put.append(job))

    async def scenario():
        events = sched.run(Job([Generation([5, 6, 7], 4, [])]))
        assert await anext(events) == ("admitted", None, None)
        assert (sched.inflight, sched.waiting, sched.arriving) == (1, 1, 1)
        await events.aclose()
        return sched.inflight, sched.waiting, sched.arriving

    try:
        assert asyncio.run(scenario()) == (0, 0, 0) and put == []
    finally:
        sched.executor.shutdown()


def test_a_client_that_leaves_frees_its_slot_within_a_step(server):
    worker = server.scheduler.worker
    worker.delay = 0.05
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body([5, 6, 7], 50, stream=True)) as r:
                next(line for line in r.iter_lines() if line.startswith("data: {"))
            left = worker.steps
            deadline = time.monotonic() + 10
            while worker.batch.running and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not worker.batch.running
            assert worker.steps - left <= 3, worker.steps - left     # not the 49 steps its budget had left
    finally:
        worker.delay = 0.0


def test_a_lone_request_speculates_and_a_crowd_batches_on_the_torch_backend(tiny_target, tiny_eagle3,
                                                                           tmp_path_factory, refs):
    """A --max-batch 4 dir with an EAGLE3 head served on the torch backend (runtime/decoding/solo.py): a request
    alone runs speculative rounds (no batch step), concurrent ones batch; every answer is the batch-1 tokens."""
    head_dir = fixtures.exported_dir(tmp_path_factory, "tiny-batch4-eagle3", model=str(tiny_target),
                                     eagle3=str(tiny_eagle3), dtype="fp32", max_batch=4)
    config = ServeConfig(str(head_dir), "torch", "cpu", DrafterSpec("eagle3", 3), max_queue=8)
    s = serving.ThreadServer(config).start()
    try:
        batch = s.scheduler.worker.batch
        batch.eos_ids = frozenset()                     # full budgets, as refs have them
        batch.solo.gen.eos_ids = frozenset()
        assert httpx.get(f"{s.url}/health").json()["drafter"] == "eagle3 chain g=3"
        alone = httpx.post(f"{s.url}/v1/completions", json=body(PROMPTS[0], BUDGETS[0]), timeout=60)
        assert alone.json()["choices"][0]["token_ids"] == refs[0]
        assert batch.stats.steps == 0 and batch.stats.solo_rounds > 0
        # the server's step histogram: one prefill, then a round a step, as the loop counted them
        assert step_counts(s.url) == {"prompt": 1, "round": batch.stats.solo_rounds - 1}

        async def crowd():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=body(p, n))
                                              for p, n in zip(PROMPTS, BUDGETS)))

        done = asyncio.run(asyncio.wait_for(crowd(), 120))
        assert [r.json()["choices"][0]["token_ids"] for r in done] == refs and batch.stats.steps > 0
        counts = step_counts(s.url)             # the crowd's prompts went in batch steps beside decoding rows
        assert counts["batch"] + counts["batch_prompt"] == batch.stats.steps and counts["batch_prompt"] > 0
    finally:
        s.stop()
