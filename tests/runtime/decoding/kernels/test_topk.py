"""The tree drafter's per-level kernels (runtime/decoding/kernels/topk.py) against the torch ops they replace
(runtime/decoding/speculative.py), exactly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")


DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab,k", [(1, 1000, 10), (10, 10000, 10), (3, 8200, 1), (4, 5000, 16)])
@pytest.mark.parametrize("mapped", [False, True])
def test_topk_children_kernel_matches_torch(rows, vocab, k, mapped, dtype):
    """The two-launch top-k of the draft log-probs: draft_tree.topk_children's ids and its
    log-probs to 1e-6 (the log-sum-exp summed in block order), over several column blocks (4096 columns
    each), batch 2, with and without the draft -> target table. Ties (many in bf16) go to the lower column,
    so the reference is a stable sort (torch.topk leaves their order open; in fp32 there are none)."""
    from xcompile.runtime.decoding.draft_tree import target_table, to_target, topk_children
    from xcompile.runtime.decoding.kernels import topk as K
    torch.manual_seed(rows + vocab)
    logits = (3 * torch.randn(2, rows, vocab, device=DEV)).to(dtype)
    targets = target_table(torch.randperm(3 * vocab, device=DEV)[:vocab].sort().values - torch.arange(vocab, device=DEV)) \
        if mapped else None
    want_logp, want_ids = topk_children(logits, targets, k)
    if dtype == torch.bfloat16:
        ranked = torch.log_softmax(logits.float(), dim=-1).sort(dim=-1, descending=True, stable=True)
        want_logp, want_ids = ranked.values[..., :k], to_target(ranked.indices[..., :k], targets)
    for _ in range(2):                                      # the block partials are reused
        logp, ids = K.topk_children(logits, targets, k)
        assert torch.equal(ids, want_ids)
        assert (logp - want_logp).abs().max().item() < 1e-6 * max(1.0, want_logp.abs().max().item())


@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("k,level", [(10, 1), (10, 4), (3, 2), (1, 3)])
def test_expand_level_kernel_equals_the_drafter_ops(k, level, last, h=96):
    """The one-launch pool update: the same scores, tokens, parents, expanded tokens,
    hidden, masks and next level's scores / pool indices as draft_tree.expand_level, batch 2."""
    from xcompile.runtime.decoding.draft_tree import expand_level
    from xcompile.runtime.decoding.kernels import topk as K
    torch.manual_seed(k * 10 + level)
    b, depth = 2, 6
    n, m = k * (depth - 1), k + (depth - 1) * k * k
    s, base = k * level, k + (level - 1) * k * k
    logp, tok = -torch.rand(b, k, k, device=DEV) * 4, torch.randint(0, 500, (b, k, k), device=DEV)
    hidden = torch.randn(b, k, h, device=DEV).to(torch.bfloat16)
    ex_score, ex_pool = -torch.rand(b, k, device=DEV) * 4, torch.randint(0, base, (b, k), device=DEV)
    mask = torch.rand(b, n, n, device=DEV) < 0.5
    state = [torch.zeros(b, m, device=DEV), torch.zeros(b, m, dtype=torch.int64, device=DEV),
             torch.full((b, m), -1, dtype=torch.int64, device=DEV), torch.zeros(b, n, dtype=torch.int64, device=DEV),
             torch.zeros(b, n, h, dtype=torch.bfloat16, device=DEV), mask]
    want = [ex_score.clone(), ex_pool.clone()] + [t.clone() for t in state]
    got = [ex_score.clone(), ex_pool.clone()] + [t.clone() for t in state]
    next_want = expand_level(logp, tok, want[0], want[1], hidden, *want[2:], base, s, last)
    nxt = (torch.full_like(ex_score, float("nan")), torch.full_like(ex_pool, -7))
    next_got = K.expand_level(logp, tok, got[0], got[1], hidden, *got[2:], base, s, last, out=nxt)
    for a, w in zip(got + list(next_got if not last else ()), want + list(next_want if not last else ())):
        assert torch.equal(a, w)


@pytest.mark.gpu
def test_tree_kernels_at_the_qwen3_8b_tree_on_the_gpu():
    """The tree kernels at the benchmark's shapes (10/6/32 tree, the 32000-token draft vocabulary in bf16,
    hidden 4096): the same results as their references (the selection: test_tree.py)."""
    test_topk_children_kernel_matches_torch(10, 32000, 10, True, torch.bfloat16)
    test_expand_level_kernel_equals_the_drafter_ops(10, 3, False, h=4096)


def test_topk_kernels_with_masked_logits():
    """-inf logits (a whole column block of them, or all but two columns) give torch's finite log-probs and
    the stable order's ids, each id once; the pool update never expands a node twice when fewer than k
    children are finite; NaN logits give ids in range (meaningless values, no fault)."""
    from xcompile.runtime.decoding.draft_tree import expand_level
    from xcompile.runtime.decoding.kernels import topk as K
    torch.manual_seed(9)
    x = torch.randn(1, 2, 10000, device=DEV)
    x[..., 4096:8192] = float("-inf")                       # the second column block: every entry masked
    x[0, 1, 2:] = float("-inf")
    x[0, 1, 40], x[0, 1, 5] = 3.0, 1.0                      # row 1: columns 5 and 40 only (and 0, 1)
    ranked = torch.log_softmax(x, dim=-1).sort(dim=-1, descending=True, stable=True)
    logp, ids = K.topk_children(x, None, 6)
    assert torch.equal(ids, ranked.indices[..., :6]) and ids[0, 1, :4].tolist() == [40, 5, 0, 1]
    assert torch.equal(logp.isfinite(), ranked.values[..., :6].isfinite())
    fin = logp.isfinite()
    assert (logp[fin] - ranked.values[..., :6][fin]).abs().max() < 1e-5
    k, b, h = 3, 1, 16
    logp = torch.full((b, k, k), float("-inf"), device=DEV)
    logp[0, 1, 2] = -1.0                                    # one finite child
    tok = torch.arange(k * k, device=DEV).view(b, k, k)
    state = [torch.zeros(b, 30, device=DEV), torch.zeros(b, 30, dtype=torch.int64, device=DEV),
             torch.zeros(b, 30, dtype=torch.int64, device=DEV), torch.zeros(b, 6, dtype=torch.int64, device=DEV),
             torch.zeros(b, 6, h, device=DEV), torch.eye(6, dtype=torch.bool, device=DEV)[None].clone()]
    nxt = (torch.zeros(b, k, device=DEV), torch.zeros(b, k, dtype=torch.int64, device=DEV))
    args = (torch.zeros(b, k, device=DEV), torch.arange(k, device=DEV)[None].clone(), torch.randn(b, k, h, device=DEV))
    want = [t.clone() for t in state]
    _, pool = K.expand_level(logp, tok, *args, *state, base=3, s=3, last=False, out=nxt)
    assert pool[0].tolist() == [3 + 5, 3 + 0, 3 + 1]        # the finite child, then the rest in flat order
    expand_level(logp, tok, *args, *want, base=3, s=3, last=False)
    assert torch.equal(state[0], want[0]) and torch.equal(state[1], want[1])    # scores and tokens of the pool
    ids = K.topk_children(torch.full((1, 2, 5000), float("nan"), device=DEV), None, 4)[1]
    assert ((ids >= 0) & (ids < 5000)).all()
