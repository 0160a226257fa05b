"""The EAGLE-2 dynamic tree as tensor functions (docs/eagle3.md §4): draft ids mapped to the target's
vocabulary, each level's top-k children scored into a candidate pool (``expand_level``), and the best
``nodes`` of the pool kept as the tree to verify (``select_tree``). kernels/topk.py and kernels/tree.py are
their fused forms on CUDA; these are the references and the CPU path. Like speculative.py's, every function
keeps the batch axis and shapes that depend only on the drafter's parameters, and reads nothing back.
"""

from __future__ import annotations

import torch

from xcompile.runtime.decoding.speculative import Block, ancestors


def target_table(d2t: torch.Tensor | None) -> torch.Tensor | None:
    """EAGLE3's d2t offsets [Vd] -> the target id of every draft id, draft + d2t[draft] (docs/eagle3.md
    §2), so that mapping ids is one lookup; None (draft and target share the vocabulary) stays None."""
    return None if d2t is None else torch.arange(d2t.numel(), device=d2t.device) + d2t


def to_target(draft_ids: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """EAGLE3 draft-vocab ids -> target ids: targets[draft] (targets = target_table(d2t))."""
    return draft_ids if targets is None else targets[draft_ids]


def topk_children(logits: torch.Tensor, targets: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [B, R, Vd] -> (log-probs [B, R, k], target ids [B, R, k]) of each row's top k
    (targets: target_table's lookup)."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.values, to_target(top.indices, targets)


def expand_level(logp: torch.Tensor, tok: torch.Tensor, ex_score: torch.Tensor, ex_pool: torch.Tensor,
                 hidden: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                 ex_tokens: torch.Tensor, ex_hidden: torch.Tensor, ex_mask: torch.Tensor, base: int, s: int,
                 last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree level's children into the draft pool, in place: logp / tok [B, k, k] the top-k children of
    the k expanded nodes (ex_score [B, k] their cumulative scores, ex_pool their pool indices, hidden
    [B, k, H] their draft outputs) go to scores / tokens / parents[:, base:base + k*k] (a child's score is
    its log-prob plus its parent's). But for the last level, the k best children become the next expanded
    nodes s..s+k-1: their token, input hidden (the parent's output) and ancestor mask row (the parent's,
    columns < s; the diagonal is preset). Returns their (scores, pool indices) [B, k]; after the last
    level, ex_score / ex_pool."""
    b, k, _ = logp.shape
    pool = slice(base, base + k * k)
    cu = torch.add(logp, ex_score[:, :, None], out=scores[:, pool].view(b, k, k)).flatten(1)
    tokens[:, pool] = tok = tok.flatten(1)
    parents[:, pool].view(b, k, k).copy_(ex_pool[:, :, None].expand(-1, -1, k))
    if last:
        return ex_score, ex_pool
    score, top = cu.topk(k, dim=-1)
    parent = top // k                                                        # which expanded node [B, k]
    torch.gather(tok, 1, top, out=ex_tokens[:, s:s + k])
    torch.gather(hidden, 1, parent[:, :, None].expand(-1, -1, hidden.shape[-1]), out=ex_hidden[:, s:s + k])
    rows = ex_mask[:, s - k:s, :s]
    torch.gather(rows, 1, parent[:, :, None].expand(-1, -1, s), out=ex_mask[:, s:s + k, :s])
    return score, base + top


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
