"""The pure tensor functions of runtime/decoding/speculative.py on hand-made blocks and logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xcompile.runtime.decoding.draft_tree import select_tree, target_table, topk_children
from xcompile.runtime.decoding.speculative import (
    Block,
    _stacked,
    accept_chain,
    accept_tree,
    ancestors,
    bonus,
    chain_block,
    compact_kv,
    for_host,
)
from xcompile.runtime.enginedir.contract import KVShape
from xcompile.runtime.engines.base import new_kv

V = 100


def logits_for(pred: list[list[int]]) -> torch.Tensor:
    """Logits [B, S, V] whose argmax at node i is pred[b][i]."""
    return F.one_hot(torch.tensor(pred), V).float() * 5 + 0.01 * torch.randn(len(pred), len(pred[0]), V)


def chain(tokens: list[list[int]]) -> Block:
    return chain_block(torch.tensor(tokens))


# a hand tree:      0 (root, 10)
#                 /            \
#             1 (20)           2 (21)
#               |                |
#             3 (30)           4 (31)
#                             /     \
#                          5 (41)   6 (42)
TREE_PARENTS = [0, 0, 0, 1, 2, 4, 4]
TREE_TOKENS = [10, 20, 21, 30, 31, 41, 42]


def hand_tree() -> Block:
    parents = torch.tensor([TREE_PARENTS])
    mask, depth = ancestors(parents, max_depth=3)
    return Block(torch.tensor([TREE_TOKENS]), parents, mask, depth, max_depth=3, chain=False)


def test_chain_block_structure():
    b = chain([[7, 1, 2, 3]])
    assert b.chain and b.max_depth == 3
    assert b.parents.tolist() == [[0, 0, 1, 2]]
    assert b.depth.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(b.mask[0], torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("drafts, pred, count, emitted", [
    ([1, 2, 3], [1, 2, 3, 9], 3, [1, 2, 3, 9]),        # all accepted + bonus
    ([1, 2, 3], [1, 5, 3, 9], 1, [1, 5]),              # mismatch at draft 2: a later match does not count
    ([1, 2, 3], [4, 2, 3, 9], 0, [4]),                 # nothing accepted: the bonus is the target's token
    ([1], [1, 6], 1, [1, 6]),                          # single-token draft
    ([], [6], 0, [6]),                                 # empty draft = plain decoding
])
def test_accept_chain(drafts, pred, count, emitted):
    block = chain([[50] + drafts])
    for accept in (accept_chain, accept_tree):
        acc = accept(block, logits_for([pred]))
        assert int(acc.count) == count
        assert acc.tokens[0, :count + 1].tolist() == emitted
        assert acc.path[0, :count + 1].tolist() == list(range(count + 1))
        assert bonus(acc).tolist() == [emitted[-1]]


def test_accept_chain_keeps_the_batch_axis():
    block = chain([[50, 1, 2], [50, 1, 2]])
    acc = accept_chain(block, logits_for([[1, 2, 7], [3, 2, 7]]))
    assert acc.count.tolist() == [2, 0]
    assert for_host(acc).tolist() == [[2, 1, 2, 7], [0, 3, 2, 7]]


def test_accept_tree_equals_accept_chain_on_chains():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens = torch.randint(0, 3, (4, 6), generator=g)            # small vocab: many partial matches
        logits = torch.randn(4, 6, 3, generator=g)
        block = chain_block(tokens)
        a, b = accept_chain(block, logits), accept_tree(block, logits)
        assert torch.equal(a.count, b.count)
        for row in range(4):
            n = int(a.count[row]) + 1
            assert torch.equal(a.tokens[row, :n], b.tokens[row, :n])
            assert torch.equal(a.path[row, :n], b.path[row, :n])


def test_ancestors_and_depth():
    block = hand_tree()
    assert block.depth.tolist() == [[0, 1, 1, 2, 2, 3, 3]]
    rows = [sorted(torch.nonzero(r).flatten().tolist()) for r in block.mask[0]]
    assert rows == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 4, 5], [0, 2, 4, 6]]


def test_accept_tree_takes_the_right_branch():
    # target greedy after each node: root -> 21 (branch 2, not 1), 2 -> 31, 4 -> 42 (node 6, not 5), 6 -> 77
    # node 3 would be right after node 1, but node 1 is wrong, so it must not count
    pred = [[21, 30, 31, 0, 42, 5, 77]]
    acc = accept_tree(hand_tree(), logits_for(pred))
    assert int(acc.count) == 3
    assert acc.path.tolist() == [[0, 2, 4, 6]]
    assert acc.tokens.tolist() == [[21, 31, 42, 77]]


@pytest.mark.parametrize("pred, count, path", [
    ([[99, 30, 31, 0, 42, 5, 77]], 0, [0]),            # root's child wrong everywhere: zero acceptance
    ([[20, 30, 31, 8, 42, 5, 77]], 2, [0, 1, 3]),      # the left branch, to its end
    ([[21, 30, 31, 0, 43, 5, 77]], 2, [0, 2, 4]),      # right branch, both leaves wrong
])
def test_accept_tree_partial(pred, count, path):
    acc = accept_tree(hand_tree(), logits_for(pred))
    assert int(acc.count) == count
    assert acc.path[0, :count + 1].tolist() == path
    assert acc.tokens[0, :count + 1].tolist() == [pred[0][i] for i in path]


def test_compact_kv_over_new_kv_buffers_is_one_move_with_the_same_result():
    """engine.new_kv's buffers are slices of one tensor: compact_kv moves them all in one gather/scatter,
    with the result of moving each buffer on its own (separate clones take the per-buffer path)."""
    bufs = new_kv(KVShape(layers=3, kv_heads=2, head_dim=4, max_seq_len=20, batch=2), torch.float32, "cpu")
    for b in bufs:
        b.copy_(torch.randn(b.shape))
    assert _stacked(bufs) is not None and _stacked(bufs).shape == (6, 2, 2, 20, 4)
    apart = [b.clone() for b in bufs]
    assert _stacked(apart) is None and _stacked(bufs[::2]) is None and _stacked(bufs[1:]) is not None
    write_index, path = torch.tensor([3, 9]), torch.tensor([[0, 1, 3, 5], [0, 2, 2, 2]])
    compact_kv(bufs, write_index, path)
    compact_kv(apart, write_index, path)
    assert all(torch.equal(a, b) for a, b in zip(bufs, apart))
    assert torch.equal(bufs[4][1, :, 10], apart[4][1, :, 11])          # batch row 1: path[1] = 2 -> slot 10


def test_compact_kv_moves_the_path_rows():
    # row r of every buffer holds the value r; the block starts at write_index 5
    bufs = [torch.arange(16.).view(1, 1, 16, 1).expand(1, 2, 16, 3).clone() for _ in range(2)]
    compact_kv(bufs, torch.tensor([5]), torch.tensor([[0, 2, 4, 6]]))
    for buf in bufs:
        rows = buf[0, :, :, 0]
        assert rows[:, :5].tolist() == [list(range(5))] * 2             # committed rows untouched
        assert rows[:, 5:9].tolist() == [[5, 7, 9, 11]] * 2             # sources overlap destinations
        assert rows[:, 9:].tolist() == [list(range(9, 16))] * 2


def test_topk_children_maps_draft_ids():
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0]]])
    d2t = torch.tensor([0, 10, 20, 30])
    logp, ids = topk_children(logits, target_table(d2t), 2)
    assert ids.tolist() == [[[11, 33]]]
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[..., [1, 3]])
    assert topk_children(logits, None, 2)[1].tolist() == [[[1, 3]]]


def test_select_tree_keeps_the_best_closed_subtree():
    # topk 2, depth 2: level 1 = pool 0, 1 (root's children); level 2 = pool 2..5, children of 0 and 1
    scores = torch.tensor([[-0.1, -1.0, -0.3, -2.0, -1.2, -3.0]])
    tokens = torch.tensor([[10, 11, 20, 21, 22, 23]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    block = select_tree(torch.tensor([5]), scores, tokens, parents, nodes=3, max_depth=2)
    assert block.tokens.tolist() == [[5, 10, 11, 20]]
    assert block.parents.tolist() == [[0, 0, 0, 1]]
    assert block.depth.tolist() == [[0, 1, 1, 2]]
    assert not block.chain and block.max_depth == 2


def test_select_tree_ties_keep_parents():
    # a child whose log-prob is 0 ties with its parent; the cut falls between them
    scores = torch.tensor([[-1.0, -0.5, -1.0, -4.0, -4.0, -4.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    block = select_tree(torch.tensor([5]), scores, torch.arange(6)[None], parents, nodes=2, max_depth=2)
    assert block.tokens.tolist() == [[5, 0, 1]]
    block = select_tree(torch.tensor([5]), torch.zeros(1, 6), torch.arange(6)[None], parents, nodes=3, max_depth=2)
    assert block.tokens.tolist() == [[5, 0, 1, 2]] and block.parents.tolist() == [[0, 0, 0, 1]]


def test_select_tree_random_pools_are_trees():
    g = torch.Generator().manual_seed(1)
    k, depth, b = 3, 4, 2
    for _ in range(10):
        # the pool of an EAGLE-2 expansion: k root children, then k*k per level under k expanded nodes
        scores, parents = [torch.log_softmax(torch.randn(b, k, generator=g), -1)], [torch.full((b, k), -1)]
        expanded, base = torch.arange(k).expand(b, k), 0
        for _level in range(1, depth):
            parent_scores = torch.cat(scores, 1).gather(1, expanded)
            cu = (torch.log_softmax(torch.randn(b, k, k, generator=g), -1) + parent_scores[:, :, None]).flatten(1)
            base += scores[-1].shape[1]
            scores.append(cu)
            parents.append(expanded.repeat_interleave(k, dim=1))
            expanded = base + cu.topk(k, -1).indices
        scores, parents = torch.cat(scores, 1), torch.cat(parents, 1)
        n = int(torch.randint(1, scores.shape[1] + 1, (1,), generator=g))
        block = select_tree(torch.zeros(b, dtype=torch.int64), scores, torch.arange(scores.shape[1]).expand(b, -1),
                            parents, n, depth)
        for row in range(b):
            kept = block.tokens[row, 1:].tolist()                       # pool indices, ascending
            assert kept == sorted(kept) and len(set(kept)) == n
            for i, pool in enumerate(kept, start=1):
                p = int(block.parents[row, i])
                want = int(parents[row, pool])
                assert (p == 0) if want < 0 else (p > 0 and kept[p - 1] == want)
                assert int(block.depth[row, i]) == int(block.depth[row, p]) + 1
            # the n kept have the n best scores
            assert torch.allclose(scores[row, kept].sort().values, scores[row].sort(descending=True).values[:n].sort().values)
