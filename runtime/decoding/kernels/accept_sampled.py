"""Speculative sampling of a chain in three launches: speculative.accept_sampled's rule for a chain (the coins, the
first rejection, the bonus drawn from the residual left there) for a sampler whose top-k is 1..MAX_K, from the
same stream (two draws: one coin per node, then the bonus's Gumbel noise), with no sort and no host sync.

    blocks   [B*S rows, column blocks]: each block's K + 1 largest scaled logits (sample.py's first launch)
    warps    one program per row: the row's warp from its candidates (top-k, then top-p and min-p cut them; a
             tie at the k-th value counted from the blocks, as sample.py does) into a scratch [B*S, 4]: top,
             threshold, kept normaliser, tie
    chain    one program per sequence, node by node: p of draft r + 1 under row r's warp, the coin; from the
             first rejection on nothing more is read. Then the residual at the last
             accepted node: p with the rejected draft zeroed (drafts picked deterministically, q = None), or
             max(0, p - q) over the draft's own q row (drafts drawn from q, through q_ids when q is over a
             draft vocabulary); and the bonus, a Gumbel-max over the residual's support, which is inside p's kept
             set (its candidates; on a tie also the open blocks' tokens at tau_k, sample._tile)

Only p's kept tokens can carry weight, so everything but a kept tie reads the S rows' candidates alone. The torch rule
takes the whole vocabulary through warp, probs, the residual and the noise of every column: a dozen launches
over [S, V] (0.399 ms for a γ 6 chain round of the Qwen3 vocabulary on the H200, 2026-12-04). As sample.py, the
sums run in another order and the GPU's exp and log round otherwise, so a near tie at a coin, a cut or the
Gumbel argmax can go the other way than in the torch rule (in the interpreter the tests see the same tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xcompile.runtime.decoding.kernels import SAMPLE_MAX_K as MAX_K
from xcompile.runtime.decoding.kernels import launch, pdl
from xcompile.runtime.decoding.kernels.sample import (
    _SCRATCH,
    Candidates,
    _draw_base,
    _gumbel,
    _mix32,
    _next_open,
    _row_candidates,
    _sample_blocks_kernel,
    _scaled,
    _tile,
    _warp,
)
from xcompile.runtime.decoding.speculative import Accepted, Block


@triton.jit
def _uniform(e, base, key1):
    """Element e (uint32) of the draw whose mixed counter is ``base`` (Sampler.uniform)."""
    x = _mix32(_mix32((e * tl.full(e.shape, 0x9E3779B9, tl.uint32)) ^ base) ^ key1)
    return ((x >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08            # 2^-24


@triton.jit
def _sequence(T, TOP_P, MIN_P, KEY, CNT, b):
    """Sequence b's sampler: temperature, top-p, min-p, its second key word, the mixed counters of the round's two
    draws (c: a coin per node; c + 1: the bonus's Gumbel noise) and c itself."""
    key1, coins = _draw_base(KEY, CNT, b, 0)
    _, noise = _draw_base(KEY, CNT, b, 1)
    return tl.load(T + b), tl.load(TOP_P + b), tl.load(MIN_P + b), key1, coins, noise, tl.load(CNT + b)


@triton.jit
def _gumbel_max(w, cols, noise, key1):
    """The largest log w + Gumbel noise over the columns ``cols`` that have weight (w > 0), and its first column."""
    g = tl.where(w > 0, tl.log(w) + _gumbel(cols.to(tl.uint32), noise, key1), float("-inf"))
    m = tl.max(g, axis=0)
    return m, tl.min(tl.where(g == m, cols, 2147483647), axis=0)


@triton.jit
def _better(m, at, best, pick):
    """(best, pick) after a part's maximum m at column at: the larger, the lower column on a tie (argmax's)."""
    return tl.maximum(best, m), tl.where((m > best) | ((m == best) & (at < pick)), at, pick)


@triton.jit
def _draws(p, r, cols, noise, key1, mass, best_r, pick_r, best_p, pick_p):
    """One part of a tie's kept set (columns ``cols``, p and the residual r there) into the bonus's two draws, from
    r and from p itself, and r's mass: after the last part the mass says which draw stands."""
    m, at = _gumbel_max(r, cols, noise, key1)
    best_r, pick_r = _better(m, at, best_r, pick_r)
    m, at = _gumbel_max(p, cols, noise, key1)
    best_p, pick_p = _better(m, at, best_p, pick_p)
    return mass + tl.sum(r, axis=0), best_r, pick_r, best_p, pick_p


@triton.jit
def _residual(s, x, V, top, tau, kept, rejected, Qrow, T2D, HAS_Q: tl.constexpr, HAS_T2D: tl.constexpr):
    """p at the tokens x (scaled logits s) under the row's warp, and the residual's weight there: p with the
    rejected draft zeroed (no q), or max(0, p - q) with q the rejected draft's row (q None past the chain)."""
    p = tl.where(s >= tau, tl.exp(s - top) / kept, 0.0)
    if HAS_Q:
        col = tl.where((x >= 0) & (x < V), x, -1)
        if HAS_T2D:
            col = tl.load(T2D + col, mask=col >= 0, other=-1)
        ok = (col >= 0) & ((col * 0 + rejected) >= 0)
        q = tl.load(Qrow + tl.where(ok, col, 0), mask=ok, other=0.0)
        r = tl.maximum(p - q, 0.0)
    else:
        r = tl.where(x == rejected, 0.0, p)
    return p, r


@triton.jit(do_not_specialize=["K", "K1"])
def _warp_rows_kernel(TOP_P, MIN_P, PV, PI, PN, ST, NB, S, K, K1, KP2: tl.constexpr,
                      NBP2: tl.constexpr, TOPP: tl.constexpr, PDL: tl.constexpr):
    # row r of B*S: its warp (sample._warp) -> ST[r] = (top, tau, kept normaliser, tie)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    b = row // S
    _, _, _, top, tau, _, kept, tie = _warp(tl.load(TOP_P + b), tl.load(MIN_P + b), PV, PI, PN, row, NB, K, K1,
                                            KP2, NBP2, TOPP, True)
    tl.store(ST + row * 4, top)
    tl.store(ST + row * 4 + 1, tau)
    tl.store(ST + row * 4 + 2, kept)
    tl.store(ST + row * 4 + 3, tie.to(tl.float32))


@triton.jit
def _row_warp(ST, PV, PI, row, NB, K, K1, KP2: tl.constexpr, NBP2: tl.constexpr):
    """Row ``row``'s warp as _warp returns it, its scalars read from the warps launch's ST."""
    vals, ids = _row_candidates(PV, PI, row, NB, K1, KP2, NBP2)
    j = tl.arange(0, KP2)
    tau_k = tl.max(tl.where(j == K - 1, vals, float("-inf")), axis=0)
    return vals, ids, j < K, tl.load(ST + row * 4), tl.load(ST + row * 4 + 1), tau_k, tl.load(ST + row * 4 + 2), \
        tl.load(ST + row * 4 + 3) != 0


@triton.jit(do_not_specialize=["K", "K1"])
def _chain_kernel(X, T, TOP_P, MIN_P, KEY, CNT, PV, PI, PN, ST, TOK, QTOK, Q, T2D, COUNT, OUT, V, VQ, NB, S, stride_x,
                  K, K1, KP2: tl.constexpr, NBP2: tl.constexpr, BLOCK: tl.constexpr,
                  HAS_Q: tl.constexpr, HAS_T2D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    temp, top_p, min_p, key1, coins, noise, cnt = _sequence(T, TOP_P, MIN_P, KEY, CNT, b)
    # the walk: node i (1..S-1) is kept iff every node before it was and u_i * q(x_i) < p(x_i | row i - 1)
    count = tl.zeros([], tl.int32)
    alive = tl.full([], 1, tl.int1)
    for i in range(1, S):
        if alive:
            row = b * S + i - 1
            top, tau, kept = tl.load(ST + row * 4), tl.load(ST + row * 4 + 1), tl.load(ST + row * 4 + 2)
            x = tl.load(TOK + b * S + i)
            s_x = tl.math.div_rn(tl.load(X + row * stride_x + x).to(tl.float32), temp)
            p_x = tl.where(s_x >= tau, tl.exp(s_x - top) / kept, 0.0)
            u = tl.max(_uniform((tl.zeros([1], tl.int32) + i).to(tl.uint32), coins, key1), axis=0)
            q_x = 1.0
            if HAS_Q:
                q_x = tl.load(QTOK + b * S + i)
            passed = u * q_x < p_x
            count += passed.to(tl.int32)
            alive = passed
    # the bonus: from the residual at node `count` (its row's p, less the rejected draft), Gumbel-max
    row = b * S + count
    vals, ids, live, top, tau, tau_k, kept, tie = _row_warp(ST, PV, PI, row, NB, K, K1, KP2, NBP2)
    rejected = tl.load(TOK + b * S + count + 1, mask=count + 1 < S, other=-1)
    Qrow = Q + (b * S + count + 1) * VQ
    if tie:     # the kept set: the blocks' own candidates, and the open blocks' tokens at tau_k when kept
        # (the branches and the loop name their own tensors: Triton merges a name's types across them)
        tv, ti, own, is_open, _ = _tile(PV, PI, PN, row, NB, tau_k, K1, KP2, NBP2)
        p_t, r_t = _residual(tv, ti, V, top, tau, kept, rejected, Qrow, T2D, HAS_Q, HAS_T2D)
        p_t, r_t = tl.where(own, p_t, 0.0), tl.where(own, r_t, 0.0)
        mass, best_r, pick_r, best_p, pick_p = _draws(p_t, r_t, ti, noise, key1, 0.0, float("-inf"), 2147483647,
                                                      float("-inf"), 2147483647)
        blk = tl.where(tau == tau_k, _next_open(is_open, -1, NBP2), NBP2)
        while blk < NB:
            cols = blk * BLOCK + tl.arange(0, BLOCK)
            s_b = _scaled(X + row * stride_x, cols, V, temp)
            p_b, r_b = _residual(s_b, cols, V, top, tau, kept, rejected, Qrow, T2D, HAS_Q, HAS_T2D)
            tied = (s_b == tau_k) & (cols < V)
            p_b, r_b = tl.where(tied, p_b, 0.0), tl.where(tied, r_b, 0.0)
            mass, best_r, pick_r, best_p, pick_p = _draws(p_b, r_b, cols, noise, key1, mass, best_r, pick_r, best_p,
                                                          pick_p)
            blk = _next_open(is_open, blk, NBP2)
        pick = tl.where(mass > 0, pick_r, pick_p)   # rounding left nothing: p itself (speculative.accept_sampled)
    else:
        p, r = _residual(vals, ids, V, top, tau, kept, rejected, Qrow, T2D, HAS_Q, HAS_T2D)
        p = tl.where(live, p, 0.0)
        r = tl.where(live, r, 0.0)
        _, pick = _gumbel_max(tl.where(tl.sum(r, axis=0) > 0, r, p), ids, noise, key1)
    # emitted: the accepted drafts (x_1 .. x_count), then the bonus; past it the drafts rolled (accept_sampled)
    for j in range(0, S):
        t = tl.load(TOK + b * S + (j + 1) % S)
        tl.store(OUT + b * S + j, tl.where(j == count, pick.to(tl.int64), t))
    tl.store(COUNT + b, count.to(tl.int64))
    tl.store(CNT + b, cnt + 2)


def candidates(logits: torch.Tensor, sampler) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Candidates]:
    """The first launch: every row's column blocks' k + 1 largest scaled logits (sample.py's blocks kernel) of
    logits [B, S, V] -> (the rows [B*S, V], candidate values and ids [B*S, blocks, KP2], the count of each block's
    tokens at its last candidate [B*S, blocks], the sizes)."""
    b, s, v = logits.shape
    c = Candidates.of(sampler.params.top_k, v)
    x = logits.reshape(b * s, v)
    if x.stride(1) != 1:
        x = x.contiguous()
    pv, pi, pn, _ = _SCRATCH.get(b * s, c.nb, c.kp2, x.device)
    _sample_blocks_kernel[(b * s, c.nb)](x, sampler.temperature, pv, pi, pn, x, v, c.nb, s, x.stride(0), 0, K1=c.k1,
                                         KP2=c.kp2, BLOCK=c.block, HAS_Q=False, PDL=pdl(), num_warps=8, **launch())
    return x, pv, pi, pn, c


def warp_rows(pv: torch.Tensor, pi: torch.Tensor, pn: torch.Tensor, c: Candidates, sampler, s: int,
              st: torch.Tensor) -> None:
    """The second launch: every row's warp into ``st`` [B*S, 4] (module docstring), one program a row."""
    _warp_rows_kernel[(pv.shape[0],)](sampler.top_p, sampler.min_p, pv, pi, pn, st, c.nb, s, c.k, K1=c.k1, KP2=c.kp2,
                                      NBP2=triton.next_power_of_2(c.nb), TOPP=sampler.params.top_p < 1, PDL=pdl(),
                                      num_warps=8, **launch())


class SampledChainAccept:
    """speculative.accept_sampled for chains, top-k 1..MAX_K, in three launches (module docstring), into buffers
    of its own (rewritten by every call: a recorded round reads them)."""

    def __init__(self, batch: int, nodes: int, device: torch.device):
        i64 = dict(dtype=torch.int64, device=device)
        self.warps = torch.zeros(batch * nodes, 4, dtype=torch.float32, device=device)     # warp_rows's ST
        self.count = torch.zeros(batch, **i64)
        self.path = torch.arange(nodes, device=device).expand(batch, nodes)
        self.tokens = torch.zeros(batch, nodes, **i64)
        self._t2d: dict[tuple[int, int], torch.Tensor] = {}
        self._none = torch.zeros(1, dtype=torch.float32, device=device)

    @staticmethod
    def fits(sampler, block: Block) -> bool:
        """Whether the kernels take this block under this sampler (else the torch rule)."""
        return block.chain and block.tokens.shape[1] > 1 and not sampler.greedy and 0 < sampler.params.top_k <= MAX_K

    def t2d(self, q_ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """target id -> draft column (-1: outside the draft vocabulary) of the drafter's fixed q_ids table, made
        once (on the first round, which runs eagerly)."""
        key = (q_ids.data_ptr(), vocab)
        table = self._t2d.get(key)
        if table is None:
            table = torch.full((vocab,), -1, dtype=torch.int64, device=q_ids.device)
            table[q_ids] = torch.arange(q_ids.shape[0], device=q_ids.device)
            self._t2d[key] = table
        return table

    def __call__(self, block: Block, logits: torch.Tensor, sampler) -> Accepted:
        b, s, v = logits.shape
        x, pv, pi, pn, c = candidates(logits, sampler)
        k, k1, kp2, bl, nb = c.k, c.k1, c.kp2, c.block, c.nb
        has_q = block.q is not None
        q = block.q if has_q else self._none
        assert block.tokens.is_contiguous() and q.is_contiguous() and (not has_q or block.q_tok.is_contiguous())
        has_t2d = has_q and block.q_ids is not None
        t2d = self.t2d(block.q_ids, v) if has_t2d else self.count
        warp_rows(pv, pi, pn, c, sampler, s, self.warps)
        _chain_kernel[(b,)](x, sampler.temperature, sampler.top_p, sampler.min_p, sampler.key, sampler.counter, pv,
                            pi, pn, self.warps, block.tokens, block.q_tok if has_q else self._none, q, t2d, self.count,
                            self.tokens, v, q.shape[-1], nb, s, x.stride(0), k, K1=k1, KP2=kp2,
                            NBP2=triton.next_power_of_2(nb), BLOCK=bl, HAS_Q=has_q, HAS_T2D=has_t2d, PDL=pdl(),
                            num_warps=8, **launch())
        return Accepted(self.count, self.path, self.tokens)
