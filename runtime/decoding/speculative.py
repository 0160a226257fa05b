"""Speculative decoding as pure tensor functions: the block to verify, acceptance, KV compaction.

A round (docs/design.md, "The round"): a drafter proposes a ``Block`` (the root plus drafted tokens; a chain
is the tree whose node i hangs under node i-1), the target runs the block once, ``accept_chain`` or
``accept_tree`` keeps a drafted path plus one bonus token, and ``compact_kv`` moves that path's KV
rows to contiguous slots. draft_tree.py builds the EAGLE-2 dynamic tree from the draft's top-k
candidates (docs/eagle3.md §4).

Acceptance takes the request's ``Sampler``. Greedy (temperature 0): the longest path the target's
argmax agrees with, so the output equals plain greedy decoding. Sampling: speculative (rejection)
sampling, so every emitted token is distributed exactly as the target's warped distribution p,
whatever the drafter proposes (``accept_sampled``).

Every function takes and returns device tensors whose shapes depend only on the drafter's parameters
(never on values), reads nothing back to the host and keeps the batch axis, so a round can be
captured in a CUDA graph and costs one small copy back (``for_host``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xcompile.runtime.decoding.sampling import Sampler
from xcompile.runtime.engines.base import KV_FP8


@dataclass
class Block:
    """Tokens the target verifies in one pass, as a tree rooted at the last committed token."""

    tokens: torch.Tensor    # [B, S] int64: the root (committed, not yet in the KV), then drafted target ids
    parents: torch.Tensor   # [B, S] int64: parent node of each node; the root is its own parent
    mask: torch.Tensor      # [B, S, S] bool: node i sees node j iff j is i or an ancestor (verify tree_mask)
    depth: torch.Tensor     # [B, S] int64: distance from the root; position_ids = write_index + depth
    max_depth: int          # longest drafted path the drafter can produce (Accepted has max_depth+1 slots)
    chain: bool             # node i's parent is i-1 for every i (no compaction needed)
    width: int | None = None    # most children a node can have (None: S-1); bounds sampled-sibling loops
    # Sampling: the warped draft distribution each node's token was drawn from. None: the drafts are
    # deterministic picks (argmax, the tree's top-k), i.e. point masses, and need no probabilities.
    q: torch.Tensor | None = None       # [B, S, Vq] float32 (row 0, the root, unused)
    q_tok: torch.Tensor | None = None   # [B, S] q of each node's own token
    q_ids: torch.Tensor | None = None   # [Vq] target id of each column of q (EAGLE3 draft vocab); None: identity
    # [B, S] int64 write_index + depth, where the drafter computed them this round (the verify's position_ids;
    # None: the generator adds them)
    positions: torch.Tensor | None = None


@dataclass
class Accepted:
    """Outcome of one verify pass. Entries past ``count`` are padding (valid ids, meaningless)."""

    count: torch.Tensor     # [B] int64: a, the drafted tokens accepted (0..max_depth)
    path: torch.Tensor      # [B, D+1] int64: block nodes root -> deepest accepted node (padding: 0)
    tokens: torch.Tensor    # [B, D+1] int64: emitted tokens: the a accepted drafts, then the bonus at index a


def chain_block(tokens: torch.Tensor) -> Block:
    """A chain over a (preallocated) token buffer [B, k+1]: root then k drafts. The structure tensors
    are constants; drafters build the block once and rewrite ``tokens`` in place every round."""
    b, s = tokens.shape
    node = torch.arange(s, device=tokens.device)
    mask = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
    return Block(tokens, (node - 1).clamp(min=0).expand(b, s), mask.expand(b, s, s), node.expand(b, s),
                 max_depth=s - 1, chain=True, width=1)


def ancestors(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, S] (root at 0, its own parent) -> (ancestor-or-self mask [B, S, S], depth [B, S]).

    Pointer jumping: ``max_depth`` gathers walk every node up to the root, marking each ancestor."""
    b, s = parents.shape
    mask = torch.eye(s, dtype=torch.bool, device=parents.device).expand(b, s, s).clone()
    node = torch.arange(s, device=parents.device).expand(b, s)
    for _ in range(max_depth):
        node = parents.gather(1, node)          # one level up; the root stays where it is
        mask.scatter_(2, node[:, :, None], True)
    return mask, mask.sum(-1) - 1


def accept_chain(block: Block, logits: torch.Tensor, sampler: Sampler | None = None) -> Accepted:
    """Verification of a chain. logits [B, S, V] are the target's at every block node."""
    if sampler is not None and not sampler.greedy:
        return accept_sampled(block, logits, sampler)
    pred = logits.argmax(-1)                                                # [B, S]
    # Acceptance rule: draft i+1 is kept iff it equals the target's greedy token after node i and every
    # earlier draft was kept; cumprod zeroes everything from the first mismatch on.
    match = block.tokens[:, 1:] == pred[:, :-1]                             # [B, S-1]
    count = match.long().cumprod(-1).sum(-1)                                # [B]
    # pred[:, :a] are the accepted drafts themselves (they matched) and pred[:, a] is the bonus token
    path = torch.arange(pred.shape[1], device=pred.device).expand_as(pred)
    return Accepted(count, path, pred)


def accept_tree(block: Block, logits: torch.Tensor, sampler: Sampler | None = None) -> Accepted:
    """Verification of a tree (a chain works too). logits [B, S, V] at every block node."""
    if sampler is not None and not sampler.greedy:
        return accept_sampled(block, logits, sampler)
    b, s = block.tokens.shape
    pred = logits.argmax(-1)                                                # [B, S]
    node = torch.arange(s, device=pred.device)
    # a node is right iff its token is the target's greedy token after its parent (the root always is)
    right = (block.tokens == pred.gather(1, block.parents)) | (node == 0)
    # Acceptance rule: a node is accepted iff it and all its ancestors are right. Keep the deepest
    # accepted node (first on ties); every accepted path is the target's greedy continuation.
    accepted = ~(block.mask & ~right[:, None, :]).any(-1)                   # [B, S]
    best = torch.where(accepted, block.depth, -1).argmax(-1)                # [B]
    count, path = _path_to(block, best)
    return Accepted(count, path, pred.gather(1, path))


def _path_to(block: Block, best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth of node ``best`` [B], path [B, D+1]: its ancestor at depth j, the root past its depth)."""
    b, s = block.tokens.shape
    count = block.depth.gather(1, best[:, None])[:, 0]
    on_path = block.mask.gather(1, best[:, None, None].expand(b, 1, s))     # [B, 1, S]
    levels = torch.arange(block.max_depth + 1, device=best.device)
    at_depth = on_path & (block.depth[:, None, :] == levels[None, :, None])  # [B, D+1, S]
    return count, at_depth.long().argmax(-1)


def accept_sampled(block: Block, logits: torch.Tensor, sampler: Sampler) -> Accepted:
    """Speculative sampling over a chain or a tree: the emitted tokens are distributed exactly as the
    target's warped p, token by token. logits [B, S, V] at every block node.

    Rule (recursive rejection sampling over siblings: SpecInfer's multi-step speculative sampling,
    Miao et al., ASPLOS 2024; EAGLE-2/3's tree sampling, SafeAILab/EAGLE eagle/model/utils.py
    ``evaluate_posterior``, which takes q = 1 for its top-k drafts).
    At an accepted node, with residual r = p(. | node), try its children in node order: child x drawn
    from q is accepted with probability min(1, r(x) / q(x)); if rejected, r <- norm(max(0, r - q)) and
    the next child is tried against it. The walk descends into the accepted child; where no child is
    accepted (or at a leaf), the bonus token is drawn from the residual left there. Each step emits
    r exactly (modified rejection sampling: Chen et al. 2023, Theorem 1; Leviathan et al. 2023, App. A,
    applied sibling by sibling), so a chain is the classic rule with bonus from p, and deterministic
    drafts (q = None: point masses q = delta_x, the EAGLE-2 tree and greedy drafters) accept x with
    probability r(x) and zero it in the residual. Drafts must not depend on the verify's coins.

    Every node's coin is tossed at once and the walk is a mask computation, so shapes depend only on
    the block (S coins and one V-row of noise per round) and nothing is read back."""
    b, s = block.tokens.shape
    dev = logits.device
    if s == 1 and sampler.draws_by_kernel:
        # plain decoding (no drafts): the token is a draw from p, by the sampling kernels; the root's coin below
        # is drawn and never used, so the stream advances by it all the same
        sampler.counter.add_(1)
        zero = torch.zeros(b, 1, dtype=torch.long, device=dev)
        return Accepted(zero[:, 0], zero, sampler.sample(logits[:, 0])[:, None])
    w = sampler.warp(logits)                                                # rows: block nodes
    node = torch.arange(s, device=dev)
    x, par = block.tokens, block.parents
    drafted = node > 0                                                      # [S]: the root is not a draft
    p_x = w.prob_at(par, x)                                                 # [B, S] p(x_i | parent of i)
    u = sampler.uniform(s)                                                  # [B, S] one coin per node
    if block.chain:
        # one child per node: r = p, and the walk stops at the first rejection
        passed = u * (1.0 if block.q is None else block.q_tok) < p_x
        count = passed[:, 1:].long().cumprod(-1).sum(-1)                    # [B]
        best, path = count, node.expand(b, s)
        rank = torch.zeros_like(x)
    else:
        # earlier[b, i, j]: node j is a sibling of node i that comes before it (tried first)
        earlier = (par[:, :, None] == par[:, None, :]) & (node[:, None] > node[None, :]) & drafted[None, :]
        rank = earlier.sum(-1)                                              # [B, S] order among siblings
        if block.q is None:
            # point masses: r = p with the earlier siblings' tokens zeroed, r(x) = p(x) / (mass left);
            # a repeated token was already rejected, r(x) = 0
            p_x = torch.where((earlier & (x[:, :, None] == x[:, None, :])).any(-1), 0.0, p_x)
            passed = u * (1 - (earlier * p_x[:, None, :]).sum(-1)) < p_x    # U < r(x) / q(x), q(x) = 1
        else:
            passed = u * block.q_tok < _residual_at(block, w, rank, p_x)
        passed = passed & drafted
        first = passed & ~(earlier & passed[:, None, :]).any(-1) | ~drafted  # the first sibling to pass
        # accepted nodes (it and every ancestor first to pass) form one path from the root
        accepted = ~(block.mask & ~first[:, None, :]).any(-1)               # [B, S]
        best = torch.where(accepted, block.depth, -1).argmax(-1)            # [B]
        count, path = _path_to(block, best)
    # the bonus: drawn from the residual at `best` once every child of it has been rejected
    children = (par == best[:, None]) & drafted                             # [B, S]
    p = w.row(best).probs()                                                 # [B, V]
    if block.q is None:
        hit = torch.zeros_like(p).scatter_add_(1, x, children.float())
        r = torch.where(hit > 0, 0.0, p)
    else:
        r = p
        for j in range(_width(block)):
            child = children & (rank == j)                                  # at most one node per row
            q = _q_rows(block, torch.where(child, node, 0).argmax(-1)[:, None], p.shape[-1])[:, 0]
            r = torch.where(child.any(-1, keepdim=True), _minus(r, q), r)
    r = torch.where(r.sum(-1, keepdim=True) > 0, r, p)    # rounding left nothing: p itself (never reached exactly)
    extra = sampler.gumbel_argmax(torch.log(r))                             # [B]
    # emitted: the accepted drafts along the path, then the bonus at index `count`
    drafts = x.gather(1, path).roll(-1, dims=1)
    slots = torch.arange(path.shape[1], device=dev)
    tokens = torch.where(slots[None] == count[:, None], extra[:, None], drafts)
    return Accepted(count, path, tokens)


def _width(block: Block) -> int:
    return block.tokens.shape[1] - 1 if block.width is None else block.width


def _minus(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, r - q)) over the last axis (r left as is where that is all zero: r = q exactly,
    where rejection cannot happen)."""
    d = (r - q).clamp(min=0)
    z = d.sum(-1, keepdim=True)
    return torch.where(z > 0, d / torch.where(z > 0, z, 1.0), r)


def _q_rows(block: Block, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draft distributions of nodes rows [B, R] over the target vocabulary: [B, R, V]."""
    q = block.q.gather(1, rows[:, :, None].expand(-1, -1, block.q.shape[-1]))
    if block.q_ids is None:
        return q
    return q.new_zeros(*q.shape[:2], vocab).scatter_(2, block.q_ids.expand_as(q), q)


def _residual_at(block: Block, w, rank: torch.Tensor, p_x: torch.Tensor) -> torch.Tensor:
    """[B, S] r(x_i): the residual at node i's parent after its earlier siblings (rank [B, S] of them)
    were rejected, for tree drafts drawn from block.q: one subtraction per sibling rank over every
    parent row (trees with sampled siblings: tests and small trees)."""
    if _width(block) == 1:
        return p_x
    b, s = p_x.shape
    node = torch.arange(s, device=p_x.device)
    par = block.parents
    # child[b, u, j]: node index of the j-th child of node u (s: none; the root is nobody's child)
    slot = torch.where(node > 0, par * s + rank, s * s)
    child = torch.full((b, s * s + 1), s, dtype=torch.int64, device=p_x.device).scatter_(1, slot, node.expand(b, s))
    child = child[:, :-1].view(b, s, s)
    r = w.probs()                                                           # [B, S, V]: per parent row
    q = torch.cat((_q_rows(block, node.expand(b, s), r.shape[-1]), r.new_zeros(b, 1, r.shape[-1])), 1)
    out = p_x
    for j in range(1, _width(block)):
        # subtract each parent's rank j-1 child's q from its row, then read the rank-j children there
        c = child[:, :, j - 1]                                              # [B, S]
        r = torch.where((c < s)[:, :, None], _minus(r, q.gather(1, c[:, :, None].expand(-1, -1, r.shape[-1]))), r)
        got = r.flatten(1).gather(1, par * r.shape[-1] + block.tokens)
        out = torch.where(rank == j, got, out)
    return out


def compact_kv(kv: list[torch.Tensor], write_index: torch.Tensor, path: torch.Tensor) -> None:
    """Move the accepted path's KV rows write_index + path[j] to write_index + j, in place.

    kv: [B, Hkv, S_max, D] buffers; path [B, D+1]. Rows past the accepted count receive padding, which
    lies past the new cache length and is never read. Buffers that are slices of one tensor (engine.new_kv)
    move in one gather and one scatter over all of them (2 launches, not 2 per buffer: 144 for Qwen3-8B)."""
    src = write_index[:, None] + path                                       # [B, D+1]
    dst = write_index[:, None] + torch.arange(path.shape[1], device=path.device)
    stacked, b = _stacked(kv), path.shape[0]
    # buffers of more slots than the block's sequences (a batch dir's lone sequence, decoding/solo.py): rows 0..B-1
    for buf in [stacked[:, :b]] if stacked is not None else [t[:b] for t in kv]:
        if buf.dtype == KV_FP8:
            buf = buf.view(torch.uint8)                                      # an FP8 cache's codes, as bytes
        moved = buf.gather(-2, _row_index(src, buf))                         # a copy: src and dst may overlap
        buf.scatter_(-2, _row_index(dst, buf), moved)


def _row_index(rows: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """rows [B, P] -> an index over buf's row dim (-2), broadcast over its others: buf [..., B, Hkv, S, D]."""
    lead = [1] * (buf.dim() - 4)                                             # the stack's dim, if any
    return rows.view(*lead, rows.shape[0], 1, rows.shape[1], 1).expand(*buf.shape[:-2], -1, buf.shape[-1])


def _stacked(kv: list[torch.Tensor]) -> torch.Tensor | None:
    """kv as one [N, B, Hkv, S_max, D] view when its buffers are equal contiguous slices, back to back and in
    order, of one storage (engine.new_kv's layout), else None. Host-side checks only."""
    if len(kv) < 2 or not all(b.is_contiguous() for b in kv):
        return None
    first, size = kv[0], kv[0].element_size()
    step = kv[1].data_ptr() - first.data_ptr()
    if step != first.numel() * size:
        return None
    storage = first.untyped_storage().data_ptr()
    for i, b in enumerate(kv):
        if (b.shape != first.shape or b.dtype != first.dtype or b.untyped_storage().data_ptr() != storage
                or b.data_ptr() - first.data_ptr() != i * step):
            return None
    return first.as_strided((len(kv), *first.shape), (step // size, *first.stride()))


def bonus(acc: Accepted) -> torch.Tensor:
    """The bonus token [B]: the next round's root."""
    return acc.tokens.gather(1, acc.count[:, None])[:, 0]


def for_host(acc: Accepted) -> torch.Tensor:
    """[B, D+2]: the accepted count then the emitted tokens, the one tensor copied back per round."""
    return torch.cat((acc.count[:, None], acc.tokens), dim=1)
