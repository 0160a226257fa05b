"""Warm-up (runtime/decoding/warmup.py): it runs every round a request can reach, so requests after it record
nothing new, and it leaves nothing behind: a warmed loop gives the tokens of a fresh one, greedy and seeded
sampling, batch 1 (each drafter kind) and batched. On CPU through the stand-in captures of tiny_engines."""

from __future__ import annotations

import pytest
import tiny_engines as T

from xcompile.runtime.decoding.batch import CHUNK, BatchGenerator
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.sampling import GREEDY, SamplingParams
from xcompile.runtime.decoding.warmup import SHORT, prompt_lengths, sampler_modes, spans
from xcompile.runtime.engines.kernels import MAX_ROWS

MAX_SEQ_LEN = 128
SAMPLED = SamplingParams(temperature=0.8, seed=3)
TOP_P = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN)


def test_prompt_lengths_cover_every_short_step_and_the_longest_prompt():
    assert prompt_lengths(300) == list(range(1, 65)) + [65, 128, 129, 256, 300]     # 129: past two short steps
    assert prompt_lengths(128) == list(range(1, 65)) + [65, 128]
    assert prompt_lengths(10) == list(range(1, 11))
    assert spans(prompt_lengths(300)) == "1..65, 128..129, 256, 300"
    # SHORT is the longest step of every backend's short-step route
    pytest.importorskip("onnxruntime")
    from xcompile.runtime.engines.ort import GRAPH_MAX_TOKENS

    assert SHORT >= max(MAX_ROWS, GRAPH_MAX_TOKENS, CHUNK)


def test_sampler_modes_are_one_request_per_recorded_mode():
    got = sampler_modes({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0})
    # greedy, plain, top-p, the sampling kernels' two variants (top-k with top-p off, on), the dir's values
    assert [(s.greedy, s.top_k, s.top_p < 1) for s in got] == [(True, 0, False), (False, 0, False),
                                                              (False, 0, True), (False, 20, False),
                                                              (False, 20, True)]
    assert len(sampler_modes({"temperature": 1.0, "top_k": 40, "top_p": 0.9, "min_p": 0.0})) == 6    # a new mode
    assert len(sampler_modes(None)) == 5


def requests(g: Generator) -> list[list[int]]:
    """Greedy and seeded sampled generations over prompts of several lengths (5 to 70 tokens)."""
    prompts = T.random_prompts((5, 17, 70), seed=2)
    return [g.generate(p, 20, sampling=s).tokens for p in prompts for s in (GREEDY, SAMPLED, TOP_P)]


@pytest.mark.parametrize("name", T.DRAFTERS)
def test_after_warm_up_requests_record_nothing_and_get_a_fresh_generators_tokens(name, tiny):
    make = T.DRAFTERS[name]
    capture = T.RoundRecorder()
    warm = Generator(tiny.target_engine(), make(tiny), [], MAX_SEQ_LEN,
                     options=LoopOptions(cuda_graphs=True, capture=capture))
    parts = warm.warm_up([GREEDY, SAMPLED, TOP_P])
    # every (drafter or plain, sampler mode) round recorded once, and replayed once
    assert capture.captures == len(warm._executors) == 6 and capture.replays == 6
    assert [p.what.split(" ")[0] for p in parts] == ["prompt", "prompt"] + ["rounds"] * 3
    assert "1..64" in parts[0].what and all(p.seconds >= 0 for p in parts)
    # left as a fresh generator: KV zeroed, state cleared
    assert all(not buf.any() for kv in warm._kv_lists() for buf in kv)
    assert int(warm.state.length) == 0 and int(warm.state.root) == 0 and warm.sampler.greedy

    fresh = Generator(tiny.target_engine(), make(tiny), [], MAX_SEQ_LEN)
    assert requests(warm) == requests(fresh)
    assert capture.captures == 6                    # the requests recorded nothing new


def test_a_warm_up_for_one_prompt_runs_its_pass_and_rounds_only(tiny):
    """``xrun generate`` warms its one request (prompt=N): that pass and the rounds of its sampler mode, and the
    request after it gets a fresh generator's tokens and records nothing new."""
    capture = T.RoundRecorder()
    g = Generator(tiny.target_engine(), T.DRAFTERS["eagle3"](tiny), [], MAX_SEQ_LEN,
                  options=LoopOptions(cuda_graphs=True, capture=capture))
    parts = g.warm_up([SAMPLED], prompt=17)
    assert [p.what for p in parts] == ["prompt passes of 17 tokens",
                                       "rounds (eagle3; plain, as near the cache's end), sampled"]
    prompt = T.random_prompts((17,), seed=5)[0]
    fresh = Generator(tiny.target_engine(), T.DRAFTERS["eagle3"](tiny), [], MAX_SEQ_LEN)
    assert g.generate(prompt, 20, sampling=SAMPLED).tokens == fresh.generate(prompt, 20, sampling=SAMPLED).tokens
    assert capture.captures == 2


def test_warm_up_records_the_plain_round_near_the_caches_end(tiny):
    """A request whose length nears max_seq_len switches to plain rounds: warmed too, so it records nothing."""
    capture = T.RoundRecorder()
    g = Generator(tiny.target_engine(), T.DRAFTERS["eagle3"](tiny), [], MAX_SEQ_LEN,
                  options=LoopOptions(cuda_graphs=True, capture=capture))
    g.warm_up()
    assert capture.captures == 2
    prompt = [7] * (MAX_SEQ_LEN - 10)
    assert g.generate(prompt, 9).finish_reason == "max_tokens" and capture.captures == 2


def test_a_warmed_batch_loop_gives_a_fresh_ones_tokens(tiny):
    def batch() -> BatchGenerator:
        return BatchGenerator(T.qwen3_engine(tiny.target, batch=4), [], MAX_SEQ_LEN, chunk=8)

    prompts = T.random_prompts((1, 9, 30), seed=9)
    work = [(p, 12, (), s, 0) for p in prompts for s in (GREEDY, SAMPLED, TOP_P)]
    warm = batch()
    parts = warm.warm_up([GREEDY, SAMPLED, TOP_P])
    assert [p.what for p in parts] == ["batch steps of 1..8 tokens, greedy", "batch steps, sampled",
                                       "batch steps, sampled, top-p"]
    assert sorted(warm._causal) == list(range(1, 9))            # a step of every S
    assert warm.stats.steps == 0 and not any(buf.any() for buf in warm.target.kv)
    assert [r.tokens for r in warm.generate(work)] == [r.tokens for r in batch().generate(work)]


def test_a_warmed_drafting_batch_loop_records_nothing_more(tiny):
    """With drafts (batch_drafts.py) the warm-up also runs verify steps of every row's chain, and the head's passes
    are recorded too; afterwards requests record nothing new and get an eager fresh loop's tokens and acceptance."""
    from xcompile.compile.reference import torch_engines
    from xcompile.runtime.decoding.batch_drafts import BatchDrafts
    from xcompile.runtime.decoding.drafters import Eagle3ChainDrafter
    from xcompile.runtime.enginedir.contract import EAGLE3, EAGLE3_FC

    def batch(capture=None) -> BatchGenerator:
        heads = torch_engines(tiny.eagle3, EAGLE3, MAX_SEQ_LEN, batch=4)
        drafts = BatchDrafts(Eagle3ChainDrafter(heads[EAGLE3], heads[EAGLE3_FC], tiny.d2t, 3), 4, MAX_SEQ_LEN, "cpu")
        target = T.qwen3_engine(tiny.target, batch=4)
        target.step_rows = 4 * 8                # its prompt steps padded to 1, 2, 4 or 8 tokens and recorded
        return BatchGenerator(target, [], MAX_SEQ_LEN, chunk=8, capture=capture, drafts=drafts)

    prompts = T.random_prompts((1, 9, 30), seed=9)
    work = [(p, 12) for p in prompts]
    capture = T.Emulated()
    warm = batch(capture)
    parts = warm.warm_up([GREEDY])
    assert [p.what for p in parts] == ["batch steps of 1..8 tokens, greedy", "batch steps recorded at 1, 2, 4, 8 tokens",
                                       "batch steps verifying chains of 3 drafts"]
    recorded = capture.captures
    # the target, the head and its fc: steps of 1, 2, 4 (also a root and its chain a row) and 8 tokens a row
    assert recorded == 3 * 4
    results = warm.generate(work)
    assert capture.captures == recorded and sum(r.stats.drafted for r in results) > 0
    fresh = batch().generate(work)                              # eager: the same tokens, the same acceptance
    assert [(r.tokens, r.stats.accepted_at) for r in results] == [(r.tokens, r.stats.accepted_at) for r in fresh]
