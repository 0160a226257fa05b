"""CUDA-graph wrapping of engine steps (runtime/engines/graphs.py).

On CPU: the eager fallback, and the capture/replay bookkeeping (static inputs, one capture per
shape, fixed output buffers) through a stand-in capture that behaves like a graph. On a GPU
(``gpu`` marker): real CUDA graphs give exactly the tokens of eager execution.
"""

from __future__ import annotations

import pytest
import tiny_engines as T
import torch
from fixtures import step_inputs

from xcompile.runtime.decoding.drafters import NoDrafter
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.engines.graphs import GraphedEngine

MAX_SEQ_LEN = 128
Emulated = T.Emulated
pytestmark = pytest.mark.usefixtures("one_thread")


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
    """A step whose capture fails runs eagerly from then on, with a warning and the reason; so does a round."""
    def broken(step, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed = GraphedEngine(tiny.target_engine(), {1}, broken)
    graphed.new_kv()
    eager = tiny.target_engine()
    eager.new_kv()
    with pytest.warns(UserWarning, match="not permitted"):
        got = graphed.run(**block_inputs([5], 0))["logits"]
    assert "not permitted" in graphed.fallback and torch.equal(got, eager.run(**block_inputs([5], 0))["logits"])
    want = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN).generate([5, 6, 7], 16).tokens
    g = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN,
                  options=LoopOptions(cuda_graphs=True, capture=broken))
    with pytest.warns(UserWarning, match="whole-round CUDA graph unavailable"):
        tokens = g.generate([5, 6, 7], 16).tokens
    assert "not permitted" in g.graph_fallback
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
    g = Generator(engine, NoDrafter(), [], MAX_SEQ_LEN, options=LoopOptions(cuda_graphs=True, capture=capture))
    assert not g.graphs
    assert g.generate([5, 6, 7], 8).tokens == Generator(tiny.target_engine(), NoDrafter(), [],
                                                        MAX_SEQ_LEN).generate([5, 6, 7], 8).tokens
    assert capture.captures == 0
