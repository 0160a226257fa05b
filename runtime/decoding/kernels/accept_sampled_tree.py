"""Speculative sampling of a tree of deterministic drafts in three launches: speculative.accept_sampled's rule for
a tree whose drafts are point masses (q = None: the EAGLE-2 trees' top-k children) for a sampler whose top-k is
1..MAX_K, from the same stream (one coin per node, then the bonus's Gumbel noise), with no sort and no host sync.

    blocks   [B*S rows, column blocks]: each block's K + 1 largest scaled logits (sample.py's first launch)
    warps    one program per node row: its warp (top-k, top-p, min-p; a tie at the k-th value counted from the
             blocks) into a scratch row (accept_sampled.warp_rows)
    tree     one program per sequence: the rule over the block's [S, S] sibling and ancestor matrices in
             registers: p(x_i | parent), a repeated sibling token zeroed, node i kept when u_i (1 - the earlier
             siblings' p) < p(x_i) and no earlier sibling was, the deepest node whose every ancestor was kept
             (first on ties), its path; then the residual there (its row's p with its children's tokens zeroed)
             and the bonus, a Gumbel-max over its support

The torch rule takes the block's [S, V] logits through warp and the whole-vocabulary residual and noise (0.598 ms
for a 10/6/32 tree round of the Qwen3 vocabulary on the H200, 2026-12-04). Trees of drafts drawn from q (sampled
siblings) keep the torch rule. Near ties may go the other way than in torch once compiled (sample.py's note).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xcompile.runtime.decoding.kernels import SAMPLE_MAX_K as MAX_K
from xcompile.runtime.decoding.kernels import launch, pdl
from xcompile.runtime.decoding.kernels.accept_sampled import (
    _draws,
    _gumbel_max,
    _row_warp,
    _sequence,
    _uniform,
    candidates,
    warp_rows,
)
from xcompile.runtime.decoding.kernels.sample import _next_open, _scaled, _tile
from xcompile.runtime.decoding.speculative import Accepted, Block

MAX_NODES = 64      # the sibling and ancestor matrices of a tree in one register tile


@triton.jit
def _hit(cols, best, TOK, PAR, b, stride_tb, stride_pb, S):
    """Whether each of the columns is the token of a child of node ``best`` (one child a step: a [BLOCK] mask,
    where a [BLOCK, S] comparison would not fit a program's registers)."""
    hit = cols < 0
    for c in range(1, S):
        child = tl.load(PAR + b * stride_pb + c) == best
        hit = hit | (child & (cols == tl.load(TOK + b * stride_tb + c)))
    return hit


@triton.jit(do_not_specialize=["K", "K1"])
def _tree_kernel(X, T, TOP_P, MIN_P, KEY, CNT, PV, PI, PN, TOK, PAR, DEP, MASK, ST, COUNT, PATH, OUT, V, NB, S, D,
                 stride_x, stride_tb, stride_pb, stride_db, stride_mb, stride_mi, K, K1,
                 KP2: tl.constexpr, NBP2: tl.constexpr, BLOCK: tl.constexpr, SP2: tl.constexpr,
                 DP2: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    temp, top_p, min_p, key1, coins, noise, cnt = _sequence(T, TOP_P, MIN_P, KEY, CNT, b)
    # every node row's warp (top, tau, kept normaliser, tie): ST, from the warps launch (accept_sampled.warp_rows)
    n = tl.arange(0, SP2)
    valid = n < S
    x = tl.load(TOK + b * stride_tb + n, mask=valid, other=-1)
    par = tl.load(PAR + b * stride_pb + n, mask=valid, other=0)
    dep = tl.load(DEP + b * stride_db + n, mask=valid, other=-1)
    drafted = valid & (n > 0)
    prow = (b * S + par) * 4
    s_x = tl.math.div_rn(tl.load(X + (b * S + par) * stride_x + tl.where(drafted, x, 0), mask=drafted,
                                 other=float("-inf")).to(tl.float32), temp)
    top, tau, kept = tl.load(ST + prow), tl.load(ST + prow + 1), tl.load(ST + prow + 2)
    p_x = tl.where(drafted & (s_x >= tau), tl.exp(s_x - top) / kept, 0.0)
    u = _uniform(n.to(tl.uint32), coins, key1)
    # earlier[i, j]: node j is a sibling of node i tried before it; a repeated token was rejected already
    earlier = (par[:, None] == par[None, :]) & (n[:, None] > n[None, :]) & drafted[None, :] & valid[:, None]
    repeat = tl.max((earlier & (x[:, None] == x[None, :])).to(tl.int32), axis=1) > 0
    p_x = tl.where(repeat, 0.0, p_x)
    left = 1.0 - tl.sum(tl.where(earlier, p_x[None, :], 0.0), axis=1)
    passed = (u * left < p_x) & drafted
    before = tl.max((earlier & passed[None, :]).to(tl.int32), axis=1) > 0
    first = (passed & ~before) | ~drafted
    anc = tl.load(MASK + b * stride_mb + n[:, None] * stride_mi + n[None, :], mask=valid[:, None] & valid[None, :],
                  other=0) != 0
    bad = tl.max((anc & ~first[None, :]).to(tl.int32), axis=1) > 0
    accepted = valid & ~bad
    deepest = tl.max(tl.where(accepted, dep, -1), axis=0)
    best = tl.min(tl.where(accepted & (dep == deepest), n, SP2), axis=0)
    count = deepest
    # best's path: its ancestor at each depth (0 past its own depth)
    on_path = tl.load(MASK + b * stride_mb + best * stride_mi + n, mask=valid, other=0) != 0
    lev = tl.arange(0, DP2)
    at = on_path[None, :] & (dep[None, :] == lev[:, None])
    path = tl.max(tl.where(at, n[None, :], 0), axis=1)                   # [DP2]
    # the bonus: from best's row, its children's tokens zeroed (each was tried and rejected)
    children = tl.where(drafted & (par == best), x, -1)
    row = b * S + best
    vals, ids, live, top, tau, tau_k, kept, tie = _row_warp(ST, PV, PI, row, NB, K, K1, KP2, NBP2)
    if tie:     # the kept set: the blocks' own candidates, and the open blocks' tokens at tau_k when kept
        tv, ti, own, is_open, _ = _tile(PV, PI, PN, row, NB, tau_k, K1, KP2, NBP2)
        p_t = tl.where(own & (tv >= tau), tl.exp(tv - top) / kept, 0.0)
        r_t = tl.where(_hit(ti, best, TOK, PAR, b, stride_tb, stride_pb, S), 0.0, p_t)
        mass, best_r, pick_r, best_p, pick_p = _draws(p_t, r_t, ti, noise, key1, 0.0, float("-inf"), 2147483647,
                                                      float("-inf"), 2147483647)
        blk = tl.where(tau == tau_k, _next_open(is_open, -1, NBP2), NBP2)
        while blk < NB:
            cols = blk * BLOCK + tl.arange(0, BLOCK)
            s_b = _scaled(X + row * stride_x, cols, V, temp)
            p_b = tl.where((s_b == tau_k) & (cols < V), tl.exp(s_b - top) / kept, 0.0)
            r_b = tl.where(_hit(cols, best, TOK, PAR, b, stride_tb, stride_pb, S), 0.0, p_b)
            mass, best_r, pick_r, best_p, pick_p = _draws(p_b, r_b, cols, noise, key1, mass, best_r, pick_r, best_p,
                                                          pick_p)
            blk = _next_open(is_open, blk, NBP2)
        pick = tl.where(mass > 0, pick_r, pick_p)
    else:                               # (names of their own: Triton merges a name's types across branches)
        p_k = tl.where(live & (vals >= tau), tl.exp(vals - top) / kept, 0.0)
        tried = tl.max((ids[:, None] == children[None, :]).to(tl.int32), axis=1) > 0
        resid = tl.where(tried, 0.0, p_k)
        _, pick = _gumbel_max(tl.where(tl.sum(resid, axis=0) > 0, resid, p_k), ids, noise, key1)
    # emitted: the path's drafts (x at path[1..count]), then the bonus; past it the path's tokens rolled
    live_d = lev <= D
    nxt = tl.sum(tl.where(lev[None, :] == (lev[:, None] + 1) % (D + 1), path[None, :], 0), axis=1)   # path[d + 1]
    drafts = tl.load(TOK + b * stride_tb + nxt, mask=live_d, other=0)
    tl.store(PATH + b * (D + 1) + lev, path.to(tl.int64), mask=live_d)
    tl.store(OUT + b * (D + 1) + lev, tl.where(lev == count, pick.to(tl.int64), drafts), mask=live_d)
    tl.store(COUNT + b, count.to(tl.int64))
    tl.store(CNT + b, cnt + 2)


class SampledTreeAccept:
    """speculative.accept_sampled for trees of deterministic drafts, top-k 1..MAX_K, in three launches (module
    docstring), into buffers of its own (rewritten by every call: a recorded round reads them)."""

    def __init__(self, batch: int, nodes: int, max_depth: int, device: torch.device):
        i64 = dict(dtype=torch.int64, device=device)
        self.count = torch.zeros(batch, **i64)
        self.path = torch.zeros(batch, max_depth + 1, **i64)
        self.tokens = torch.zeros(batch, max_depth + 1, **i64)
        self.stats = torch.zeros(batch * nodes, 4, dtype=torch.float32, device=device)     # warp_rows's ST

    @staticmethod
    def fits(sampler, block: Block) -> bool:
        """Whether the kernels take this block under this sampler (else the torch rule)."""
        return (not block.chain and block.q is None and 1 < block.tokens.shape[1] <= MAX_NODES
                and not sampler.greedy and 0 < sampler.params.top_k <= MAX_K)

    def __call__(self, block: Block, logits: torch.Tensor, sampler) -> Accepted:
        b, s, v = logits.shape
        x, pv, pi, pn, c = candidates(logits, sampler)
        k, k1, kp2, bl, nb = c.k, c.k1, c.kp2, c.block, c.nb
        tok, par, dep, mask = block.tokens, block.parents, block.depth, block.mask
        assert tok.stride(1) == par.stride(1) == dep.stride(1) == mask.stride(2) == 1
        d = block.max_depth
        warp_rows(pv, pi, pn, c, sampler, s, self.stats)
        _tree_kernel[(b,)](x, sampler.temperature, sampler.top_p, sampler.min_p, sampler.key, sampler.counter, pv, pi,
                           pn, tok, par, dep, mask.view(torch.uint8), self.stats, self.count, self.path, self.tokens, v, nb,
                           s, d, x.stride(0), tok.stride(0), par.stride(0), dep.stride(0), mask.stride(0),
                           mask.stride(1), k, K1=k1, KP2=kp2, NBP2=triton.next_power_of_2(nb),
                           BLOCK=bl, SP2=triton.next_power_of_2(s),
                           DP2=triton.next_power_of_2(d + 1), PDL=pdl(), num_warps=8, **launch())
        return Accepted(self.count, self.path, self.tokens)
