"""The EAGLE-2 tree's selection in one launch: draft_tree.select_tree's sorts, parent ranks and ancestor walk.

    scores [B, M] fp32 cumulative draft log-probs, tokens [B, M] int64 target ids, parents [B, M] int64 pool
    index of each candidate's parent (-1: the root's), root [B]
    ->  the Block's tokens [B, N+1], parents [B, N+1], ancestor-or-self mask [B, N+1, N+1] and depth [B, N+1]

One program per batch row, the pool in registers: the N best candidates by a stable descending sort (ties:
the earlier candidate first, as torch.sort(stable=True) ranks them), kept in pool order; a node's parent is
1 + the rank of its parent among the kept (0: the root); the ancestor mask is I | P A, MAX_DEPTH times (P
the parent matrix, products of 0/1 matrices in fp32: exact). The same tensors as select_tree (the
reference it is tested against), in one launch instead of about thirty small ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xcompile.runtime.decoding.kernels import launch, pdl


@triton.jit
def _select_tree_kernel(SCORES, TOKENS, PARENTS, ROOT, KEEP, OUT_TOK, OUT_PAR, OUT_MASK, OUT_DEPTH, M, N,
                        MAX_DEPTH: tl.constexpr, MP2: tl.constexpr, SP2: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    i = tl.arange(0, MP2)
    s = tl.load(SCORES + b * M + i, mask=i < M, other=float("-inf")) + 0.0           # -0.0 -> 0.0: they tie
    bits = s.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)                # ordered as the floats are, as signed integers
    # descending by score, then ascending by index (the padding, at -inf past every index, sorts last)
    packed = (key.to(tl.int64) << 32) | (MP2 - 1 - i).to(tl.int64)
    ranked = MP2 - 1 - (tl.sort(packed, descending=True) & 0xFFFFFFFF).to(tl.int32)
    kept = tl.sort(tl.where(i < N, ranked, MP2))            # the N best, in pool order (the rest past them)
    tl.store(KEEP + b * N + i, kept, mask=i < N)
    tl.debug_barrier()
    n = tl.arange(0, SP2)                                   # block node n; kept candidate n - 1
    node = (n >= 1) & (n <= N)
    keep = tl.load(KEEP + b * N + n - 1, mask=node, other=0)
    parent = tl.load(PARENTS + b * M + keep, mask=node, other=-1)
    # a kept parent's node: 1 + how many kept candidates precede it in the pool (it is kept itself)
    keep_row = tl.load(KEEP + b * N + n, mask=n < N, other=MP2)
    rank = tl.sum(((keep_row[None, :] < parent[:, None]) & (n < N)[None, :]).to(tl.int32), axis=1)
    node_parent = tl.where(parent < 0, 0, rank + 1)         # the root (n = 0) is its own parent: 0
    tl.store(OUT_PAR + b * (N + 1) + n, node_parent.to(tl.int64), mask=n <= N)
    token = tl.where(node, tl.load(TOKENS + b * M + keep, mask=node, other=0), tl.load(ROOT + b))
    tl.store(OUT_TOK + b * (N + 1) + n, token, mask=n <= N)
    # ancestor-or-self mask: A = I, then A = I | P A (P[u, v]: v is u's parent) MAX_DEPTH times
    eye = ((n[:, None] == n[None, :]) & (n <= N)[:, None]).to(tl.float32)
    p = ((node_parent[:, None] == n[None, :]) & node[:, None]).to(tl.float32)
    a = eye
    for _ in tl.static_range(MAX_DEPTH):
        a = tl.where(eye + tl.dot(p, a, input_precision="ieee") > 0, 1.0, 0.0)
    inside = (n <= N)[:, None] & (n <= N)[None, :]
    tl.store(OUT_MASK + b * (N + 1) * (N + 1) + n[:, None] * (N + 1) + n[None, :], (a > 0).to(tl.int8), mask=inside)
    depth = tl.sum(a, axis=1).to(tl.int64) - 1
    tl.store(OUT_DEPTH + b * (N + 1) + n, depth, mask=n <= N)


class TreeBuffers:
    """The selected tree's tensors, allocated once (a drafter rewrites them every round): tokens, parents,
    depth [B, N+1] int64, mask [B, N+1, N+1] bool, and the kept candidates' pool indices [B, N] int32."""

    def __init__(self, batch: int, nodes: int, device: torch.device):
        i64 = dict(dtype=torch.int64, device=device)
        self.tokens, self.parents = torch.zeros(batch, nodes + 1, **i64), torch.zeros(batch, nodes + 1, **i64)
        self.depth = torch.zeros(batch, nodes + 1, **i64)
        self.mask = torch.zeros(batch, nodes + 1, nodes + 1, dtype=torch.bool, device=device)
        self.keep = torch.zeros(batch, nodes, dtype=torch.int32, device=device)


def select_tree_into(out: TreeBuffers, root: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor,
                     parents: torch.Tensor, max_depth: int) -> None:
    """draft_tree.select_tree's selection of out.keep.shape[1] nodes, written into ``out``."""
    b, m = scores.shape
    n = out.keep.shape[1]
    assert scores.is_contiguous() and tokens.is_contiguous() and parents.is_contiguous() and n <= m
    _select_tree_kernel[(b,)](scores, tokens, parents, root, out.keep, out.tokens, out.parents,
                              out.mask.view(torch.int8), out.depth, m, n, MAX_DEPTH=max_depth,
                              MP2=triton.next_power_of_2(m), SP2=max(16, triton.next_power_of_2(n + 1)), PDL=pdl(),
                              num_warps=4, **launch())
