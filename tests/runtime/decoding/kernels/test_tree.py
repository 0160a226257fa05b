"""The EAGLE-2 tree's selection in one launch (runtime/decoding/kernels/tree.py) against
draft_tree.select_tree, exactly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")


DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def random_pool(batch: int, topk: int, depth: int, seed: int, ties: bool):
    """A draft pool as the tree drafter makes one: the root's topk children, then per level topk^2 children of
    topk earlier candidates, each child's score its parent's plus a log-prob <= 0 (quantized: many ties, and
    log-probs of exactly 0, i.e. children tied with their parent; a -0.0 among them)."""
    g = torch.Generator().manual_seed(seed)
    m = topk + (depth - 1) * topk * topk
    scores, parents = torch.zeros(batch, m), torch.full((batch, m), -1, dtype=torch.int64)
    for b in range(batch):
        logp = -torch.rand(m, generator=g) * 3
        if ties:
            logp = (logp * 2).round() / 2
        scores[b, :topk] = logp[:topk]
        base = topk
        for _ in range(depth - 1):
            expanded = torch.randperm(base, generator=g)[:topk]                    # earlier candidates
            for j in range(topk * topk):
                parent = int(expanded[j // topk])
                parents[b, base + j], scores[b, base + j] = parent, scores[b, parent] + logp[base + j]
            base += topk * topk
    if ties:
        scores[0, 1] = -0.0
    tokens = torch.randint(0, 1000, (batch, m), generator=g)
    return scores.to(DEV), tokens.to(DEV), parents.to(DEV), torch.randint(0, 1000, (batch,), generator=g).to(DEV)


@pytest.mark.parametrize("topk,depth,nodes", [(10, 6, 31), (4, 4, 20), (2, 3, 5), (1, 5, 4), (8, 8, 63)])
@pytest.mark.parametrize("ties", [False, True])
def test_select_tree_kernel_equals_select_tree(topk, depth, nodes, ties):
    """The one-launch selection gives select_tree's tokens, parents, mask and depth exactly
    (ties ranked as the stable sort ranks them), batch 2."""
    from xcompile.runtime.decoding.draft_tree import select_tree
    from xcompile.runtime.decoding.kernels.tree import TreeBuffers, select_tree_into
    scores, tokens, parents, root = random_pool(2, topk, depth, topk * 10 + depth, ties)
    want = select_tree(root, scores, tokens, parents, nodes, depth)
    out = TreeBuffers(2, nodes, scores.device)
    for _ in range(2):                                      # rewritten in place: the second call sees the first's
        select_tree_into(out, root, scores, tokens, parents, depth)
        for name in ("tokens", "parents", "mask", "depth"):
            assert torch.equal(getattr(out, name), getattr(want, name)), name


@pytest.mark.gpu
def test_select_tree_kernel_at_the_qwen3_8b_tree_on_the_gpu():
    """The selection at the benchmark's 10/6/32 tree, with ties."""
    test_select_tree_kernel_equals_select_tree(10, 6, 31, True)
