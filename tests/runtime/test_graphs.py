"""CUDA-graph wrapping of engine steps (runtime/graphs.py).

On CPU: the eager fallback, and the capture/replay bookkeeping (static inputs, one capture per
shape, fixed output buffers) through a stand-in capture that behaves like a graph. On a GPU
(``gpu`` marker): real CUDA graphs give exactly the tokens of eager execution.
"""

from __future__ import annotations

import time

import pytest
import torch
import tiny_engines as T
from fixtures import step_inputs

from xcompile.runtime.drafters import DraftModelDrafter, Eagle3ChainDrafter, Eagle3TreeDrafter, NoDrafter
from xcompile.runtime.generate import Generator
from xcompile.runtime.graphs import GraphedEngine

MAX_SEQ_LEN = 128
pytestmark = pytest.mark.usefixtures("one_thread")


class Emulated:
    """Stands in for ``CudaGraphCapture`` on CPU: "replay" re-runs the step on the static inputs and
    copies its results into the buffers produced at capture, as a graph writes its fixed outputs."""

    def __init__(self):
        self.captures = self.replays = 0

    def __call__(self, step, device):
        self.captures += 1
        out = step()

        def replay():
            self.replays += 1
            for name, t in step().items():
                out[name].copy_(t)

        return replay, out


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN)


def block_inputs(tokens: list[int], pos: int) -> dict[str, torch.Tensor]:
    """Causal step inputs for ``tokens`` written at ``pos``, logits for every row."""
    return step_inputs(torch.tensor([tokens]), pos)


def test_cpu_falls_back_to_eager_with_a_reason(tiny):
    eager, graphed = tiny.target_engine(), GraphedEngine(tiny.target_engine(), {1})
    eager.new_kv()
    graphed.new_kv()
    with pytest.warns(UserWarning, match="running eagerly"):
        out = graphed.run(**block_inputs([5], 0))
    assert "CUDA device" in graphed.fallback and not graphed.graphs
    assert torch.equal(out["logits"], eager.run(**block_inputs([5], 0))["logits"])


def test_capture_once_per_shape_then_replay_into_the_same_buffers(tiny):
    capture = Emulated()
    eager, graphed = tiny.target_engine(), GraphedEngine(tiny.target_engine(), {1, 3}, capture)
    eager.new_kv()
    graphed.new_kv()
    first = None
    for pos, token in enumerate([5, 9, 17, 33]):
        out = graphed.run(**block_inputs([token], pos))
        want = eager.run(**block_inputs([token], pos))
        assert torch.equal(out["logits"], want["logits"]) and torch.equal(out["hidden_taps"], want["hidden_taps"])
        first = out["logits"] if first is None else first
        assert out["logits"].data_ptr() == first.data_ptr()            # the graph's fixed output buffer
    assert (capture.captures, capture.replays) == (1, 4)
    out = graphed.run(**block_inputs([1, 2, 3], 4))                      # a second shape: a second graph
    assert torch.equal(out["logits"], eager.run(**block_inputs([1, 2, 3], 4))["logits"])
    graphed.run(**block_inputs([1, 2], 7))                               # not a listed token count: eager
    eager.run(**block_inputs([1, 2], 7))
    assert capture.captures == 2 and len(graphed.graphs) == 2
    for a, b in zip(graphed.kv, eager.kv):                              # same KV writes as eager
        assert torch.equal(a, b)
    graphed.new_kv()                                                     # new buffers: old graphs are stale
    assert not graphed.graphs


def test_replay_of_gives_the_bare_replay_with_the_inputs_in_place(tiny):
    """What xrun bench times as a graphed step: the replay alone, its inputs copied in once."""
    capture = Emulated()
    eager, graphed = tiny.target_engine(), GraphedEngine(tiny.target_engine(), {1}, capture)
    eager.new_kv()
    graphed.new_kv()
    replay = graphed.replay_of(**block_inputs([5], 0))
    assert (capture.captures, capture.replays) == (1, 1)
    with torch.inference_mode():                                 # the emulated replay copies inference tensors
        replay()
        replay()
    assert capture.replays == 3
    out = graphed.graphs[next(iter(graphed.graphs))].outputs
    assert torch.equal(out["logits"], eager.run(**block_inputs([5], 0))["logits"])   # the same step again
    assert graphed.replay_of(**block_inputs([1, 2], 1)) is None                     # not recorded: eager
    cpu = GraphedEngine(tiny.target_engine(), {1})                                  # no CUDA: no replay
    cpu.new_kv()
    with pytest.warns(UserWarning, match="running eagerly"):
        assert cpu.replay_of(**block_inputs([5], 0)) is None


def test_capture_failure_falls_back(tiny):
    def broken(step, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    want = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN).generate([5, 6, 7], 16).tokens
    g = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN, cuda_graphs=True, round_graphs=False,
                  capture=broken)
    with pytest.warns(UserWarning, match="not permitted"):
        tokens = g.generate([5, 6, 7], 16).tokens
    assert "not permitted" in g.target.fallback
    assert tokens == want
    g = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN, cuda_graphs=True, capture=broken)
    with pytest.warns(UserWarning, match="whole-round CUDA graph unavailable"):
        tokens = g.generate([5, 6, 7], 16).tokens
    assert "not permitted" in g.round_fallback and g.rounds is None
    assert tokens == want


def test_engines_not_graph_capturable_run_as_they_are(tiny):
    """GraphedEngine records only engines that declare their steps capturable: a TensorRT engine replays
    graphs of its own launches, and recording those again would capture a capture."""
    engine = tiny.target_engine()
    engine.graph_capturable = False                                     # as TrtEngine and OrtEngine declare
    capture = Emulated()
    graphed = GraphedEngine(engine, {1}, capture)
    graphed.new_kv()
    graphed.run(**block_inputs([5], 0))
    assert "graph_capturable" in graphed.fallback and capture.captures == 0
    g = Generator(engine, NoDrafter(), [], MAX_SEQ_LEN, cuda_graphs=True, capture=capture)
    assert g.target is engine
    assert g.generate([5, 6, 7], 8).tokens == Generator(tiny.target_engine(), NoDrafter(), [],
                                                        MAX_SEQ_LEN).generate([5, 6, 7], 8).tokens
    assert capture.captures == 0


# drafter, and the token counts each engine captures; the target's 1 comes from a one-token prompt (a decode
# step), which the prompts below include; the EAGLE3 head's prompt pass of one token is its chain step
DRAFTERS = {
    "none": (lambda t: NoDrafter(), {"target": {1}}),
    "draft": (lambda t: DraftModelDrafter(t.noisy_draft_engine(), 3), {"target": {1, 4}, "draft": {1, 2}}),
    "eagle3": (lambda t: Eagle3ChainDrafter(*t.eagle3_engines(), t.d2t, 3),
               {"target": {1, 4}, "eagle3": {1, 4}, "eagle3_fc": {4}}),
    "eagle3-tree": (lambda t: Eagle3TreeDrafter(*t.eagle3_engines(), t.d2t, 4, 3, 12),
                    {"target": {1, 12}, "eagle3": {4}, "eagle3_fc": {4}}),
}


def graph_token_counts(engine: GraphedEngine) -> set[int]:
    return {dict((n, s) for n, s, _ in key)["input_ids" if "input_ids" in engine.spec.input_names else "hidden_taps"][1]
            for key in engine.graphs}


@pytest.mark.parametrize("name", DRAFTERS)
def test_generate_with_emulated_graphs_matches_eager(name, tiny):
    make, shapes = DRAFTERS[name]
    prompts = [[5, 6, 7, 8, 9], [40, 3], [77]]
    eager = Generator(tiny.target_engine(), make(tiny), [], MAX_SEQ_LEN)
    capture = Emulated()
    graphed = Generator(tiny.target_engine(), make(tiny), [], MAX_SEQ_LEN, cuda_graphs=True, round_graphs=False,
                        capture=capture, debug=True)
    for p in prompts:
        assert graphed.generate(p, 40).tokens == eager.generate(p, 40).tokens
    engines = {"target": graphed.target, **{e.spec.graph: e for e in graphed.drafter.engines}}
    for graph, counts in shapes.items():
        assert isinstance(engines[graph], GraphedEngine) and engines[graph].fallback is None
        assert graph_token_counts(engines[graph]) == counts, graph
    assert capture.replays > 3 * capture.captures


class RoundRecorder:
    """Stands in for a whole-round capture on CPU: like a real capture, recording runs nothing; a
    "replay" runs the recorded round (which writes its outcome into the generator's static buffer)."""

    def __init__(self):
        self.captures = self.replays = 0

    def __call__(self, step, device):
        self.captures += 1

        def replay():
            self.replays += 1
            step()

        return replay, None


@pytest.mark.parametrize("name", DRAFTERS)
def test_whole_round_graphs_replay_one_recording_per_drafter(name, tiny):
    make, _ = DRAFTERS[name]
    prompts = [[5, 6, 7, 8, 9], [40, 3], [77]]
    eager = Generator(tiny.target_engine(), make(tiny), [], MAX_SEQ_LEN)
    capture = RoundRecorder()
    graphed = Generator(tiny.target_engine(), make(tiny), [], MAX_SEQ_LEN, cuda_graphs=True, capture=capture,
                        debug=True)
    rounds = 0
    for p in prompts:
        got, want = graphed.generate(p, 40), eager.generate(p, 40)
        assert got.tokens == want.tokens and got.stats.accepted_at == want.stats.accepted_at
        rounds += got.stats.rounds
    assert graphed.target is not None and not isinstance(graphed.target, GraphedEngine)
    assert capture.captures == len(graphed.rounds) == 1              # one drafter, recorded once
    assert capture.replays == rounds - 1                             # every round but the first (eager)


def test_round_graphs_are_dropped_when_kv_is_rebound(tiny):
    """A round graph writes the KV buffers it was recorded with: after Engine.bind_kv it is re-recorded."""
    capture = RoundRecorder()
    target = tiny.target_engine()
    g = Generator(target, NoDrafter(), [], MAX_SEQ_LEN, cuda_graphs=True, capture=capture)
    want = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN).generate([5, 6, 7], 12).tokens
    assert g.generate([5, 6, 7], 12).tokens == want and capture.captures == 1
    target.new_kv()                                                  # fresh buffers: the graph's are stale
    assert g.generate([5, 6, 7], 12).tokens == want and capture.captures == 2


def test_a_warming_capture_records_rounds_without_running_them(tiny):
    """CudaGraphCapture warms a step up by running it; a round must run once, so round graphs use the
    capture without warm-up (same pool)."""
    from xcompile.runtime.graphs import CudaGraphCapture

    warming = CudaGraphCapture(warmup=2)
    g = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN, cuda_graphs=True, capture=warming)
    assert g.capture.warmup == 0 and g.capture.error_mode == warming.error_mode


def test_round_graphs_are_recorded_per_sampler_mode(tiny):
    """Greedy, top-k and top-p are Python branches a capture bakes in: each mode gets its own graph."""
    from xcompile.runtime.sampling import SamplingParams

    capture = RoundRecorder()
    g = Generator(tiny.target_engine(), Eagle3ChainDrafter(*tiny.eagle3_engines(), tiny.d2t, 3), [], MAX_SEQ_LEN,
                  cuda_graphs=True, capture=capture)
    g.generate([5, 6, 7], 12)
    g.generate([5, 6, 7], 12, sampling=SamplingParams(temperature=0.8, top_k=5, seed=1))
    g.generate([5, 6, 7], 12, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=1))
    g.generate([5, 6, 7], 12)
    assert len(g.rounds) == capture.captures == 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("round_graphs", [False, True])
def test_cuda_graphs_give_identical_tokens(name, dtype, round_graphs):
    tiny = T.build(512, device="cuda", dtype=dtype)
    make, shapes = DRAFTERS[name]
    prompts = [[5, 6, 7, 8, 9], [77], [40, 3] * 10]
    eager = Generator(tiny.target_engine(), make(tiny), [], 512)
    graphed = Generator(tiny.target_engine(), make(tiny), [], 512, cuda_graphs=True, round_graphs=round_graphs)
    for p in prompts:
        want = eager.generate(p, 200)
        got = graphed.generate(p, 200)
        assert got.tokens == want.tokens
        assert got.stats.accepted_at == want.stats.accepted_at
    if round_graphs:
        assert graphed.round_fallback is None, graphed.round_fallback
        assert all(g.replay is not None for g in graphed.rounds.values())
    else:
        engines = {"target": graphed.target, **{e.spec.graph: e for e in graphed.drafter.engines}}
        for graph, counts in shapes.items():
            assert engines[graph].fallback is None, engines[graph].fallback
            assert graph_token_counts(engines[graph]) == counts, graph
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
    from xcompile.runtime.sampling import SamplingParams

    tiny = T.build(512, device="cuda", dtype=torch.float32)
    make, _ = DRAFTERS["eagle3"]
    eager = Generator(tiny.target_engine(), make(tiny), [], 512)
    graphed = Generator(tiny.target_engine(), make(tiny), [], 512, cuda_graphs=True)
    sampled = SamplingParams(temperature=0.8, top_k=5, seed=1)
    for p, sampling in (([5, 6, 7], None), ([5, 6, 7], sampled), ([40, 3] * 5, None), ([77], sampled), ([77], None)):
        kw = {} if sampling is None else {"sampling": sampling}
        want, got = eager.generate(p, 60, **kw), graphed.generate(p, 60, **kw)
        assert got.tokens == want.tokens and got.stats.accepted_at == want.stats.accepted_at, (p, sampling)
    assert graphed.round_fallback is None and len(graphed.rounds) == 2


def test_dropped_graphs_are_not_recorded_into_their_pool_again(tiny):
    """Once every graph of a memory pool is gone, torch's allocator refuses captures into that pool
    (H200, 2026-12-01: `use_count > 0` assert after a KV re-bind): the Generator and GraphedEngine
    start a new pool when they drop their graphs."""
    from xcompile.runtime.graphs import CudaGraphCapture

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
    g = Generator(target, NoDrafter(), [], MAX_SEQ_LEN, cuda_graphs=True, capture=capture)
    g.generate([5, 6, 7], 12)
    target.new_kv()                                                  # the round graph is dropped
    g.generate([5, 6, 7], 12)
    assert len(capture.pools) == 2 and capture.pools[0] is not capture.pools[1]

    step_capture = PoolRecorder()
    graphed = GraphedEngine(tiny.target_engine(), {1}, capture=step_capture)
    step_capture.pool = first = object()
    graphed.new_kv()                                                 # bind_kv drops its graphs
    assert step_capture.pool is not first
