"""A warped draw (runtime/decoding/sampling.py: temperature, top-k, top-p, min-p, then a Gumbel-max draw from
the counter-based stream) in two launches, for top-k up to MAX_K: a draw from the same law as
Sampler.draw(warp(x)), from the same stream (one draw of the counter), with no sort of the vocabulary and no host
sync. The logits are scaled as torch scales them; the normaliser and the top-p masses are summed in another
order and the GPU's exp and log round otherwise, so a near tie at a top-p / min-p cut or in the Gumbel argmax
can go the other way than in the torch sampler (in the interpreter the tests see the same tokens).

    blocks   [rows, column blocks]: each block's K + 1 largest scaled logits and their columns (topk.py's
             _top; K is an argument, so no value of top-k compiles a kernel of its own)
             and how many of the block's tokens equal its last candidate
    rows     [batch]: per row, the K + 1 largest of those. Top-k keeps the tokens at or above the K-th (tau_k);
             when the (K + 1)-th is below it, nothing else can reach tau_k and the kept tokens are these K:
             top-p and min-p cut them further and the draw is an argmax over them. When it ties tau_k (bf16
             logits tie often), tokens at tau_k may lie outside the candidates, but only in a block whose last
             candidate is tau_k ("open": one whose last candidate were above tau_k would hold more than K tokens
             above the K-th). The blocks' candidates and their counts give the normaliser exactly; the draw reads
             the open blocks' columns alone, and only when top-p and min-p keep the tied tokens (_tile).

The torch sampler took 0.218 ms for one graphed step of the Qwen3 vocabulary on the H200 (T 0.6, top-k 20,
top-p 0.95), greedy's argmax 0.011 ms: its topk, the sorted top-p and a hash of every column's uniform were
a dozen launches over the vocabulary. Streaming the whole row on a tie took 0.199 ms a draw on an H100 (no tie:
0.056; 2026-12-06). A pick of _top is a reduction over the block, so a block keeps K + 1 candidates, not
MAX_K + 1 (top-k 20: 21 picks, not 33).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xcompile.runtime.decoding.kernels import SAMPLE_MAX_K as MAX_K
from xcompile.runtime.decoding.kernels import launch, pdl
from xcompile.runtime.decoding.kernels.topk import BLOCK_V, TopkScratch, _top

_SCRATCH = TopkScratch()


@dataclass(frozen=True)
class Candidates:
    """The launch sizes of a candidate search (the blocks launch and what reads its results): top-k, candidates a
    column block keeps (k + 1: the k-th and the one that may tie it), the power of two that holds MAX_K + 1 (the
    same for every k: no compile per k), columns a block, blocks a row."""

    k: int
    k1: int
    kp2: int
    block: int
    nb: int

    @staticmethod
    def of(top_k: int, v: int) -> Candidates:
        """The sizes for a sampler's ``top_k`` over ``v`` columns."""
        k, block = min(top_k, v), min(BLOCK_V, triton.next_power_of_2(v))
        return Candidates(k, min(k + 1, v), triton.next_power_of_2(min(MAX_K + 1, v)), block, triton.cdiv(v, block))


@triton.jit
def _mix32(x):
    """sampling._mix32 on uint32 tensors (products wrap mod 2^32 as the torch version's masks do)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _gumbel(e, base, key1):
    """-log(-log u) of element e (uint32) of the draw whose mixed counter is ``base`` (Sampler.uniform)."""
    x = _mix32(_mix32((e * tl.full(e.shape, 0x9E3779B9, tl.uint32)) ^ base) ^ key1)
    u = ((x >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08            # 2^-24
    return -tl.log(-tl.log(u))


@triton.jit
def _scaled(row, cols, V, temp):
    """A row's logits at cols over the temperature in fp32, rounded as torch's logits / T (-inf past V)."""
    x = tl.load(row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, temp + tl.zeros_like(x))


@triton.jit(do_not_specialize=["K1"])
def _sample_blocks_kernel(X, T, PV, PI, PN, Q, V, NB, R, stride_x, stride_q, K1, KP2: tl.constexpr,
                          BLOCK: tl.constexpr, HAS_Q: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    if HAS_Q:       # q's row cleared here, its kept tokens written by the rows launch (one row a sequence)
        tl.store(Q + row * stride_q + cols, tl.zeros([BLOCK], tl.float32), mask=cols < V)
    s = _scaled(X + row * stride_x, cols, V, tl.load(T + row // R))
    s = tl.where(s == s, s, float("-inf"))                  # NaN as -inf (topk.py)
    vals, idx = _top(s, tl.where(cols < V, cols, 2147483647), K1, KP2)
    out = (row * NB + blk) * KP2 + tl.arange(0, KP2)
    tl.store(PV + out, vals)
    tl.store(PI + out, idx)
    last = tl.max(tl.where(tl.arange(0, KP2) == K1 - 1, vals, float("-inf")), axis=0)
    tl.store(PN + row * NB + blk, tl.sum(((s == last) & (cols < V)).to(tl.float32), axis=0))


@triton.jit
def _draw_base(KEY, CNT, b, ahead):
    """Row b's second key word and the mixed counter of its draw ``ahead`` draws from now (Sampler.uniform)."""
    key0 = tl.load(KEY + 2 * b).to(tl.uint32)
    key1 = tl.load(KEY + 2 * b + 1).to(tl.uint32)
    return key1, _mix32(tl.full([1], 0, tl.uint32) + ((tl.load(CNT + b) + ahead) & 0xFFFFFFFF).to(tl.uint32) ^ key0)


@triton.jit
def _row_candidates(PV, PI, row, NB, K1, KP2: tl.constexpr, NBP2: tl.constexpr):
    """Row ``row``'s K1 largest scaled logits and their ids, merged from its column blocks' candidates (the
    blocks launch), largest first."""
    j = tl.arange(0, KP2)
    blk = tl.arange(0, NBP2)
    cand = (row * NB + blk[:, None]) * KP2 + j[None, :]                      # [NBP2, KP2]
    ok = (blk[:, None] < NB) & (j[None, :] < K1)
    return _top(tl.load(PV + cand, mask=ok, other=float("-inf")), tl.load(PI + cand, mask=ok, other=2147483647),
                K1, KP2)


@triton.jit
def _tile(PV, PI, PN, row, NB, tau_k, K1, KP2: tl.constexpr, NBP2: tl.constexpr):
    """Row ``row``'s column blocks' candidates, flattened: (values, ids, ``own``: the candidates that stand for
    themselves in a tie's kept set, each token once: all >= tau_k of a closed block, those above tau_k of an open
    one), the open blocks [NBP2] (last candidate at tau_k: their tokens at tau_k may reach past the candidates,
    and PN counted them) and how many tokens tie at tau_k in all."""
    blk = tl.arange(0, NBP2)
    j = tl.arange(0, KP2)
    cand = (row * NB + blk[:, None]) * KP2 + j[None, :]                      # [NBP2, KP2]
    ok = (blk[:, None] < NB) & (j[None, :] < K1)
    vals = tl.load(PV + cand, mask=ok, other=float("-inf"))
    ids = tl.load(PI + cand, mask=ok, other=2147483647)
    last = tl.max(tl.where(j[None, :] == K1 - 1, vals, float("-inf")), axis=1)
    is_open = (blk < NB) & (last == tau_k)
    own = ok & ((vals > tau_k) | ((vals == tau_k) & ~is_open[:, None]))
    counted = tl.where(is_open, tl.load(PN + row * NB + blk, mask=blk < NB, other=0.0), 0.0)
    n_tied = tl.sum(counted, axis=0) + tl.sum(tl.sum((own & (vals == tau_k)).to(tl.float32), axis=1), axis=0)
    return tl.reshape(vals, [vals.numel]), tl.reshape(ids, [vals.numel]), tl.reshape(own, [vals.numel]), is_open, \
        n_tied


@triton.jit
def _next_open(is_open, after, NBP2: tl.constexpr):
    """The first open block after block ``after`` (NBP2: none)."""
    blk = tl.arange(0, NBP2)
    return tl.min(tl.where(is_open & (blk > after), blk, NBP2), axis=0)


@triton.jit
def _warp(top_p, min_p, PV, PI, PN, row, NB, K, K1, KP2: tl.constexpr, NBP2: tl.constexpr,
          TOPP: tl.constexpr, KEPT: tl.constexpr):
    """Row ``row``'s warp (Sampler.warp) from its blocks' candidates: the candidates (values, ids, in the top k),
    the row's top, the threshold tau, the k-th value tau_k, whether it ties the (k + 1)-th (then tokens past the
    candidates may be kept: _tile) and, with KEPT, the kept tokens' normaliser (sum of exp(s - top) over s >= tau;
    else 0)."""
    j = tl.arange(0, KP2)
    vals, ids = _row_candidates(PV, PI, row, NB, K1, KP2, NBP2)
    top = tl.max(vals, axis=0)
    tau_k = tl.max(tl.where(j == K - 1, vals, float("-inf")), axis=0)
    tie = tl.max(tl.where(j == K, vals, float("-inf")), axis=0) == tau_k
    live = j < K
    # the normaliser of the top-k-kept tokens: the k candidates, or on a tie every token at tau_k as counted
    z = tl.sum(tl.where(live, tl.exp(vals - top), 0.0), axis=0)
    if tie:             # the tokens above tau_k are candidates; those at it, counted
        _, _, _, _, n_tied = _tile(PV, PI, PN, row, NB, tau_k, K1, KP2, NBP2)
        z = tl.sum(tl.where(live & (vals > tau_k), tl.exp(vals - top), 0.0), axis=0) + n_tied * tl.exp(tau_k - top)
    tau = tl.maximum(tau_k, top + tl.log(min_p))
    if TOPP:    # keep x iff the mass strictly above it is < top_p (sampling.Sampler.warp)
        pv = tl.where(live, tl.exp(vals - top) / z, 0.0)
        above = tl.sum(tl.where(vals[None, :] > vals[:, None], pv[None, :], 0.0), axis=1)
        tau = tl.maximum(tau, tl.min(tl.where(live & (above < top_p), vals, float("inf")), axis=0))
    kept = 0.0
    if KEPT:
        kept = tl.sum(tl.where(live & (vals >= tau), tl.exp(vals - top), 0.0), axis=0)
        if tie:         # tau above tau_k: the candidates above it (all of them are), as summed; at tau_k: z
            kept = tl.where(tau > tau_k, kept, z)
    return vals, ids, live, top, tau, tau_k, kept, tie


@triton.jit(do_not_specialize=["K", "K1"])      # k an argument: no top-k value compiles a kernel of its own
def _sample_rows_kernel(X, T, TOP_P, MIN_P, KEY, CNT, PV, PI, PN, OUT, Q, QTOK, TGT, V, NB, R, stride_x, stride_out,
                        stride_q, stride_qt, K, K1, KP2: tl.constexpr, NBP2: tl.constexpr, TOPP: tl.constexpr,
                        BLOCK: tl.constexpr, HAS_Q: tl.constexpr, HAS_T: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    temp, top_p, min_p = tl.load(T + b), tl.load(TOP_P + b), tl.load(MIN_P + b)
    key1, base = _draw_base(KEY, CNT, b, 0)
    for r in range(R):
        row = b * R + r
        vals, ids, live, top, tau, tau_k, kept, tie = _warp(top_p, min_p, PV, PI, PN, row, NB, K, K1, KP2, NBP2,
                                                            TOPP, HAS_Q)
        e0 = (tl.zeros([1], tl.int32) + r * V).to(tl.uint32)          # row r's first element of the draw
        # (each branch and the loop name its own tensors: Triton merges a name's types across them)
        if tie:     # the draw over the kept candidates, and the open blocks' tokens at tau_k when they are kept
            tv, ti, own, is_open, _ = _tile(PV, PI, PN, row, NB, tau_k, K1, KP2, NBP2)
            g_t = tl.where(own & (tv >= tau), tv + _gumbel(e0 + ti.to(tl.uint32), base, key1), float("-inf"))
            best = tl.max(g_t, axis=0)
            pick = tl.min(tl.where(g_t == best, ti, 2147483647), axis=0)
            if HAS_Q:
                logz_t = top + tl.log(kept)
                tl.store(Q + row * stride_q + ti, tl.exp(tv - logz_t), mask=own & (tv >= tau))
            blk = tl.where(tau == tau_k, _next_open(is_open, -1, NBP2), NBP2)
            while blk < NB:
                cols = blk * BLOCK + tl.arange(0, BLOCK)
                s_b = _scaled(X + row * stride_x, cols, V, temp)
                tied = (s_b == tau_k) & (cols < V)
                g_b = tl.where(tied, s_b + _gumbel(e0 + cols.to(tl.uint32), base, key1), float("-inf"))
                m_b = tl.max(g_b, axis=0)
                at_b = tl.min(tl.where(g_b == m_b, cols, 2147483647), axis=0)
                pick = tl.where((m_b > best) | ((m_b == best) & (at_b < pick)), at_b, pick)
                best = tl.maximum(best, m_b)
                if HAS_Q:
                    tl.store(Q + row * stride_q + cols, tl.exp(s_b - logz_t), mask=tied)
                blk = _next_open(is_open, blk, NBP2)
        else:
            g = tl.where(live & (vals >= tau), vals + _gumbel(e0 + ids.to(tl.uint32), base, key1), float("-inf"))
            m = tl.max(g, axis=0)
            pick = tl.min(tl.where(g == m, ids, 2147483647), axis=0)
        if HAS_Q:   # the draw's q (Warped.probs: exp(s - logz) on the kept set) and q at the token
            logz = top + tl.log(kept)
            if not tie:
                on = live & (vals >= tau)
                tl.store(Q + row * stride_q + ids, tl.exp(vals - logz), mask=on)
            at = pick + tl.arange(0, 1)
            tl.store(QTOK + row * stride_qt + tl.arange(0, 1), tl.exp(_scaled(X + row * stride_x, at, V, temp) - logz))
        if HAS_T:   # a draft vocabulary's column as its target id (draft_tree.target_table)
            pick = tl.load(TGT + pick)
        tl.store(OUT + row * stride_out, pick.to(tl.int64))
    tl.store(CNT + b, tl.load(CNT + b) + 1)


def sample(logits: torch.Tensor, sampler, out: torch.Tensor | None = None, q: torch.Tensor | None = None,
           q_tok: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] or [B, R, V] -> [B] or [B, R] tokens: Sampler.draw(Sampler.warp(logits)) for a sampler
    whose top_k is 1..MAX_K (one draw of its stream). A drafter's pick (logits [B, V]) may also take: ``out``
    [B], where the tokens go; ``q`` [B, V] and ``q_tok`` [B], where the warped distribution and its value at
    the token go (Warped.probs, what speculative sampling verifies against); ``targets`` [V], the draft
    vocabulary's target ids the tokens are written as (the rows keep the draft columns). ``out``, ``q`` and
    ``q_tok`` may be strided views (a column of a block's buffers)."""
    shape = logits.shape[:-1]
    v = logits.shape[-1]
    c = Candidates.of(sampler.params.top_k, v)
    k, k1, kp2, block, nb = c.k, c.k1, c.kp2, c.block, c.nb
    assert 0 < k <= MAX_K and not sampler.greedy, sampler.params
    x = logits.reshape(-1, v)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, r = x.shape[0], x.shape[0] // shape[0]
    has_q = q is not None
    assert not has_q or (r == 1 and q.shape == x.shape and q.stride(1) == 1 and q_tok is not None
                         and q.dtype == q_tok.dtype == torch.float32), (q, q_tok)
    assert targets is None or (r == 1 and targets.is_contiguous() and targets.dtype == torch.int64)
    pv, pi, pn, _ = _SCRATCH.get(rows, nb, kp2, x.device)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    assert out.dtype == torch.int64 and out.numel() == rows and (rows == 1 or out.dim() == 1), out
    qq = q if has_q else x                      # (unused pointers where there is no q)
    _sample_blocks_kernel[(rows, nb)](x, sampler.temperature, pv, pi, pn, qq, v, nb, r, x.stride(0), qq.stride(0),
                                      K1=k1, KP2=kp2, BLOCK=block, HAS_Q=has_q, PDL=pdl(), num_warps=8, **launch())
    _sample_rows_kernel[(shape[0],)](x, sampler.temperature, sampler.top_p, sampler.min_p, sampler.key,
                                     sampler.counter, pv, pi, pn, out, qq, q_tok if has_q else x,
                                     targets if targets is not None else out, v, nb, r, x.stride(0),
                                     out.stride(0) if out.dim() else 1, qq.stride(0),
                                     q_tok.stride(0) if has_q and q_tok.dim() else 1, k, K1=k1, KP2=kp2,
                                     NBP2=triton.next_power_of_2(nb), TOPP=sampler.params.top_p < 1, BLOCK=block,
                                     HAS_Q=has_q, HAS_T=targets is not None, PDL=pdl(), num_warps=8, **launch())
    return out.view(shape)
