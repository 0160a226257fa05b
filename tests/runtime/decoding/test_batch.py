"""The continuous-batching loop (runtime/decoding/batch.py) on tiny seeded reference modules (TorchEngine, CPU fp32).

Every sequence of a batch gets the tokens the batch-1 Generator gives it alone: greedy (against plain and
EAGLE3-chain decoding) and sampled with its own seed, whatever the prompt lengths, chunk size and the steps at
which sequences join; cancelled and failing sequences leave without touching the others, and their slots are
taken again within one step.
"""

from __future__ import annotations

import threading

import pytest
import tiny_engines as T

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.batch import BatchGenerator
from xcompile.runtime.decoding.drafters import Eagle3ChainDrafter, NoDrafter
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.sampling import SamplingParams

MAX_SEQ_LEN, BATCH, NEW = 96, 4, 24
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return T.random_prompts((1, 7, 19, 40, 3, 70), seed=5)


def alone(tiny, prompts, new=NEW, sampling=None, drafter=None) -> list[list[int]]:
    g = Generator(tiny.target_engine(), drafter or NoDrafter(), [], MAX_SEQ_LEN)
    return [g.generate(p, new, sampling=sampling or SamplingParams()).tokens for p in prompts]


def batch_of(tiny, chunk=8, eos=()) -> BatchGenerator:
    return BatchGenerator(T.qwen3_engine(tiny.target, batch=BATCH), eos, MAX_SEQ_LEN, chunk=chunk)


@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_each_sequence_gets_its_greedy_tokens_alone(tiny, prompts, chunk):
    """Six prompts (1 to 70 tokens) through four slots: the last two wait for a free slot and join mid-run."""
    batch = batch_of(tiny, chunk)
    results = batch.generate([(p, NEW) for p in prompts])
    assert [r.tokens for r in results] == alone(tiny, prompts)
    assert all(r.finish_reason == "max_tokens" for r in results)
    # interleaved: far fewer target passes than the sequences' own passes added up
    own = sum(r.stats.target_forwards for r in results)
    assert batch.stats.steps < own / 2, (batch.stats.steps, own)
    assert batch.stats.rows_used[BATCH - 1] > 0          # all four slots busy at once


def test_steps_of_one_token_a_row_replay_one_recorded_step(tiny, prompts):
    """With a capture (CUDA graphs on a GPU, LLM's choice there; here the CPU stand-in), the steps in which every
    row carries one token are recorded once and replayed, steps carrying prompt chunks run eagerly, and every
    sequence still gets its tokens alone."""
    capture = T.Emulated()
    batch = BatchGenerator(T.qwen3_engine(tiny.target, batch=BATCH), [], MAX_SEQ_LEN, chunk=8, capture=capture)
    assert [r.tokens for r in batch.generate([(p, NEW) for p in prompts])] == alone(tiny, prompts)
    assert capture.captures == 1 and capture.replays >= NEW


def test_prompt_steps_padded_to_recorded_sizes_replay_and_change_no_token(tiny, prompts):
    """Where the target runs B x S rows on its own kernels (Engine.step_rows: the fast backend's wide steps), a step
    carrying prompt chunks is padded up to the next recorded size (powers of two up to the chunk) and replayed as
    the decoding steps are: here every step replays, and every sequence still gets its tokens alone."""
    capture = T.Emulated()
    target = T.qwen3_engine(tiny.target, batch=BATCH)
    target.step_rows = BATCH * 8
    batch = BatchGenerator(target, [], MAX_SEQ_LEN, chunk=8, capture=capture)
    assert batch.sizes == [1, 2, 4, 8]
    assert [r.tokens for r in batch.generate([(p, NEW) for p in prompts])] == alone(tiny, prompts)
    counts = sorted(key[0][1][1] for key in batch._graphed.graphs)         # input_ids' S of each recording
    assert counts == [1, 8] and capture.captures == 2                      # every prompt chunk beside a longer one
    assert capture.replays == batch.stats.steps                            # no step ran eagerly
    three = prompts[4]
    assert batch.generate([(three, NEW)])[0].tokens == alone(tiny, [three])[0]
    assert sorted(key[0][1][1] for key in batch._graphed.graphs) == [1, 4, 8]   # 3 prompt tokens padded to 4
    target.step_rows = BATCH * 2                                           # only S <= 2 on the engine's kernels
    assert BatchGenerator(target, [], MAX_SEQ_LEN, chunk=8, capture=capture).sizes == [1, 2]


def test_a_step_near_a_slots_end_runs_unpadded(tiny, prompts):
    """A step whose padded size would write past a row's slot runs eagerly at its own S: a 7-token prompt joins
    a sequence 3 slots from its end, so the step carries 3 tokens a row, not 4 or 8."""
    capture = T.Emulated()
    target = T.qwen3_engine(tiny.target, batch=BATCH)
    target.step_rows = BATCH * 8
    batch = BatchGenerator(target, [], MAX_SEQ_LEN, chunk=8, capture=capture)
    long, short = T.random_prompts((MAX_SEQ_LEN - 8, 7), seed=11)
    a = batch.submit(long, 8)
    while a.length < MAX_SEQ_LEN - 3:
        batch.step()
    b = batch.submit(short, 4)
    replays = capture.replays
    batch.step()
    assert capture.replays == replays and b.length == 3                 # eager, 3 prompt tokens
    while not batch.idle:
        batch.step()
    assert [a.result.tokens, b.result.tokens] == alone(tiny, [long], new=8) + alone(tiny, [short], new=4)


def test_greedy_tokens_equal_speculative_decoding_alone(tiny, prompts):
    ref = alone(tiny, prompts[:4], drafter=Eagle3ChainDrafter(*tiny.eagle3_engines(), tiny.d2t, 3))
    assert [r.tokens for r in batch_of(tiny).generate([(p, NEW) for p in prompts[:4]])] == ref


def test_sequences_joining_at_different_steps(tiny, prompts):
    """A sequence submitted while others decode joins between steps; a long prompt's chunks share steps
    with the others' decode tokens, which keep coming one per step."""
    batch = batch_of(tiny, chunk=8)
    first = [batch.submit(p, NEW) for p in prompts[:2]]
    later = []
    for step in range(30):
        if step in (3, 9, 10):
            later.append(batch.submit(prompts[[5, 2, 4][len(later)]], NEW))
        before = [len(q.stops.tokens) for q in first]
        batch.step()
        if step > 2 and not any(q.result for q in first):       # decoding: one new token per step each
            assert [len(q.stops.tokens) for q in first] == [n + 1 for n in before]
    while not batch.idle:
        batch.step()
    seqs = first + later
    assert [q.result.tokens for q in seqs] == alone(tiny, [prompts[i] for i in (0, 1, 5, 2, 4)])


def test_a_sequence_runs_to_the_end_of_its_slot(tiny, prompts):
    """No budget short of the cache: it stops at max_seq_len with the tokens the Generator gives, while
    padded rows of the others never write past their slots (S shrinks to the room left)."""
    long = prompts[5]
    batch = batch_of(tiny, chunk=64)
    results = batch.generate([(long, 1000), (prompts[3], 1000), (prompts[1], 10)])
    refs = alone(tiny, [long, prompts[3]], new=1000)
    assert [r.tokens for r in results[:2]] == refs
    assert [r.finish_reason for r in results] == ["max_seq_len", "max_seq_len", "max_tokens"]
    assert len(results[0].tokens) == MAX_SEQ_LEN - len(long) + 1


def test_sampled_sequences_get_the_tokens_of_their_seed_alone(tiny, prompts):
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=10, seed=2),
              SamplingParams(temperature=0.7, top_p=0.9, seed=3), SamplingParams(), SamplingParams(0.9, seed=1)]
    ps = prompts[:5]
    refs = [alone(tiny, [p], sampling=s)[0] for p, s in zip(ps, params)]
    results = batch_of(tiny).generate([(p, NEW, (), s) for p, s in zip(ps, params)])
    assert [r.tokens for r in results] == refs
    assert [r.seed for r in results] == [1, 2, 3, None, 1]


def test_a_stream_index_is_its_own_sample(tiny, prompts):
    s = SamplingParams(temperature=1.0, seed=9)
    g = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN)
    refs = [g.generate(prompts[1], NEW, sampling=s, index=j).tokens for j in (0, 1)]
    assert refs[0] != refs[1]
    results = batch_of(tiny).generate([(prompts[1], NEW, (), s, j) for j in (0, 1)])
    assert [r.tokens for r in results] == refs


def test_eos_and_stop_strings_end_one_sequence_only(tiny, prompts):
    """Each sequence stops where the Generator alone stops it (same EOS ids and stop strings); the others
    go on to their budget."""
    plain = alone(tiny, prompts[:3], new=NEW)
    eos, stop = plain[0][5], f" {plain[2][3]} "           # the 6th token of the first answer; the 4th of the third
    words = lambda ids: " " + " ".join(map(str, ids)) + " "      # noqa: E731 (ids as text for stop strings)
    g = Generator(tiny.target_engine(), NoDrafter(), [eos], MAX_SEQ_LEN, detokenize=words)
    requests = [(prompts[0], NEW), (prompts[1], NEW), (prompts[2], NEW, [stop])]
    refs = [g.generate(*r) for r in requests]
    batch = BatchGenerator(T.qwen3_engine(tiny.target, batch=BATCH), [eos], MAX_SEQ_LEN, chunk=8, detokenize=words)
    results = batch.generate(requests)
    assert [(r.tokens, r.finish_reason) for r in results] == [(r.tokens, r.finish_reason) for r in refs]
    assert results[0].finish_reason == "eos" and len(results[0].tokens) == 6
    assert results[2].finish_reason in ("stop", "eos") and len(results[2].tokens) <= 4


def test_cancel_frees_the_slot_within_one_step(tiny, prompts):
    batch = batch_of(tiny)
    cancels = [threading.Event() for _ in range(BATCH)]
    seqs = [batch.submit(p, NEW, cancel=c) for p, c in zip(prompts[:BATCH], cancels)]
    waiting = batch.submit(prompts[4], NEW)
    for _ in range(3):
        batch.step()
    assert waiting.slot == -1 and all(q.slot >= 0 for q in seqs)
    cancels[1].set()
    ended = batch.step()
    assert seqs[1] in ended and seqs[1].result.finish_reason == "cancelled"
    assert waiting.slot == seqs[1].slot                 # the freed slot is taken in that same step
    while not batch.idle:
        batch.step()
    others = [0, 2, 3]
    assert [seqs[i].result.tokens for i in others] == alone(tiny, [prompts[i] for i in others])
    assert waiting.result.tokens == alone(tiny, [prompts[4]])[0]


def test_a_failing_callback_stops_its_sequence_only(tiny, prompts):
    def boom(tokens):
        raise ValueError("client went away mid-write")

    batch = batch_of(tiny)
    results = [batch.submit(prompts[0], NEW, on_tokens=boom), batch.submit(prompts[1], NEW)]
    while not batch.idle:
        batch.step()
    assert results[0].result.finish_reason == "error" and "client went away" in results[0].error
    assert results[1].result.tokens == alone(tiny, [prompts[1]])[0]


def test_bad_requests_are_refused_before_any_work(tiny):
    batch = batch_of(tiny)
    for args, needle in [(([], 4), "empty prompt"), (([1] * MAX_SEQ_LEN, 4), "max_seq_len"),
                         (([1], 0), "max_new_tokens"), (([1], 4, ["x"]), "detokenize"),
                         (([1], 4, (), SamplingParams(n=2)), "n=2")]:
        with pytest.raises(EngineError, match=needle):
            batch.submit(*args)
    assert batch.idle and batch.stats.steps == 0


def test_an_engine_that_takes_one_sequence_is_refused(tiny):
    engine = T.qwen3_engine(tiny.target, batch=BATCH)
    engine.batched = False          # what the fast backend's engines say
    with pytest.raises(EngineError, match="cannot batch.*--max-batch 1"):
        BatchGenerator(engine, [], MAX_SEQ_LEN)


# -- the lone sequence: the batch-1 Generator's rounds while it is alone (runtime/decoding/solo.py) ----------------

def solo_batch(tiny, drafter: str, eos=(), detokenize=None, prompt_steps: bool = False) -> BatchGenerator:
    """A 4-slot loop whose lone greedy sequence runs the batch-1 Generator with ``drafter`` (tiny_engines.DRAFTERS)
    in slot 0 of the same target; ``prompt_steps``: its prompt passes in 8-row short steps padded to 1, 2, 4, 8 rows
    and replayed from stand-in graphs (drafters.prompt_pass), the padding written in slot 0 past the prompt."""
    target = T.qwen3_engine(tiny.target, batch=BATCH)
    d = T.DRAFTERS[drafter](tiny)
    options = LoopOptions()
    if prompt_steps:
        for e in (target, *d.prompt_engines):
            e.short_rows = 8
        options = LoopOptions(cuda_graphs=True, capture=T.RoundRecorder(), step_capture=T.Emulated())
    solo = Generator(target, d, eos, MAX_SEQ_LEN, detokenize=detokenize, options=options)
    assert bool(solo.prompt_steps) == prompt_steps
    return BatchGenerator(target, eos, MAX_SEQ_LEN, chunk=8, detokenize=detokenize, solo=solo)


@pytest.mark.parametrize("prompt_steps", [False, True])
@pytest.mark.parametrize("drafter", ["draft", "eagle3", "eagle3-tree"])
def test_a_lone_sequence_speculates_and_gets_plain_greedy(tiny, prompts, drafter, prompt_steps):
    """Sequences submitted one at a time each run alone: speculative rounds of the Generator in slot 0 (a tree's
    accepted path compacted there), no batch step, plain greedy's tokens."""
    batch = solo_batch(tiny, drafter, prompt_steps=prompt_steps)
    results = [batch.generate([(p, NEW)])[0] for p in prompts]
    assert [r.tokens for r in results] == alone(tiny, prompts)
    assert batch.stats.steps == 0 and batch.stats.solo_rounds == sum(r.stats.rounds + 1 for r in results)
    assert all(r.stats.drafted > 0 and r.finish_reason == "max_tokens" for r in results)
    if drafter == "draft":                  # the noisy copy of the target is often right: 0.59 rounds a token
        assert sum(r.stats.rounds for r in results) < 0.7 * len(prompts) * (NEW - 1)


@pytest.mark.parametrize("prompt_steps", [False, True])
def test_a_lone_sequence_hands_over_when_another_arrives(tiny, prompts, prompt_steps):
    """Two rounds alone, then a second sequence arrives: the first goes on one token a step in the batch from where
    its last round left it, and both get plain greedy's tokens; once alone again it keeps batch-decoding."""
    batch = solo_batch(tiny, "draft", prompt_steps=prompt_steps)
    first = batch.submit(prompts[2], NEW)
    for _ in range(3):                      # the prefill's first token, then two rounds
        batch.step()
    assert batch.stats.solo_rounds == 3 and batch.stats.steps == 0 and first.slot == 0
    second = batch.submit(prompts[1], NEW)
    while not batch.idle:
        batch.step()
    assert [first.result.tokens, second.result.tokens] == alone(tiny, [prompts[2], prompts[1]])
    assert batch.stats.solo_rounds == 3 and batch.stats.steps > 0 and first.result.stats.drafted > 0
    third = batch.generate([(prompts[0], NEW)])[0]          # alone again: speculates again
    assert third.tokens == alone(tiny, [prompts[0]])[0] and third.stats.drafted > 0


def test_a_lone_sequence_stops_and_cancels_as_the_loop_does(tiny, prompts):
    """EOS and a stop string end a lone sequence where the batch-1 loop ends it; a cancel frees slot 0 within one
    step, the next sequence runs alone; a sampled sequence never runs alone (it batches from the start)."""
    words = lambda ids: " " + " ".join(map(str, ids)) + " "      # noqa: E731 (ids as text for stop strings)
    greedy = alone(tiny, prompts[:3])
    eos, stop = greedy[0][5], " " + " ".join(map(str, greedy[2][2:4])) + " "
    g = Generator(tiny.target_engine(), NoDrafter(), [eos], MAX_SEQ_LEN, detokenize=words)
    requests = [(prompts[0], NEW), (prompts[2], NEW, [stop])]
    refs = [g.generate(*r) for r in requests]
    batch = solo_batch(tiny, "draft", eos=[eos], detokenize=words)
    results = [batch.generate([r])[0] for r in requests]
    assert [(r.tokens, r.finish_reason) for r in results] == [(r.tokens, r.finish_reason) for r in refs]
    assert batch.stats.steps == 0
    cancel = threading.Event()
    q = batch.submit(prompts[3], NEW, cancel=cancel)
    batch.step()
    cancel.set()
    assert batch.step() == [q] and q.result.finish_reason == "cancelled" and batch.idle
    sampled = SamplingParams(temperature=0.8, seed=3)
    r = batch.generate([(prompts[1], NEW, (), sampled)])[0]
    assert r.stats.drafted == 0 and r.tokens == batch_of(tiny).generate([(prompts[1], NEW, (), sampled)])[0].tokens
