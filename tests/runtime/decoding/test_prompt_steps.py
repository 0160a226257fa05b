"""Short prompt steps replayed from graphs (drafters.prompt_pass's ``steps``): each chunk padded to a power of two
rows, the padding written past the prompt and hidden from it, so the pass gives the unpadded pass's logits, taps
and KV rows, and a generation the tokens it gets without graphs. On CPU through the stand-in captures of
tiny_engines; the engines' short route is set by hand (the torch backend has none of its own)."""

from __future__ import annotations

import pytest
import tiny_engines as T
import torch

from xcompile.runtime.decoding.drafters import prompt_pass, step_rows
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.sampling import GREEDY, SamplingParams
from xcompile.runtime.engines.graphs import GraphedEngine

MAX_SEQ_LEN = 64
SHORT_ROWS = 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN)


def short(engine):
    """``engine`` with KV, its short route SHORT_ROWS rows."""
    engine.short_rows = SHORT_ROWS
    if not engine.kv:
        engine.new_kv()
    return engine


def test_step_rows_are_the_next_power_of_two():
    assert [step_rows(n) for n in (1, 2, 3, 5, 8, 9, 17, 33, 64)] == [1, 2, 4, 8, 8, 16, 32, 64, 64]


@pytest.mark.parametrize("n", [3, 16, 21, 32])
def test_a_padded_graphed_pass_gives_the_unpadded_passs_outputs_and_kv(tiny, n):
    prompt = torch.tensor(T.random_prompts((n,), seed=n))
    plain = short(tiny.target_engine())
    want, want_last, want_taps = prompt_pass(plain, prompt, keep="hidden_taps")
    capture = T.Emulated()
    engine = short(tiny.target_engine())
    steps = GraphedEngine(engine, {1, 2, 4, 8, 16}, capture)
    got, last, taps = prompt_pass(engine, prompt, keep="hidden_taps", steps=steps)
    assert torch.equal(last, want_last) and taps.shape == want_taps.shape == (1, n, want_taps.shape[-1])
    torch.testing.assert_close(taps, want_taps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    for a, b in zip(engine.kv, plain.kv):
        torch.testing.assert_close(a[..., :n, :], b[..., :n, :], rtol=1e-5, atol=1e-5)
    # chunks of 16 rows, the last padded: one graph per distinct row count, each replayed once a chunk
    chunks = [min(SHORT_ROWS, n - s) for s in range(0, n, SHORT_ROWS)]
    assert capture.captures == len({step_rows(c) for c in chunks}) and capture.replays == len(chunks)


def test_a_chunk_whose_padding_the_kv_cannot_hold_runs_unpadded(tiny):
    """A prompt near the cache's end: 16 + 3 tokens at 16 would write 16 + 4 rows, past the 19 the KV holds."""
    small = T.build(19)
    prompt = torch.tensor(T.random_prompts((19,), seed=1))
    capture = T.Emulated()
    engine = short(small.target_engine())
    got, _, _ = prompt_pass(engine, prompt, steps=GraphedEngine(engine, {1, 2, 4, 8, 16}, capture))
    want, _, _ = prompt_pass(short(small.target_engine()), prompt)
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    assert capture.captures == 1 and capture.replays == 1          # the first chunk only


@pytest.mark.parametrize("name", ["none", "eagle3", "eagle3-tree", "draft", "mtp"])
def test_generations_over_graphed_prompt_steps_get_the_eager_tokens(name, tiny):
    """Greedy and seeded sampled requests of 5 to 30 tokens: the tokens of a generator without graphs, the
    target's and the drafter's prompt steps (those on the short route) replayed from the step captures."""
    make = T.DRAFTERS[name]

    def generator(graphs: bool, capture=None):
        drafter = make(tiny)
        for e in drafter.engines:
            short(e)
        return Generator(short(tiny.target_engine()), drafter, [], MAX_SEQ_LEN - 8,
                         options=LoopOptions(cuda_graphs=graphs, capture=T.RoundRecorder() if graphs else None,
                                             step_capture=capture))

    capture = T.Emulated()
    graphed, eager = generator(True, capture), generator(False)
    sampled = SamplingParams(temperature=0.8, top_k=8, seed=3)
    for prompt in T.random_prompts((5, 17, 30), seed=4):
        for s in (GREEDY, sampled):
            assert graphed.generate(prompt, 12, sampling=s).tokens == eager.generate(prompt, 12, sampling=s).tokens
    # the target's passes and the drafter's (its engines that take prompt passes: not EAGLE3's fc) were replayed,
    # each engine's 5, 17 and 30 tokens as 8; 16 + 1 -> 1; 16 + 14 -> 16 rows
    assert set(graphed.prompt_steps) == {graphed.target, *graphed.drafter.prompt_engines}
    assert all(len(s.graphs) == 3 for s in graphed.prompt_steps.values()), graphed.prompt_steps
    assert capture.captures == 3 * len(graphed.prompt_steps) and graphed.graph_fallback is None
    assert not eager.prompt_steps


def test_a_step_capture_without_cuda_graphs_is_refused(tiny):
    from xcompile.runtime.common.errors import EngineError
    with pytest.raises(EngineError, match="step_capture records prompt steps with cuda_graphs only"):
        Generator(short(tiny.target_engine()), T.DRAFTERS["none"](tiny), [], MAX_SEQ_LEN,
                  options=LoopOptions(step_capture=T.Emulated()))
