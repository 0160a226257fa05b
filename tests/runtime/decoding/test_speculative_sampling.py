"""Speculative sampling (``accept_sampled``) on synthetic targets and drafts over a 4-token vocabulary.

A target is a table of logits per context (every token prefix up to depth 4), a draft another such
table. Each test runs N trials at once as batch rows: per trial a chain or tree is drafted (tokens
drawn from q, or deterministic picks), the target's logits are read at every node's context, one
verify is accepted, and what the round emits is extended with plain draws from p to 3 tokens. That
3-token sequence must be distributed as p's joint law (64 outcomes), within the total-variation
bound of test_sampling.py (anchor: vLLM tests/samplers/test_rejection_sampler.py, which compares the
emitted law to the target's). A control with the residual rule broken fails the same bound.
"""

from __future__ import annotations

import pytest
import torch
from test_sampling import tv, tv_bound

from xcompile.runtime.decoding import speculative
from xcompile.runtime.decoding.sampling import Sampler, SamplingParams
from xcompile.runtime.decoding.speculative import Block, accept_sampled, accept_tree, ancestors, chain_block

V, DEPTH, M = 4, 4, 3                         # vocab, deepest context, emitted tokens compared
N = 20_000                                    # trials (batch rows) per test
OFFSETS = torch.tensor([sum(V ** j for j in range(d)) for d in range(DEPTH + 2)])   # first context id per length


class Model:
    """Logits for every context (token prefix) of length <= DEPTH: [contexts, V]."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    @staticmethod
    def random(seed: int, scale: float = 2.0) -> "Model":
        g = torch.Generator().manual_seed(seed)
        return Model(scale * torch.randn(OFFSETS[DEPTH + 1], V, generator=g))

    def at(self, ctx: torch.Tensor) -> torch.Tensor:
        return self.logits[ctx]

    def probs(self, ctx: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        s = Sampler("cpu", 1)
        s.reset(params)
        return s.warp(self.at(ctx)[None]).probs()[0]


def child_ctx(ctx: torch.Tensor, depth: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Context id after appending ``token`` to context ``ctx`` of length ``depth`` (mixed radix)."""
    return OFFSETS[depth + 1] + (ctx - OFFSETS[depth]) * V + token


def exact_joint(target: Model, params: SamplingParams) -> torch.Tensor:
    """[V**M] the target's law of its next M tokens after the empty context."""
    joint = torch.ones(1)
    ctx = torch.zeros(1, dtype=torch.int64)
    for d in range(M):
        p = target.probs(ctx, params)                                       # [V**d, V]
        joint = (joint[:, None] * p).flatten()
        ctx = child_ctx(ctx[:, None].expand(-1, V), torch.full((1,), d), torch.arange(V)).flatten()
    return joint


def draft_round(parents: list[int], target: Model, draft: Model | None, params: SamplingParams,
                g: torch.Generator, picks: str = "sampled") -> tuple[Block, torch.Tensor]:
    """N trials of one round over the tree ``parents`` (node 0 the root at the empty context).

    picks: "sampled" draws each node's token from q at its parent's context (siblings i.i.d.);
    "distinct" / "repeats" are deterministic picks (point masses, block.q None): random distinct
    siblings, or siblings that may repeat."""
    s = len(parents)
    par = torch.tensor(parents)
    tokens = torch.zeros(N, s, dtype=torch.int64)
    ctx = torch.zeros(N, s, dtype=torch.int64)
    depth = torch.zeros(s, dtype=torch.int64)
    q = torch.zeros(N, s, V)
    order = torch.rand(N, s, V, generator=g).argsort(-1)                   # per node: a random order of V
    for i in range(1, s):
        depth[i] = depth[parents[i]] + 1
        pc = ctx[:, parents[i]]
        if picks == "sampled":
            q[:, i] = draft.probs(pc, params)
            tokens[:, i] = torch.multinomial(q[:, i], 1, generator=g)[:, 0]
        else:
            sib = int(((par[1:i] == parents[i])).sum())                     # earlier siblings
            tokens[:, i] = order[:, parents[i], sib % V if picks == "distinct" else sib // 2]
        ctx[:, i] = child_ctx(pc, depth[i].expand(N), tokens[:, i])
    mask, d = ancestors(par.expand(N, s), int(depth.max()))
    chain = parents == [max(i - 1, 0) for i in range(s)]
    width = max(parents[1:].count(u) for u in range(s))
    block = Block(tokens, par.expand(N, s), mask, d, int(depth.max()), chain, width)
    if picks == "sampled":
        block.q, block.q_tok = q, q.gather(2, tokens[:, :, None])[:, :, 0]
    return block, target.at(ctx)


def emitted_joint(block: Block, logits: torch.Tensor, target: Model, params: SamplingParams,
                  g: torch.Generator, accept=accept_sampled) -> tuple[torch.Tensor, torch.Tensor]:
    """(outcome id of the first M emitted tokens per trial, accepted counts). Tokens past the round's
    are plain draws from p."""
    s = Sampler("cpu", N)
    s.reset(params)
    acc = accept(block, logits, s)
    out = torch.zeros(N, M, dtype=torch.int64)
    ctx = torch.zeros(N, dtype=torch.int64)
    for j in range(M):
        from_round = j <= acc.count
        round_tok = acc.tokens[:, min(j, acc.tokens.shape[1] - 1)]
        plain = torch.multinomial(target.probs(ctx, params), 1, generator=g)[:, 0]
        out[:, j] = torch.where(from_round, round_tok, plain)
        ctx = child_ctx(ctx, torch.full((N,), j), out[:, j])
    ids = (out * torch.tensor([V ** (M - 1 - j) for j in range(M)])).sum(-1)
    return ids, acc.count


CHAIN = [0, 0, 1, 2]                                                    # root + 3 drafts
# 1-4 siblings per node, depth 4 along one branch
TREE = [0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 3, 4, 4, 5, 8, 9, 9, 9, 11, 14]
TREE_B = [0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 4, 6, 7, 7, 12, 12]
T1 = SamplingParams(temperature=1.0, seed=11)
WARPED = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, seed=12)


def strong_disagreement(target: Model) -> Model:
    """A draft that puts its mass where the target puts little."""
    return Model(-1.5 * target.logits + 0.3 * torch.randn(target.logits.shape, generator=torch.Generator().manual_seed(9)))


# draft kinds: q far from p, q another random model, q = p (full acceptance), and deterministic picks
# (point masses: distinct siblings, or siblings that repeat a token)
CASES = ([("chain", "T1", k) for k in ("disagree", "other", "equal", "distinct")]
         + [("chain", "warped", k) for k in ("disagree", "equal")]
         + [("tree", "T1", k) for k in ("disagree", "other", "equal", "distinct", "repeats")]
         + [("tree", "warped", k) for k in ("disagree", "equal", "distinct")]
         + [("tree-b", "T1", k) for k in ("disagree", "equal")])


@pytest.mark.parametrize("shape, params, draft_kind", CASES)
def test_emitted_law_is_the_target_law(shape, params, draft_kind):
    parents = {"chain": CHAIN, "tree": TREE, "tree-b": TREE_B}[shape]
    params = {"T1": T1, "warped": WARPED}[params]
    g = torch.Generator().manual_seed(hash((tuple(parents), draft_kind, params.seed)) % 2**31)
    target = Model.random(1)
    draft = {"disagree": strong_disagreement(target), "other": Model.random(2), "equal": target}.get(draft_kind)
    picks = "sampled" if draft is not None else draft_kind
    block, logits = draft_round(parents, target, draft, params, g, picks)
    ids, count = emitted_joint(block, logits, target, params, g)
    p = exact_joint(target, params)
    assert tv(ids, p) < tv_bound(p, N)
    assert bool((count >= 0).all() and (count <= block.max_depth).all())
    if draft_kind == "equal":
        # q = p: the first child of every node is accepted, so the round goes down the first-child path
        # (but where p and q, computed in differently shaped batches, round apart by an ulp: 1 in ~1e5)
        first_child_depth = 0
        node = 0
        while node in parents[1:]:
            node = parents.index(node, 1)
            first_child_depth += 1
        assert float((count == first_child_depth).double().mean()) > 0.999


@pytest.mark.parametrize("parents", [CHAIN, TREE], ids=["chain", "tree"])
def test_broken_residual_fails_the_same_bound(parents, monkeypatch):
    """Control: if a rejection resampled from r instead of norm(max(0, r - q)), the law would be off."""
    g = torch.Generator().manual_seed(3)
    target = Model.random(1)
    block, logits = draft_round(parents, target, strong_disagreement(target), T1, g)
    monkeypatch.setattr(speculative, "_minus", lambda r, q: r)
    ids, _ = emitted_joint(block, logits, target, T1, g)
    p = exact_joint(target, T1)
    assert tv(ids, p) > 3 * tv_bound(p, N)


def test_first_draft_acceptance_rate_is_one_minus_tv():
    """Chain, first position: P(accept) = sum_x min(p(x), q(x)), Leviathan et al. 2023's alpha."""
    g = torch.Generator().manual_seed(4)
    target, draft = Model.random(1), Model.random(2)
    block, logits = draft_round(CHAIN, target, draft, T1, g)
    _, count = emitted_joint(block, logits, target, T1, g)
    root = torch.zeros(1, dtype=torch.int64)
    alpha = float(torch.minimum(target.probs(root, T1), draft.probs(root, T1)).sum())
    rate = float((count >= 1).double().mean())
    assert abs(rate - alpha) < 4.9 * (alpha * (1 - alpha) / N) ** 0.5     # 4.9 sigma: P < 1e-6


def test_point_masses_accept_with_probability_p():
    """Deterministic children: the root's children c1..cm are accepted with P = p(c_j) each."""
    g = torch.Generator().manual_seed(5)
    target = Model.random(1)
    parents = [0, 0, 0, 0]                                                 # three siblings, no depth
    block, logits = draft_round(parents, target, None, T1, g, "distinct")
    block.tokens[:] = torch.tensor([0, 2, 0, 3])
    s = Sampler("cpu", N)
    s.reset(T1)
    acc = accept_tree(block, logits, s)
    p = target.probs(torch.zeros(1, dtype=torch.int64), T1)[0]
    node = acc.path[:, 1]
    for i, tok in ((1, 2), (2, 0), (3, 3)):
        rate = float(((acc.count == 1) & (node == i)).double().mean())
        assert abs(rate - float(p[tok])) < 4.9 * (float(p[tok]) * (1 - float(p[tok])) / N) ** 0.5 + 1e-9
    # the bonus after rejecting all three is token 1, the one left
    assert bool((acc.tokens[acc.count == 0, 0] == 1).all())


def test_chain_block_with_sampled_drafts_through_the_block_helpers():
    """A chain_block with q over a drafter vocabulary mapped by q_ids (as the EAGLE3 head's):
    drafts never outside the draft vocabulary, and the residual is taken in target ids."""
    g = torch.Generator().manual_seed(6)
    target = Model.random(1)
    vq, q_ids = 2, torch.tensor([1, 3])                                    # the draft knows tokens 1 and 3 only
    drafts = torch.randint(0, vq, (N, 1), generator=g)
    q = torch.tensor([0.9, 0.1]).expand(N, 2, vq).clone()
    block = chain_block(torch.cat((torch.zeros(N, 1, dtype=torch.int64), q_ids[drafts]), 1))
    block.q, block.q_ids = q, q_ids
    block.q_tok = torch.ones(N, 2)
    block.q_tok[:, 1] = q[:, 1].gather(1, drafts)[:, 0]
    # tokens were drawn uniformly here, not from q: redraw them from q for the law to hold
    drafts = torch.multinomial(q[:, 1], 1, generator=g)
    block.tokens[:, 1] = q_ids[drafts[:, 0]]
    block.q_tok[:, 1] = q[:, 1].gather(1, drafts)[:, 0]
    ctx = torch.stack((torch.zeros(N, dtype=torch.int64), child_ctx(torch.zeros(N, dtype=torch.int64),
                                                                    torch.zeros(N, dtype=torch.int64), block.tokens[:, 1])), 1)
    s = Sampler("cpu", N)
    s.reset(T1)
    acc = accept_sampled(block, target.at(ctx), s)
    p = target.probs(torch.zeros(1, dtype=torch.int64), T1)[0]
    first = acc.tokens[:, 0]
    assert tv(first, p) < tv_bound(p, N)
