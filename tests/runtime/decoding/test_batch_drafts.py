"""Speculation under load (runtime/decoding/batch_drafts.py): the batch loop's greedy rows verify EAGLE3 / MTP chains
in its steps, on tiny seeded reference modules (TorchEngine, CPU fp32); the demo pair's trained head in
tests/compile/test_demo.py.

Every greedy sequence gets plain greedy's tokens and the acceptance it has alone on the batch-1 Generator with the
same chain (the head's KV and proposal per slot are right), whatever the prompt lengths and the steps at which
sequences join; sampled sequences beside them get their seed's tokens; rows near the end of their slot stop
drafting; chains too long for the loop's slots, and drafters that do not batch, are refused.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import tiny_engines as T

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.batch import BatchGenerator
from xcompile.runtime.decoding.batch_drafts import BREAK_EVEN, PROBE, BatchDrafts, batch_chain, max_gamma
from xcompile.runtime.decoding.drafters import Eagle3ChainDrafter, MTPChainDrafter, NoDrafter
from xcompile.runtime.decoding.generator import Generator
from xcompile.runtime.decoding.outcome import Stats
from xcompile.runtime.decoding.registry import DrafterSpec, TreeShape
from xcompile.runtime.decoding.sampling import SamplingParams
from xcompile.runtime.enginedir.contract import EAGLE3, EAGLE3_FC, MTP

MAX_SEQ_LEN, BATCH, NEW = 96, 4, 24
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """test_batch.py's six prompts of 1..70 tokens: four slots, two wait."""
    return T.random_prompts((1, 7, 19, 40, 3, 70), seed=5)


def head(tiny, kind: str, k: int, batch: int = 1):
    """The tiny EAGLE3 head's or MTP module's chain of k over engines with KV for ``batch`` sequences."""
    if kind == "eagle3":
        e = T.torch_engines(tiny.eagle3, EAGLE3, MAX_SEQ_LEN, batch=batch)
        return Eagle3ChainDrafter(e[EAGLE3], e[EAGLE3_FC], tiny.d2t, k)
    return MTPChainDrafter(T.torch_engines(tiny.mtp, MTP, MAX_SEQ_LEN, batch=batch)[MTP], k, T.MTP_COLUMNS)


def drafting(tiny, kind: str = "eagle3", k: int = 3, chunk: int = 8, break_even: float = 0.0) -> BatchGenerator:
    """A drafting loop; break_even 0 by default: every step with a greedy decoding row verifies, as the batch-1
    Generator's every round does, which the tests compare rounds and acceptance with."""
    target = T.qwen3_engine(tiny.target, batch=BATCH)
    drafts = BatchDrafts(head(tiny, kind, k, BATCH), BATCH, MAX_SEQ_LEN, target.device, break_even)
    return BatchGenerator(target, [], MAX_SEQ_LEN, chunk=chunk, drafts=drafts)


def alone(tiny, prompts, drafter, new=NEW, sampling=None):
    g = Generator(tiny.target_engine(), drafter, [], MAX_SEQ_LEN)
    return [g.generate(p, new, sampling=sampling or SamplingParams()) for p in prompts]


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@pytest.mark.parametrize("chunk", [8, 64])
def test_greedy_rows_verify_chains_and_accept_what_they_accept_alone(tiny, prompts, kind, chunk):
    """Six prompts through four slots (two wait and join mid-run): plain greedy's tokens, and per sequence the
    rounds and the drafts accepted at each depth that the batch-1 Generator's chain of 3 gives it alone."""
    batch = drafting(tiny, kind, chunk=chunk)
    results = batch.generate([(p, NEW) for p in prompts])
    assert [r.tokens for r in results] == [r.tokens for r in alone(tiny, prompts, NoDrafter())]
    ref = alone(tiny, prompts, head(tiny, kind, 3))
    assert [(r.stats.rounds, r.stats.accepted_at) for r in results] == \
        [(r.stats.rounds, r.stats.accepted_at) for r in ref]
    assert all(r.stats.drafted == 3 * r.stats.rounds for r in results)
    assert batch.stats.rows_used[BATCH - 1] > 0             # all four slots busy at once


def test_sampled_rows_beside_drafting_ones_get_their_seed_tokens(tiny, prompts):
    """Sampled sequences decode one token a step (their draws are the plain batch loop's), greedy ones beside them
    verify chains; each gets what it gets alone."""
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9,
                                                                                        seed=3), SamplingParams()]
    ps = prompts[:4]
    results = drafting(tiny).generate([(p, NEW, (), s) for p, s in zip(ps, params)])
    plain = BatchGenerator(T.qwen3_engine(tiny.target, batch=BATCH), [], MAX_SEQ_LEN, chunk=8)
    assert [r.tokens for r in results] == [r.tokens for r in plain.generate([(p, NEW, (), s)
                                                                             for p, s in zip(ps, params)])]
    assert [r.stats.drafted > 0 for r in results] == [False, True, False, True]


def test_rows_near_the_end_of_their_slot_stop_drafting(tiny, prompts):
    """No budget short of the cache: each sequence stops at max_seq_len with plain greedy's tokens, the last
    steps (less than a round's lookahead left) one token a row."""
    ps = [prompts[5], prompts[3]]
    results = drafting(tiny, chunk=64).generate([(p, 1000) for p in ps])
    assert [r.tokens for r in results] == [r.tokens for r in alone(tiny, ps, NoDrafter(), new=1000)]
    assert [r.finish_reason for r in results] == ["max_seq_len", "max_seq_len"]
    assert len(results[0].tokens) == MAX_SEQ_LEN - len(ps[0]) + 1


def test_a_step_verifies_while_its_rows_acceptance_pays(tiny):
    """BREAK_EVEN: a step verifies chains while its drafting rows' running mean of accepted drafts reaches the bar
    (a new sequence starts at k); below it the loop decodes plainly and verifies once every PROBE steps."""
    drafts = BatchDrafts(head(tiny, "eagle3", 3, 2), 2, MAX_SEQ_LEN, "cpu")
    assert drafts.break_even == BREAK_EVEN == 0.7

    def sequence():
        return SimpleNamespace(accepting=None, stats=Stats())
    a, b = sequence(), sequence()
    assert drafts.pays([a, b])                              # new sequences: k = 3 each
    for _ in range(12):                                     # a accepts nothing, b one draft a step
        drafts.tally(a, 3, 0)
        drafts.tally(b, 3, 1)
    assert a.accepting < 0.1 and 0.9 < b.accepting < 1.1 and a.stats.drafted == 36 and b.stats.accepted == 12
    assert drafts.pays([b]) and not drafts.pays([a, b])     # mean 0.5 < 0.7
    assert [drafts.pays([a, b]) for _ in range(PROBE)] == [False] * (PROBE - 1) + [True]   # the probe
    assert drafts.pays([sequence(), b])                     # a new sequence in a's slot starts at k again


def test_a_bar_no_row_reaches_leaves_the_probes_only(tiny, prompts):
    """With a bar above k (never reached) the loop verifies only its probes, one step in PROBE + 1, and still gives
    plain greedy's tokens."""
    ps = prompts[:2]
    loop = drafting(tiny, break_even=10.0)
    results = loop.generate([(p, 80) for p in ps])
    assert [r.tokens for r in results] == [r.tokens for r in alone(tiny, ps, NoDrafter(), new=80)]
    verifies = max(r.stats.drafted for r in results) // 3
    assert 1 <= verifies <= loop.stats.steps // (PROBE + 1) + 1, (verifies, loop.stats.steps)


def test_chains_that_do_not_fit_the_slots_and_other_drafters_are_refused(tiny):
    with pytest.raises(EngineError, match=r"use gamma <= 15"):
        BatchDrafts(head(tiny, "eagle3", 16, BATCH), BATCH, MAX_SEQ_LEN, "cpu")
    with pytest.raises(EngineError, match="drafts EAGLE3 or MTP chains, not 'draft-model'"):
        BatchDrafts(T.DRAFTERS["draft"](tiny), BATCH, MAX_SEQ_LEN, "cpu")
    drafts = BatchDrafts(head(tiny, "eagle3", 3, 2), 2, MAX_SEQ_LEN, "cpu")
    with pytest.raises(EngineError, match="bound to 2 x 96 slots, the loop has 4 x 96"):
        BatchGenerator(T.qwen3_engine(tiny.target, batch=BATCH), [], MAX_SEQ_LEN, drafts=drafts)


def test_the_chain_a_batch_step_drafts():
    """min(gamma, 64 // max_batch - 1); a tree's depth as a chain; none for the draft model or past 32 slots."""
    assert [max_gamma(b) for b in (1, 4, 9, 16, 32, 33, 64)] == [63, 15, 6, 3, 1, 0, 0]
    assert batch_chain(DrafterSpec("eagle3", 6), 16).label == "eagle3 chain g=3"
    assert batch_chain(DrafterSpec("mtp", 4), 4).label == "mtp chain g=4"
    assert batch_chain(DrafterSpec("eagle3", 4, TreeShape(10, 6, 32)), 8).label == "eagle3 chain g=6"
    assert batch_chain(DrafterSpec("draft-model", 4), 4).name == "none"
    assert batch_chain(DrafterSpec("eagle3", 4), 64).name == "none"
