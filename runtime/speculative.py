"""Speculative decoding as pure tensor functions: the block to verify, greedy acceptance, KV compaction.

A round (DESIGN.md "Runtime"): a drafter proposes a ``Block`` (the root plus drafted tokens; a chain
is the tree whose node i hangs under node i-1), the target runs the block once, ``accept_chain`` or
``accept_tree`` keeps the longest drafted path the target agrees with plus one bonus token, and
``compact_kv`` moves that path's KV rows to contiguous slots. ``select_tree`` builds the EAGLE-2
dynamic tree from the draft's top-k candidates (reference/eagle3_semantics.md §4).

Every function takes and returns device tensors whose shapes depend only on the drafter's parameters
(never on values), reads nothing back to the host and keeps the batch axis, so a round can be
captured in a CUDA graph and costs one small copy back (``for_host``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Block:
    """Tokens the target verifies in one pass, as a tree rooted at the last committed token."""

    tokens: torch.Tensor    # [B, S] int64: the root (committed, not yet in the KV), then drafted target ids
    parents: torch.Tensor   # [B, S] int64: parent node of each node; the root is its own parent
    mask: torch.Tensor      # [B, S, S] bool: node i sees node j iff j is i or an ancestor (verify tree_mask)
    depth: torch.Tensor     # [B, S] int64: distance from the root; position_ids = write_index + depth
    max_depth: int          # longest drafted path the drafter can produce (Accepted has max_depth+1 slots)
    chain: bool             # node i's parent is i-1 for every i (no compaction needed)


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
                 max_depth=s - 1, chain=True)


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


def accept_chain(block: Block, logits: torch.Tensor) -> Accepted:
    """Greedy verification of a chain. logits [B, S, V] are the target's at every block node."""
    pred = logits.argmax(-1)                                                # [B, S]
    # Acceptance rule: draft i+1 is kept iff it equals the target's greedy token after node i and every
    # earlier draft was kept; cumprod zeroes everything from the first mismatch on.
    match = block.tokens[:, 1:] == pred[:, :-1]                             # [B, S-1]
    count = match.long().cumprod(-1).sum(-1)                                # [B]
    # pred[:, :a] are the accepted drafts themselves (they matched) and pred[:, a] is the bonus token
    path = torch.arange(pred.shape[1], device=pred.device).expand_as(pred)
    return Accepted(count, path, pred)


def accept_tree(block: Block, logits: torch.Tensor) -> Accepted:
    """Greedy verification of a tree (a chain works too). logits [B, S, V] at every block node."""
    b, s = block.tokens.shape
    pred = logits.argmax(-1)                                                # [B, S]
    node = torch.arange(s, device=pred.device)
    # a node is right iff its token is the target's greedy token after its parent (the root always is)
    right = (block.tokens == pred.gather(1, block.parents)) | (node == 0)
    # Acceptance rule: a node is accepted iff it and all its ancestors are right. Keep the deepest
    # accepted node (first on ties); every accepted path is the target's greedy continuation.
    accepted = ~(block.mask & ~right[:, None, :]).any(-1)                   # [B, S]
    best = torch.where(accepted, block.depth, -1).argmax(-1)                # [B]
    count = block.depth.gather(1, best[:, None])[:, 0]
    # path[j] = the ancestor of `best` at depth j (0, i.e. the root, past `count`)
    on_path = block.mask.gather(1, best[:, None, None].expand(b, 1, s))     # [B, 1, S]
    levels = torch.arange(block.max_depth + 1, device=pred.device)
    at_depth = on_path & (block.depth[:, None, :] == levels[None, :, None])  # [B, D+1, S]
    path = at_depth.long().argmax(-1)                                       # [B, D+1]
    return Accepted(count, path, pred.gather(1, path))


def compact_kv(kv: list[torch.Tensor], write_index: torch.Tensor, path: torch.Tensor) -> None:
    """Move the accepted path's KV rows write_index + path[j] to write_index + j, in place.

    kv: [B, Hkv, S_max, D] buffers; path [B, D+1]. Rows past the accepted count receive padding, which
    lies past the new cache length and is never read."""
    src = write_index[:, None] + path                                       # [B, D+1]
    dst = write_index[:, None] + torch.arange(path.shape[1], device=path.device)
    for buf in kv:
        b, h, _, d = buf.shape
        rows = buf.gather(2, src[:, None, :, None].expand(b, h, -1, d))    # a copy: src and dst may overlap
        buf.scatter_(2, dst[:, None, :, None].expand(b, h, -1, d), rows)


def bonus(acc: Accepted) -> torch.Tensor:
    """The bonus token [B]: the next round's root."""
    return acc.tokens.gather(1, acc.count[:, None])[:, 0]


def for_host(acc: Accepted) -> torch.Tensor:
    """[B, D+2]: the accepted count then the emitted tokens, the one tensor copied back per round."""
    return torch.cat((acc.count[:, None], acc.tokens), dim=1)


def to_target(draft_ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """EAGLE3 draft-vocab ids -> target ids by offsets: draft + d2t[draft] (eagle3_semantics.md §2)."""
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def topk_children(logits: torch.Tensor, d2t: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [B, R, Vd] -> (log-probs [B, R, k], target ids [B, R, k]) of each row's top k."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.values, to_target(top.indices, d2t)


def select_tree(root: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                nodes: int, max_depth: int) -> Block:
    """Keep the ``nodes`` best candidates of a draft pool as the tree under ``root`` (EAGLE-2).

    root [B]; scores [B, M] cumulative draft log-probs; tokens [B, M] target ids; parents [B, M] the
    pool index of each candidate's parent, -1 for the root's children. Parents precede children."""
    # A child's score is its parent's plus a log-prob <= 0 and it sits later in the pool, so a stable
    # descending sort ranks every parent before its children: the kept set is closed under ancestors.
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :nodes]
    keep = best.sort(dim=-1).values                                         # pool order, [B, N]
    parent = parents.gather(1, keep)
    # node index of the parent: 0 for the root, else 1 + its rank among the kept candidates
    parent = torch.where(parent < 0, 0, torch.searchsorted(keep, parent.clamp(min=0)) + 1)
    zero = torch.zeros_like(root)[:, None]
    node_parents = torch.cat((zero, parent), dim=1)                         # [B, N+1]
    mask, depth = ancestors(node_parents, max_depth)
    return Block(torch.cat((root[:, None], tokens.gather(1, keep)), dim=1), node_parents, mask, depth,
                 max_depth, chain=False)
