"""The generation loop with every drafter on tiny seeded reference modules (TorchEngine, CPU fp32).

Greedy speculative output must equal plain greedy decoding token for token; the scripted and
self-drafting cases pin the accepted counts at known positions; debug mode checks the KV lengths and
poisons every stale row between rounds.
"""

from __future__ import annotations

import pytest
import tiny_engines as T
import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding import generator as gen
from xcompile.runtime.decoding.drafters import (
    Drafter,
    DraftModelDrafter,
    Eagle3ChainDrafter,
    Eagle3TreeDrafter,
    MTPChainDrafter,
    MTPTreeDrafter,
    NoDrafter,
)
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.rounds import FusedChainVerifier
from xcompile.runtime.decoding.sampling import SamplingParams
from xcompile.runtime.decoding.speculative import Block, chain_block

NEW = 64        # new tokens per prompt in the equivalence tests
MAX_SEQ_LEN = 160
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return T.random_prompts((1, 3, 6, 9, 12), seed=11)


@pytest.fixture(scope="module")
def reference(tiny, prompts) -> dict[tuple[int, ...], list[int]]:
    """Plain greedy continuations (NoDrafter), NEW + 8 tokens each."""
    g = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN)
    return {tuple(p): g.generate(p, NEW + 8).tokens for p in prompts}


def test_plain_decoding_matches_full_recompute(tiny, prompts, reference):
    for p in prompts[1:3]:
        assert reference[tuple(p)][:NEW] == T.greedy_reference(tiny.target, p, NEW)


DRAFTERS = {
    "none": lambda t: NoDrafter(),
    **{f"draft-k{k}": (lambda t, k=k: DraftModelDrafter(t.draft_engine(), k)) for k in (1, 2, 4, 6)},
    **{f"noisy-draft-k{k}": (lambda t, k=k: DraftModelDrafter(t.noisy_draft_engine(), k)) for k in (2, 6)},
    **{f"eagle3-k{k}": (lambda t, k=k: Eagle3ChainDrafter(*t.eagle3_engines(), t.d2t, k)) for k in (1, 2, 4, 6)},
    **{f"tree-{a}x{b}x{c}": (lambda t, s=(a, b, c): Eagle3TreeDrafter(*t.eagle3_engines(), t.d2t, *s))
       for a, b, c in ((1, 1, 2), (2, 3, 6), (4, 4, 16), (3, 5, 12), (8, 2, 24), (2, 6, 20))},
    **{f"mtp-k{k}": (lambda t, k=k: MTPChainDrafter(t.mtp_engine(), k, T.MTP_COLUMNS)) for k in (1, 4, 8)},
    "mtp-tree-4x4x16": lambda t: MTPTreeDrafter(t.mtp_engine(), 4, 4, 16, columns=T.MTP_COLUMNS),
    # a module with a draft vocabulary: its logits over those rows, mapped to target ids by d2t
    "mtp-vocab-k4": lambda t: MTPChainDrafter(t.mtp_engine(vocab=True), 4, T.MTP_COLUMNS, d2t=t.d2t),
    "mtp-vocab-tree-4x4x16": lambda t: MTPTreeDrafter(t.mtp_engine(vocab=True), 4, 4, 16, columns=T.MTP_COLUMNS,
                                                      d2t=t.d2t),
}


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_equivalence(name, tiny, prompts, reference):
    # one generator for all prompts: each request starts over stale KV from the previous one
    g = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], MAX_SEQ_LEN)
    for p in prompts:
        r = g.generate(p, NEW)
        assert r.tokens == reference[tuple(p)][:NEW], p
        assert r.finish_reason == "max_tokens"
        s = r.stats
        assert s.new_tokens == NEW and s.target_forwards == s.rounds + 1
        assert s.drafted == s.rounds * (g.drafter.block_size - 1)
        assert 0 <= s.accepted <= s.drafted and s.accepted == sum(s.accepted_at)
        assert s.accepted + s.rounds + 1 >= NEW                           # rounds emit a+1 each (last truncated)


@pytest.mark.parametrize("name", ["none", "draft-k4", "eagle3-k4", "tree-4x4x16", "mtp-k4"])
def test_prompts_in_chunks_give_the_whole_passs_tokens(name, tiny, monkeypatch):
    """A prompt longer than PROMPT_CHUNK runs in causal chunks (drafters.prompt_pass: target, draft model, EAGLE3
    head and MTP module alike), each over the keys before it: the tokens of one whole pass, and every chunk
    row's hidden taps reach the drafter."""
    from xcompile.runtime.decoding.drafters import base

    prompt = T.random_prompts((100,), seed=4)[0]
    want = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], MAX_SEQ_LEN).generate(prompt, 24).tokens
    runs = []
    monkeypatch.setattr(base, "PROMPT_CHUNK", 30)               # 30 + 30 + 30 + 10 tokens
    g = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], MAX_SEQ_LEN)
    target_run = g.target.run
    monkeypatch.setattr(g.target, "run", lambda **i: runs.append(i["input_ids"].shape[1]) or target_run(**i))
    assert g.generate(prompt, 24).tokens == want
    assert runs[:4] == [30, 30, 30, 10]


@pytest.mark.parametrize("name", ["none", "draft-k4", "noisy-draft-k6", "eagle3-k4", "tree-4x4x16", "tree-2x6x20",
                                  "mtp-k4", "mtp-tree-4x4x16"])
def test_kv_invariants_and_stale_rows_never_read(name, tiny, prompts, reference):
    """debug=True: after every round each cache's length equals the committed tokens (minus the root) and
    every row past it is overwritten with a huge value; the output must not change."""
    g = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], MAX_SEQ_LEN, options=LoopOptions(debug=True))
    for p in prompts[:3]:
        assert g.generate(p, NEW).tokens == reference[tuple(p)][:NEW]


def test_poisoning_a_committed_row_is_detected(tiny, prompts, reference):
    """Control for the test above: the same poison one row lower (a committed row) changes the output."""

    class Leaky(Generator):
        def _check_kv(self, n, drafter):
            super()._check_kv(n, drafter)
            for buf in self.target.kv:
                buf[:, :, n - 1] = gen.POISON

    g = Leaky(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN, options=LoopOptions(debug=True))
    assert g.generate(prompts[2], NEW).tokens != reference[tuple(prompts[2])][:NEW]


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_target_as_its_own_draft_accepts_everything(k, tiny, prompts, reference):
    rounds = 8
    g = Generator(tiny.target_engine(), DraftModelDrafter(tiny.self_draft_engine(), k), [], MAX_SEQ_LEN,
                  options=LoopOptions(debug=True))
    for p in prompts[1:4]:
        r = g.generate(p, 1 + rounds * (k + 1))
        assert r.tokens == reference[tuple(p)][:1 + rounds * (k + 1)]
        s = r.stats
        assert (s.rounds, s.accepted, s.accepted_at, s.drafted) == (rounds, rounds * k, [rounds] * k, rounds * k)
        assert s.acceptance_length == k + 1 and s.acceptance_by_position == [1.0] * k
        assert s.target_forwards == rounds + 1


class ScriptedDrafter(Drafter):
    """Proposes the reference continuation, except a wrong token at the generated-token indices in ``wrong``.

    As a tree it puts a decoy branch (always wrong) before the scripted one and interleaves their nodes,
    so the accepted path is not contiguous and the target's KV rows really move."""

    name = "scripted"

    def __init__(self, ref: list[int], prompt_len: int, k: int, wrong: set[int], tree: bool = False):
        s = 2 * k + 1 if tree else k + 1
        super().__init__(max_depth=k, block_size=s, lookahead=s)
        self.ref, self.prompt_len, self.k, self.wrong, self.tree = ref, prompt_len, k, wrong, tree
        self.counts: list[int] = []

    def propose(self, root, length):
        done = int(length) - self.prompt_len + 1                # tokens generated so far, the root last
        script = [(self.ref[i] + (i in self.wrong)) % T.VOCAB for i in range(done, done + self.k)]
        if not self.tree:
            return chain_block(torch.tensor([[int(root)] + script]))
        decoy = [(self.ref[i] + 2) % T.VOCAB for i in range(done, done + self.k)]
        tokens, parents = [int(root)], [0]
        for j in range(self.k):                                 # nodes: root, decoy_1, script_1, decoy_2, ...
            tokens += [decoy[j], script[j]]
            parents += [2 * j - 1 if j else 0, 2 * j if j else 0]
        from xcompile.runtime.decoding.speculative import ancestors
        parents = torch.tensor([parents])
        mask, depth = ancestors(parents, self.k)
        return Block(torch.tensor([tokens]), parents, mask, depth, self.k, chain=False)

    def commit(self, block, acc, taps, length):
        self.counts.append(int(acc.count))


def expected_counts(k: int, wrong: set[int], max_new: int) -> list[int]:
    counts, done = [], 1
    while done < max_new:
        a = 0
        while a < k and done + a not in wrong:
            a += 1
        counts.append(a)
        done += a + 1
    return counts


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("k, wrong", [
    (4, {3, 9, 10, 20, 21, 22, 23, 24}),      # partial acceptance at known positions
    (3, set(range(100))),                     # zero acceptance every round
    (5, set()),                               # full acceptance every round
    (2, {1, 4, 5, 17}),
])
def test_scripted_drafter_accepts_exactly_as_expected(tree, k, wrong, prompts, reference, tiny):
    p = prompts[3]
    ref = reference[tuple(p)]
    drafter = ScriptedDrafter(ref, len(p), k, wrong, tree)
    r = Generator(tiny.target_engine(), drafter, [], MAX_SEQ_LEN, options=LoopOptions(debug=True)).generate(p, 48)
    assert r.tokens == ref[:48]
    assert drafter.counts == expected_counts(k, wrong, 48)
    assert r.stats.accepted_at == [sum(c > i for c in drafter.counts) for i in range(k)]


def test_eagle3_tree_of_width_one_is_the_chain(tiny, prompts):
    k = 4
    for p in prompts[1:3]:
        chain = Generator(tiny.target_engine(), Eagle3ChainDrafter(*tiny.eagle3_engines(), tiny.d2t, k), [],
                          MAX_SEQ_LEN).generate(p, NEW).stats
        tree = Generator(tiny.target_engine(), Eagle3TreeDrafter(*tiny.eagle3_engines(), tiny.d2t, 1, k, k + 1), [],
                         MAX_SEQ_LEN).generate(p, NEW).stats
        assert (tree.rounds, tree.accepted_at) == (chain.rounds, chain.accepted_at)


def eagle3_prefix(tiny: T.Tiny, seq: list[int]):
    """From scratch, for committed ``seq`` (root last): target taps over seq[:-1], then the head over the
    pairs (feature t, token t+1) at positions t. Returns the head's KV, last logits and last hidden."""
    n = len(seq) - 1
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    zero, last = torch.zeros(1, dtype=torch.int64), torch.tensor([[n - 1]])
    taps = tiny.target(torch.tensor([seq[:n]]), torch.arange(n)[None], zero, causal, last, *tiny.target.new_kv())[1]
    kv = tiny.eagle3.new_kv()
    logits, hidden, *_ = tiny.eagle3(torch.tensor([seq[1:]]), tiny.eagle3.project(taps), torch.arange(n)[None],
                                     zero, causal, last, *kv)
    return kv, logits[0, 0], hidden[:, n - 1:]


def eagle3_step(tiny: T.Tiny, kv, token: int, hidden, pos: int):
    """One head step on the head's own output: (hidden, token) at draft position ``pos``."""
    p = torch.tensor([[pos]])
    logits, hidden, *_ = tiny.eagle3(torch.tensor([[token]]), hidden, p, p[0], torch.ones(1, 1, 1, dtype=torch.bool),
                                     torch.zeros(1, 1, dtype=torch.int64), *kv)
    return logits[0, 0], hidden


def eagle3_reference_drafts(tiny: T.Tiny, seq: list[int], k: int) -> list[int]:
    """The greedy chain the head should propose after committed ``seq``, recomputed from scratch."""
    kv, logits, hidden = eagle3_prefix(tiny, seq)
    drafts = [int(tiny.eagle3.to_target_ids(logits.argmax()))]
    for i in range(1, k):
        logits, hidden = eagle3_step(tiny, kv, drafts[-1], hidden, len(seq) - 2 + i)
        drafts.append(int(tiny.eagle3.to_target_ids(logits.argmax())))
    return drafts


def eagle3_reference_children(tiny: T.Tiny, seq: list[int], path: list[int], k: int) -> set[int]:
    """Top-k target ids the head proposes under the tree node reached by ``path`` (drafted tokens from
    the root), recomputed from scratch: a node sees its ancestors only."""
    kv, logits, hidden = eagle3_prefix(tiny, seq)
    for i, token in enumerate(path):
        logits, hidden = eagle3_step(tiny, kv, token, hidden, len(seq) - 1 + i)
    return set(tiny.eagle3.to_target_ids(logits.topk(k).indices).tolist())


class RecordingChain(Eagle3ChainDrafter):
    """The EAGLE3 chain drafter, recording (length, drafts) of every round it proposes in ``proposed``."""

    def __init__(self, *args):
        super().__init__(*args)
        self.proposed: list[tuple[int, list[int]]] = []

    def propose(self, root, length):
        block = super().propose(root, length)
        self.proposed.append((int(length), block.tokens[0, 1:].tolist()))
        return block


def assert_reference_drafts(tiny, seq: list[int], proposed: list[tuple[int, list[int]]], k: int) -> None:
    """Each recorded round's drafts equal eagle3_reference_drafts over the committed tokens seq[:length + 1]."""
    with torch.inference_mode():
        for length, drafts in proposed:
            assert drafts == eagle3_reference_drafts(tiny, seq[:length + 1], k), length


@pytest.mark.parametrize("fused", [False, True])
def test_eagle3_chain_follows_the_pairing_rule(fused, tiny, prompts):
    """Every round's drafts equal a from-scratch EAGLE3 computation over the committed tokens: the
    prompt pass, the per-round update (features of the accepted path + the next tokens) and positions;
    fused: the greedy picks (argmax and the d2t lookup) on kernels/accept.py, in the interpreter."""
    from xcompile.runtime.common import gpu
    if fused and not gpu.interpreted():
        pytest.skip("the tiny engines are on the CPU: the fused kernels run there in Triton's interpreter only")
    k, p = 3, prompts[2]
    g = Generator(tiny.target_engine(), RecordingChain(*tiny.eagle3_engines(), tiny.d2t, k), [], MAX_SEQ_LEN,
                  options=LoopOptions(fused=fused))
    r = g.generate(p, 24)
    assert bool(g.drafter.picks) == fused
    assert_reference_drafts(tiny, p + r.tokens, g.drafter.proposed[:10], k)


def test_eagle3_tree_follows_the_pairing_rule(tiny, prompts):
    """Every round's candidate pool equals a from-scratch computation: the children of each expanded
    node are the head's top-k after the node's ancestors alone (siblings masked), and the update after
    a round that accepted a non-contiguous tree path read that path's features."""
    topk, depth, p = 8, 3, prompts[2]
    pools = []

    class Recording(Eagle3TreeDrafter):
        def propose(self, root, length):
            block = super().propose(root, length)
            pools.append((int(length), self.tokens[0].tolist(), self.parents[0].tolist()))
            return block

    r = Generator(tiny.target_engine(), Recording(*tiny.eagle3_engines(), tiny.d2t, topk, depth, 24), [],
                  MAX_SEQ_LEN).generate(p, 40)
    assert r.stats.accepted > 0                         # some rounds did accept a tree path
    seq = p + r.tokens
    checked = 0
    with torch.inference_mode():
        for length, tokens, parents in pools:
            children: dict[int, set[int]] = {}
            for i, parent in enumerate(parents):
                children.setdefault(parent, set()).add(tokens[i])
            for parent, got in children.items():
                path, node = [], parent
                while node >= 0:
                    path.insert(0, tokens[node])
                    node = parents[node]
                assert got == eagle3_reference_children(tiny, seq[:length + 1], path, topk), (length, path)
                checked += 1
    assert checked == len(pools) * (1 + topk + topk)


def test_eagle3_tree_expands_one_level_per_step(tiny, prompts):
    """Each expansion runs the head over that level's topk nodes only, written after the levels before
    it, with a mask over every node expanded so far (no level is run twice)."""
    topk, depth = 3, 4
    d = Eagle3TreeDrafter(*tiny.eagle3_engines(), tiny.d2t, topk, depth, 16)
    calls = []
    run = d.eagle3.run

    def recording(**inputs):
        calls.append((tuple(inputs["input_ids"].shape), tuple(inputs["tree_mask"].shape),
                      int(inputs["write_index"][0])))
        return run(**inputs)

    d.eagle3.run = recording
    p = prompts[1]
    Generator(tiny.target_engine(), d, [], MAX_SEQ_LEN).generate(p, 2)     # the prompt pass + one round
    expansions = [c for c in calls[1:] if c[0][1] == topk][:depth - 1]      # calls[0]: the prompt pass
    assert [c[:2] for c in expansions] == [((1, topk), (1, topk, topk * i)) for i in range(1, depth)]
    start = expansions[0][2]
    assert [c[2] for c in expansions] == [start + topk * (i - 1) for i in range(1, depth)]


# sampling ----------------------------------------------------------------------------------------

SAMPLED = SamplingParams(temperature=1.0, top_k=8, seed=3)


@pytest.mark.parametrize("name", DRAFTERS)
def test_temperature_zero_is_greedy(name, tiny, prompts, reference):
    g = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], MAX_SEQ_LEN)
    for p in prompts[3:4]:
        r = g.generate(p, NEW // 2, sampling=SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=9))
        assert r.tokens == reference[tuple(p)][:NEW // 2] and r.seed is None


@pytest.mark.parametrize("name", ["draft-k4", "noisy-draft-k6", "eagle3-k4", "tree-4x4x16", "tree-2x6x20"])
def test_vanishing_temperature_is_the_greedy_limit(name, tiny, prompts, reference):
    """At T = 1e-4 every warped distribution is one-hot on the argmax (these logits are far apart), so
    speculative sampling must reproduce greedy decoding: the same tokens, the same acceptance at every
    position (min(1, p/q) = 1 on agreement, residual = the target's argmax on rejection)."""
    cold = SamplingParams(temperature=1e-4, seed=1)
    g = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], MAX_SEQ_LEN)
    for p in prompts[2:3]:
        greedy, sampled = g.generate(p, NEW), g.generate(p, NEW, sampling=cold)
        assert sampled.tokens == greedy.tokens == reference[tuple(p)][:NEW]
        assert sampled.stats.accepted_at == greedy.stats.accepted_at


@pytest.mark.parametrize("k", [1, 4])
def test_a_sampled_request_between_greedy_ones(k, tiny, prompts, reference):
    """A greedy EAGLE3 chain picks the next round's first draft as the draft update's logits are made
    (drafters.py _early_pick); a sampled request keeps the logits and draws it in the round. After a sampled
    request on one generator, a greedy one gives the greedy tokens and drafts what a from-scratch EAGLE3
    computation over its committed tokens drafts, every round."""
    g = Generator(tiny.target_engine(), RecordingChain(*tiny.eagle3_engines(), tiny.d2t, k), [], MAX_SEQ_LEN)
    p = prompts[2]
    g.generate(p, NEW)
    g.generate(p, NEW, sampling=SAMPLED)
    g.drafter.proposed.clear()
    r = g.generate(p, 24)
    assert r.tokens == reference[tuple(p)][:24]
    assert_reference_drafts(tiny, p + r.tokens, g.drafter.proposed[:8], k)


@pytest.mark.parametrize("name", ["none", "draft-k4", "noisy-draft-k6", "eagle3-k4", "tree-4x4x16", "tree-2x6x20",
                                  "mtp-k4", "mtp-tree-4x4x16"])
def test_sampled_rounds_keep_the_kv_invariants(name, tiny, prompts):
    """debug=True while sampling: KV lengths checked and stale rows poisoned every round, and the
    tokens equal the same seed's without debug (a sampled path never reads a stale row either)."""
    checked = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], MAX_SEQ_LEN, options=LoopOptions(debug=True))
    plain = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], MAX_SEQ_LEN)
    for p in prompts[1:3]:
        r = checked.generate(p, NEW, sampling=SAMPLED)
        assert r.tokens == plain.generate(p, NEW, sampling=SAMPLED).tokens and r.seed == SAMPLED.seed
        s = r.stats
        assert s.new_tokens == NEW and s.target_forwards == s.rounds + 1
        assert 0 <= s.accepted <= s.drafted and s.accepted == sum(s.accepted_at)


@pytest.mark.parametrize("k", [2, 5])
def test_target_as_its_own_draft_accepts_everything_when_sampling(k, tiny, prompts):
    """q = p: min(1, p/q) = 1, every sampled draft is kept (p and q come from passes of different
    lengths, so they could round apart by an ulp: then one draft in ~1e6 is not)."""
    rounds = 6
    g = Generator(tiny.target_engine(), DraftModelDrafter(tiny.self_draft_engine(), k), [], MAX_SEQ_LEN,
                  options=LoopOptions(debug=True))
    r = g.generate(prompts[2], 1 + rounds * (k + 1), sampling=SAMPLED)
    assert (r.stats.rounds, r.stats.accepted) == (rounds, rounds * k)


def test_stops_inside_an_accepted_sampled_run(tiny, prompts):
    """EOS and max_tokens inside a round of a sampled self-drafting run: the same tokens up to the stop."""
    p, k = prompts[1], 4
    full = self_drafting(tiny, k, eos_ids=[], max_seq_len=MAX_SEQ_LEN).generate(p, NEW, sampling=SAMPLED).tokens
    j = first_new(full, [2, 3, 4, 7, 8, 9])
    r = self_drafting(tiny, k, eos_ids=[full[j]], max_seq_len=MAX_SEQ_LEN).generate(p, NEW, sampling=SAMPLED)
    assert r.tokens == full[:j + 1] and r.finish_reason == "eos"
    r = self_drafting(tiny, k, eos_ids=[], max_seq_len=MAX_SEQ_LEN).generate(p, 7, sampling=SAMPLED)
    assert r.tokens == full[:7] and r.finish_reason == "max_tokens"


def test_generate_n_is_n_streams_of_one_seed(tiny, prompts):
    g = Generator(tiny.target_engine(), DRAFTERS["eagle3-k4"](tiny), [], MAX_SEQ_LEN)
    p = prompts[2]
    many = g.generate_n(p, 16, sampling=SamplingParams(temperature=1.0, seed=4, n=3))
    assert [r.index for r in many] == [0, 1, 2] and {r.seed for r in many} == {4}
    assert [g.generate(p, 16, sampling=SamplingParams(temperature=1.0, seed=4), index=i).tokens for i in range(3)] \
        == [r.tokens for r in many]
    fresh = g.generate_n(p, 4, sampling=SamplingParams(temperature=1.0, n=2))
    assert fresh[0].seed == fresh[1].seed is not None               # no seed given: one drawn, shared, reported
    with pytest.raises(EngineError, match="SamplingParams"):
        g.generate(p, 4, sampling={"temperature": 1.0})


# stops -------------------------------------------------------------------------------------------


def first_new(ref: list[int], positions) -> int:
    """A position whose token does not occur earlier in ``ref``."""
    return next(j for j in positions if ref[j] not in ref[:j])


def self_drafting(tiny, k=4, **kw) -> Generator:
    return Generator(tiny.target_engine(), DraftModelDrafter(tiny.self_draft_engine(), k), **kw)


def test_eos_inside_an_accepted_run(tiny, prompts, reference):
    p = prompts[1]
    ref = reference[tuple(p)]
    j = first_new(ref, [2, 3, 4, 7, 8, 9])      # rounds of 5 emit ref[1:6], ref[6:11]: j is mid-run
    chunks = []
    r = self_drafting(tiny, eos_ids=[ref[j]], max_seq_len=MAX_SEQ_LEN).generate(p, NEW, on_tokens=chunks.append)
    assert r.tokens == ref[:j + 1] and r.finish_reason == "eos"
    assert sum(chunks, []) == r.tokens
    assert [len(c) for c in chunks[:-1]] == [1] + [5] * (len(chunks) - 2)


def test_eos_as_the_first_token(tiny, prompts, reference):
    p = prompts[0]
    ref = reference[tuple(p)]
    r = self_drafting(tiny, eos_ids=[ref[0]], max_seq_len=MAX_SEQ_LEN).generate(p, NEW)
    assert r.tokens == ref[:1] and r.finish_reason == "eos" and r.stats.rounds == 0


@pytest.mark.parametrize("n", [1, 2, 4, 6, 11])
def test_max_tokens_inside_an_accepted_run(n, tiny, prompts, reference):
    p = prompts[2]
    r = self_drafting(tiny, eos_ids=[], max_seq_len=MAX_SEQ_LEN).generate(p, n)
    assert r.tokens == reference[tuple(p)][:n] and r.finish_reason == "max_tokens"


def test_stop_string_inside_an_accepted_run(tiny, prompts, reference):
    p = prompts[3]
    ref = reference[tuple(p)]
    j = first_new(ref, [3, 4, 8, 9])

    def detokenize(ids):
        return "".join(f"<{i}>" for i in ids)

    g = self_drafting(tiny, eos_ids=[], max_seq_len=MAX_SEQ_LEN, detokenize=detokenize)
    r = g.generate(p, NEW, stop=[f"<{ref[j - 1]}><{ref[j]}>"])
    assert r.tokens == ref[:j + 1] and r.finish_reason == "stop"
    with pytest.raises(EngineError, match="detokenize"):
        self_drafting(tiny, eos_ids=[], max_seq_len=MAX_SEQ_LEN).generate(p, NEW, stop=["x"])


@pytest.mark.parametrize("stop", ["max_tokens", "eos", "stop"])
def test_tau_counts_only_the_tokens_rounds_emit(stop, tiny, prompts, reference):
    """τ = tokens emitted per verify round, the bonus included, tokens a stop or the cap drops excluded.
    A scripted chain of 3 that is always right emits 4 tokens a round; the 6th round is cut after
    one token, so 22 tokens come from the prefill (1) and 6 rounds (21): τ = 21/6 = 3.5, where
    (accepted + rounds) / rounds, counting the 3 dropped drafts, said 24/6 = 4.00."""
    p = prompts[3]
    ref = reference[tuple(p)]
    j = 21                                      # generated index of the last kept token (1 + 5 rounds of 4 = 21)
    assert ref[j] not in ref[:j], "the prompt's continuation repeats the token the stop keys on"
    eos, stops, n = [], [], j + 1
    if stop == "eos":
        eos, n = [ref[j]], NEW
    elif stop == "stop":
        stops, n = [f"<{ref[j]}>"], NEW
    g = Generator(tiny.target_engine(), ScriptedDrafter(ref, len(p), 3, set()), eos, MAX_SEQ_LEN,
                  detokenize=lambda ids: "".join(f"<{i}>" for i in ids))
    r = g.generate(p, n, stop=stops)
    s = r.stats
    assert r.tokens == ref[:j + 1] and r.finish_reason == stop
    assert (s.new_tokens, s.rounds, s.accepted) == (22, 6, 18)
    assert s.acceptance_length == pytest.approx(21 / 6)


@pytest.mark.parametrize("name", ["none", "draft-k6", "eagle3-k4", "tree-4x4x16"])
def test_cache_full_ends_like_plain_decoding(name, tiny, prompts, reference):
    """Near the end of the cache the drafter's round no longer fits: plain steps finish the job."""
    p, limit = prompts[2], 48
    r = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], limit,
                  options=LoopOptions(debug=True)).generate(p, 200)
    assert r.finish_reason == "max_seq_len"
    assert r.tokens == reference[tuple(p)][:limit - len(p) + 1]


@pytest.mark.parametrize("shape", [(2, 3, 6), (4, 4, 16), (8, 2, 24), (1, 1, 2)])
def test_tree_kernels_give_the_same_generation(shape, tiny, prompts, reference):
    """The tree drafter on its kernels (kernels/topk.py, tree.py: the default on a GPU, here in the
    interpreter) drafts the same trees as on torch's ops: the same tokens, rounds and acceptances."""
    p = prompts[2]
    runs = [Generator(tiny.target_engine(), Eagle3TreeDrafter(*tiny.eagle3_engines(), tiny.d2t, *shape, fused=fused),
                      [], MAX_SEQ_LEN).generate(p, 24) for fused in (False, True)]
    assert runs[1].tokens == runs[0].tokens == reference[tuple(p)][:24]
    assert (runs[1].stats.rounds, runs[1].stats.accepted) == (runs[0].stats.rounds, runs[0].stats.accepted)


@pytest.mark.parametrize("name", ["none", "eagle3-k4", "tree-4x4x16"])
def test_pipelined_rounds_give_the_same_generation(name, tiny, prompts, reference):
    """Rounds launched before the previous outcome is read (LoopOptions(pipeline=True); off on the CPU)
    give the same tokens, finish reasons and round counts: at max_new_tokens, at an EOS the host cannot
    foresee (a round ran past it, unread; the next request on the same generator is unaffected), and
    where the cache fills up (the drafter hands over to plain steps)."""
    p = prompts[2]
    ref = reference[tuple(p)]
    eos = [next(t for j, t in enumerate(ref) if j >= 9 and t not in ref[:j])]      # first seen at 10 or later
    for kwargs, limit, n in (({}, MAX_SEQ_LEN, NEW), ({"eos_ids": eos}, MAX_SEQ_LEN, NEW), ({}, 48, 200)):
        runs = []
        for pipeline in (False, True):
            g = Generator(tiny.target_engine(), DRAFTERS[name](tiny), kwargs.get("eos_ids", []), limit,
                          options=LoopOptions(pipeline=pipeline))
            runs.append([(r.tokens, r.finish_reason, r.stats.rounds, r.stats.accepted)
                         for r in (g.generate(p, n), g.generate(prompts[1], 7))])
        assert runs[0] == runs[1], (kwargs, limit)
        assert runs[1][0][0] == ref[:len(runs[1][0][0])] and runs[1][0][1] == ("eos" if kwargs else
                                                                             "max_tokens" if limit > 48 else "max_seq_len")



@pytest.mark.parametrize("name", ["none", "draft-k4", "eagle3-k4", "tree-4x4x16"])
def test_fused_accept_gives_the_same_generation(name, tiny, prompts, reference):
    """Greedy chain verification and the chain drafters' greedy picks on kernels/accept.py
    (LoopOptions(fused=True): the default on a GPU, here in the interpreter) give the torch ops' tokens,
    rounds and acceptances, pipelined or not, through
    whole-round graphs (recorded and replayed, its host row the graph's output buffer) or not, and where
    the cache fills up (the drafter hands over to plain steps: both block sizes on the kernels); the tree
    keeps accept_tree. A sampled request on the same generator takes the torch ops (the kernels are greedy
    only): the same draws as on a generator without the kernels."""
    from tiny_engines import RoundRecorder

    from xcompile.runtime.common import gpu
    if not gpu.interpreted():
        pytest.skip("the tiny engines are on the CPU: the fused kernels run there in Triton's interpreter only")
    p = prompts[2]
    sampled = SamplingParams(temperature=0.8, seed=1)
    for limit, n in ((MAX_SEQ_LEN, 40), (48, 200)):
        runs = []
        for fused, pipeline, graphs in ((False, False, False), (True, False, False), (True, True, False),
                                        (True, True, True)):
            g = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], limit,
                          options=LoopOptions(fused=fused, pipeline=pipeline, cuda_graphs=graphs, capture=RoundRecorder() if graphs else None))
            r = g.generate(p, n)
            s = g.generate(p, 8, sampling=sampled)
            runs.append((r.tokens, r.finish_reason, r.stats.rounds, r.stats.accepted, s.tokens, s.stats.accepted))
            if fused:
                chain = set() if name.startswith("tree") else {g.drafter.block_size}
                fused_sizes = {e.round.drafter.block_size for e in g._executors.values()
                               if isinstance(e.round.verifier, FusedChainVerifier)}
                assert fused_sizes == (chain | {1} if limit == 48 else chain)
                assert bool(g.drafter.picks) == (name in ("draft-k4", "eagle3-k4"))     # the drafts' picks
        assert all(run == runs[0] for run in runs), limit
        assert runs[0][0] == reference[tuple(p)][:len(runs[0][0])]

# errors ------------------------------------------------------------------------------------------


def test_prompt_too_long_fails_before_anything_runs(tiny):
    target = tiny.target_engine()
    drafter = Eagle3TreeDrafter(*tiny.eagle3_engines(), tiny.d2t, 4, 4, 16)
    g = Generator(target, drafter, [], 40)
    with pytest.raises(EngineError, match=r"prompt of 25 tokens \+ 16 .* exceed max_seq_len 40"):
        g.generate(list(range(4, 29)), 8)
    assert all(not buf.any() for buf in target.kv + drafter.eagle3.kv)
    assert g.generate(list(range(4, 28)), 4).finish_reason == "max_tokens"   # 24 + 16 fits exactly
    with pytest.raises(EngineError, match="empty prompt"):
        g.generate([], 8)


def test_engine_too_small_for_max_seq_len(tiny):
    with pytest.raises(EngineError, match="KV"):
        Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN + 1)
    with pytest.raises(EngineError, match="draft engine holds"):
        Generator(T.qwen3_engine(tiny.target, max_seq_len=MAX_SEQ_LEN),
                  DraftModelDrafter(T.qwen3_engine(tiny.draft, "draft", max_seq_len=64), 2), [], 100)


def test_drafter_parameters_are_checked(tiny):
    head, fc = tiny.eagle3_engines()
    with pytest.raises(EngineError, match="total_tokens"):
        Eagle3TreeDrafter(head, fc, tiny.d2t, 2, 2, 8)          # 2 + 4 candidates < 7 nodes
    with pytest.raises(EngineError, match="k must be"):
        Eagle3ChainDrafter(head, fc, tiny.d2t, 0)
    with pytest.raises(EngineError, match="repeated"):
        Eagle3ChainDrafter(head, fc, torch.zeros(T.DRAFT_VOCAB, dtype=torch.int64) - torch.arange(T.DRAFT_VOCAB), 2)
    with pytest.raises(EngineError, match="'draft' graph"):
        DraftModelDrafter(head, 2)
    with pytest.raises(EngineError, match="hidden_taps"):           # a target exported without EAGLE3 taps
        Generator(T.qwen3_engine(tiny.target, "draft"), Eagle3ChainDrafter(head, fc, tiny.d2t, 2), [], MAX_SEQ_LEN)


@pytest.mark.parametrize("name", ["none", "eagle3-k4"])
def test_cancel_ends_the_generation_within_one_round(name, tiny, prompts, reference):
    """A cancel set while round r's tokens are handed out stops the loop before round r+1; the tokens
    so far are the greedy prefix, and the generator serves the next request as usual."""
    import threading

    g = Generator(tiny.target_engine(), DRAFTERS[name](tiny), [], MAX_SEQ_LEN)
    p = prompts[3]
    cancel, calls = threading.Event(), []

    def on_tokens(tokens):
        calls.append(tokens)
        if len(calls) == 3:                 # the prefill's token, then two rounds
            cancel.set()

    r = g.generate(p, NEW, on_tokens=on_tokens, cancel=cancel)
    assert r.finish_reason == "cancelled" and len(calls) == 3 and r.stats.rounds == 2
    assert r.tokens == sum(calls, []) == reference[tuple(p)][:len(r.tokens)]
    assert g.generate(p, NEW).tokens == reference[tuple(p)][:NEW]
