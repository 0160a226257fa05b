"""Whole speculative rounds recorded as one graph (runtime/decoding/generator.py).

On CPU through stand-in captures (tiny_engines.Emulated, RoundRecorder); on a GPU (``gpu`` marker) real
CUDA graphs give exactly the tokens of eager execution.
"""

from __future__ import annotations

import time

import pytest
import tiny_engines as T
import torch

from xcompile.runtime.decoding.drafters import Eagle3ChainDrafter, NoDrafter
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.engines.graphs import GraphedEngine

MAX_SEQ_LEN = 128
DRAFTERS = T.DRAFTERS
RoundRecorder, Emulated = T.RoundRecorder, T.Emulated
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN)


@pytest.mark.parametrize("name", DRAFTERS)
def test_whole_round_graphs_replay_one_recording_per_drafter(name, tiny):
    make = DRAFTERS[name]
    prompts = [[5, 6, 7, 8, 9], [40, 3], [77]]
    eager = Generator(tiny.target_engine(), make(tiny), [], MAX_SEQ_LEN)
    capture = RoundRecorder()
    graphed = Generator(tiny.target_engine(), make(tiny), [], MAX_SEQ_LEN,
                        options=LoopOptions(cuda_graphs=True, capture=capture, debug=True))
    rounds = 0
    for p in prompts:
        got, want = graphed.generate(p, 40), eager.generate(p, 40)
        assert got.tokens == want.tokens and got.stats.accepted_at == want.stats.accepted_at
        rounds += got.stats.rounds
    assert capture.captures == len(graphed._executors) == 1          # one drafter, recorded once
    assert capture.replays == rounds - 1                             # every round but the first (eager)


def test_round_graphs_are_dropped_when_kv_is_rebound(tiny):
    """A round graph writes the KV buffers it was recorded with: after Engine.bind_kv it is re-recorded."""
    capture = RoundRecorder()
    target = tiny.target_engine()
    g = Generator(target, NoDrafter(), [], MAX_SEQ_LEN, options=LoopOptions(cuda_graphs=True, capture=capture))
    want = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN).generate([5, 6, 7], 12).tokens
    assert g.generate([5, 6, 7], 12).tokens == want and capture.captures == 1
    target.new_kv()                                                  # fresh buffers: the graph's are stale
    assert g.generate([5, 6, 7], 12).tokens == want and capture.captures == 2


def test_a_warming_capture_records_rounds_without_running_them(tiny):
    """CudaGraphCapture warms a step up by running it; a round must run once, so round graphs use the
    capture without warm-up (same pool)."""
    from xcompile.runtime.engines.graphs import CudaGraphCapture

    warming = CudaGraphCapture(warmup=2)
    g = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN,
                  options=LoopOptions(cuda_graphs=True, capture=warming))
    assert g.capture.warmup == 0 and g.capture.error_mode == warming.error_mode


def test_round_graphs_are_recorded_per_sampler_mode(tiny):
    """Greedy, top-k and top-p are Python branches a capture bakes in: each mode gets its own graph."""
    from xcompile.runtime.decoding.sampling import SamplingParams

    capture = RoundRecorder()
    g = Generator(tiny.target_engine(), Eagle3ChainDrafter(*tiny.eagle3_engines(), tiny.d2t, 3), [], MAX_SEQ_LEN,
                  options=LoopOptions(cuda_graphs=True, capture=capture))
    g.generate([5, 6, 7], 12)
    g.generate([5, 6, 7], 12, sampling=SamplingParams(temperature=0.8, top_k=5, seed=1))
    g.generate([5, 6, 7], 12, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=1))
    g.generate([5, 6, 7], 12)
    assert len(g._executors) == capture.captures == 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", DRAFTERS)
def test_cuda_graphs_give_identical_tokens(name, dtype):
    tiny = T.build(512, device="cuda", dtype=dtype)
    make = DRAFTERS[name]
    prompts = [[5, 6, 7, 8, 9], [77], [40, 3] * 10]
    eager = Generator(tiny.target_engine(), make(tiny), [], 512)
    graphed = Generator(tiny.target_engine(), make(tiny), [], 512, options=LoopOptions(cuda_graphs=True))
    for p in prompts:
        want = eager.generate(p, 200)
        got = graphed.generate(p, 200)
        assert got.tokens == want.tokens
        assert got.stats.accepted_at == want.stats.accepted_at
    assert graphed.graph_fallback is None, graphed.graph_fallback
    assert all(e.replay is not None for e in graphed._executors.values())
    t0 = time.perf_counter()
    eager.generate(prompts[0], 200)
    t1 = time.perf_counter()
    graphed.generate(prompts[0], 200)
    t2 = time.perf_counter()
    print(f"{name} {dtype}: eager {200 / (t1 - t0):.0f} tok/s, graphs {200 / (t2 - t1):.0f} tok/s")


@pytest.mark.gpu
def test_round_graphs_between_sampler_modes_give_identical_tokens():
    """A greedy chain round picks the next round's first draft inside its own graph (drafters.py
    _early_pick) and a new request picks it at start; a sampled round draws it in the round. Greedy,
    sampled and greedy requests on one generator, its rounds replayed from graphs recorded in either mode,
    give the tokens and acceptance of the same requests run eagerly."""
    from xcompile.runtime.decoding.sampling import SamplingParams

    tiny = T.build(512, device="cuda", dtype=torch.float32)
    make = DRAFTERS["eagle3"]
    eager = Generator(tiny.target_engine(), make(tiny), [], 512)
    graphed = Generator(tiny.target_engine(), make(tiny), [], 512, options=LoopOptions(cuda_graphs=True))
    sampled = SamplingParams(temperature=0.8, top_k=5, seed=1)
    for p, sampling in (([5, 6, 7], None), ([5, 6, 7], sampled), ([40, 3] * 5, None), ([77], sampled), ([77], None)):
        kw = {} if sampling is None else {"sampling": sampling}
        want, got = eager.generate(p, 60, **kw), graphed.generate(p, 60, **kw)
        assert got.tokens == want.tokens and got.stats.accepted_at == want.stats.accepted_at, (p, sampling)
    assert graphed.graph_fallback is None and len(graphed._executors) == 2


def test_dropped_graphs_are_not_recorded_into_their_pool_again(tiny):
    """Once every graph of a memory pool is gone, torch's allocator refuses captures into that pool
    (H200, 2026-12-01: `use_count > 0` assert after a KV re-bind): the Generator and GraphedEngine
    start a new pool when they drop their graphs."""
    from xcompile.runtime.engines.graphs import CudaGraphCapture

    class PoolRecorder(CudaGraphCapture):
        """CudaGraphCapture's pool bookkeeping on CPU: a capture makes a pool when it has none."""

        def __init__(self):
            super().__init__(warmup=0)
            self.pools = []

        def __call__(self, step, device):
            if self.pool is None:
                self.pool = object()
            self.pools.append(self.pool)
            return step, None

    capture = PoolRecorder()
    target = tiny.target_engine()
    g = Generator(target, NoDrafter(), [], MAX_SEQ_LEN, options=LoopOptions(cuda_graphs=True, capture=capture))
    g.generate([5, 6, 7], 12)
    target.new_kv()                                                  # the round graph is dropped
    g.generate([5, 6, 7], 12)
    assert len(capture.pools) == 2 and capture.pools[0] is not capture.pools[1]

    step_capture = PoolRecorder()
    graphed = GraphedEngine(tiny.target_engine(), {1}, capture=step_capture)
    step_capture.pool = first = object()
    graphed.new_kv()                                                 # bind_kv drops its graphs
    assert step_capture.pool is not first
