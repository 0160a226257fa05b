"""One-row projections (decode, single draft steps) on the CUDA cores: y = epilogue(prologue(x) W^T).

Same operands and epilogues as linear.py's tile kernel (its docstring), for M = 1, where tl.dot's
16-row minimum would waste the tensor cores' tile and the row is bandwidth-bound anyway. Two kernels:

    _gemv_kernel         one program per BLOCK_N output columns (optionally split over K)
    _gemv_stream_kernel  a few programs per SM, each streaming many column blocks in one loop

A shape runs here when ``GEMV_TILES`` lists it; a row decoded alone then rounds differently from the
same row inside a verify block (another reduction order and, with SCHEDULE's norm_late, the RMSNorm's
1/rms applied after the sums instead of to x before them), so speculative and plain greedy may part at
near ties (benchmarks/fast_agreement.py counts them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.engines.kernels import interpreted, launch, pdl
from xcompile.runtime.engines.kernels.common import (
    _counters,
    _epilogue,
    _load_w,
    _load_x,
    _load_xg,
    _rstd,
    norm_late,
    rstd_unroll,
    schedule_flags,
)


@triton.jit
def _gemv_start(X, K, eps, NORM: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, LATE: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
    """What both GEMVs do once their first weight tiles are in flight: wait for the previous kernel (PDL;
    EARLY: and let the next one launch), x's 1/rms (NORM without LATE, else 1), the zeroed x^2 lanes (LATE)
    and accumulators (gate, up)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.zeros([1], dtype=tl.float32) + 1.0
    if NORM and not LATE:
        rstd = _rstd(X, 0, tl.arange(0, 1), 1, K, eps, 1, BLOCK_K, UNROLL)
    ss = tl.zeros([1, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return rstd, ss, acc, acc


@triton.jit
def _gemv_kernel(X, W, Y, R, G, Y2, WS, CNT, N_OUT, K, K_SPLIT, eps, NORM: tl.constexpr, GATED: tl.constexpr,
                 RESIDUAL: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr, EARLY: tl.constexpr,
                 LATE: tl.constexpr, UNROLL: tl.constexpr, AHEAD: tl.constexpr):
    # one row (decode): BLOCK_N output columns per program on the CUDA cores, fp32 products accumulated
    # per lane over the program's K_SPLIT columns (all of K unless split) and reduced once at the end;
    # the weight tiles AHEAD (1-4) steps ahead are requested before the current one is used (software
    # pipelining), the first AHEAD before waiting for the previous kernel (PDL); tiles are used in the
    # same order whatever AHEAD is, so it changes no bits. K_SPLIT is a multiple of BLOCK_K.
    # LATE (no split): the RMSNorm's 1/rms scales the reduced sums, its sum of squares gathered on the way.
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = k_begin + K_SPLIT
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wrows = tl.where(cols < N_OUT, cols, 0)
    w_ptr = W + wrows[:, None] * K
    u_ptr = W + (wrows[:, None] + N_OUT) * K
    ks = tl.arange(0, BLOCK_K)
    w_next, wu_next = _load_w(w_ptr, u_ptr, k_begin + ks, K, GATED, True, EVICT)
    w2, wu2 = w_next, wu_next                   # the tiles 2 / 3 / 4 steps ahead (AHEAD > 1)
    w3, wu3 = w_next, wu_next
    w4, wu4 = w_next, wu_next
    if AHEAD > 1:
        w2, wu2 = _load_w(w_ptr, u_ptr, k_begin + BLOCK_K + ks, k_end, GATED, False, EVICT)
    if AHEAD > 2:
        w3, wu3 = _load_w(w_ptr, u_ptr, k_begin + 2 * BLOCK_K + ks, k_end, GATED, False, EVICT)
    if AHEAD > 3:
        w4, wu4 = _load_w(w_ptr, u_ptr, k_begin + 3 * BLOCK_K + ks, k_end, GATED, False, EVICT)
    rstd, ss, acc, accu = _gemv_start(X, K, eps, NORM, PDL, EARLY, LATE, BLOCK_N, BLOCK_K, UNROLL)
    for k0 in range(k_begin, k_end, BLOCK_K):
        w, wu = w_next, wu_next
        nk = k0 + AHEAD * BLOCK_K + ks
        if AHEAD == 1:
            w_next, wu_next = _load_w(w_ptr, u_ptr, nk, k_end, GATED, False, EVICT)   # 0 from k_end on
        elif AHEAD == 2:
            w_next, wu_next = w2, wu2
            w2, wu2 = _load_w(w_ptr, u_ptr, nk, k_end, GATED, False, EVICT)
        elif AHEAD == 3:
            w_next, wu_next, w2, wu2 = w2, wu2, w3, wu3
            w3, wu3 = _load_w(w_ptr, u_ptr, nk, k_end, GATED, False, EVICT)
        else:
            w_next, wu_next, w2, wu2, w3, wu3 = w2, wu2, w3, wu3, w4, wu4
            w4, wu4 = _load_w(w_ptr, u_ptr, nk, k_end, GATED, False, EVICT)
        if LATE:
            x, d = _load_xg(X, 0, tl.arange(0, 1), 1, k0 + ks, K, G, True)
            ss += d
        else:
            x = _load_x(X, 0, tl.arange(0, 1), 1, k0 + ks, K, rstd, G, NORM, True)        # [1, BLOCK_K]
        x = x.to(tl.float32)
        acc += w.to(tl.float32) * x
        if GATED:
            accu += wu.to(tl.float32) * x
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    yu = tl.sum(accu, axis=1)
    if LATE:
        r = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
        y, yu = y * r, yu * r
    if SPLIT > 1:
        # as the tile kernel's split K: partial sums [SPLIT, 2, N_OUT] in WS, the column block's last
        # program (counter CNT[pid_n]) adds them in split order and runs the epilogue
        ok = cols < N_OUT
        part = WS + tl.program_id(1) * 2 * N_OUT
        tl.store(part + cols, y, mask=ok)
        if GATED:
            tl.store(part + N_OUT + cols, yu, mask=ok)
        tl.debug_barrier()
        if tl.atomic_add(CNT + pid_n, 1, sem="acq_rel") == SPLIT - 1:
            tl.debug_barrier()
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
            yu = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                y += tl.load(WS + s * 2 * N_OUT + cols, mask=ok, other=0.0, cache_modifier=".cg")
                if GATED:
                    yu += tl.load(WS + s * 2 * N_OUT + N_OUT + cols, mask=ok, other=0.0, cache_modifier=".cg")
            _epilogue(y[None, :], yu[None, :], Y, 0, Y2, 0, R, 0, tl.arange(0, 1), cols, 1, N_OUT, GATED, RESIDUAL,
                      EXTRA)
            tl.store(CNT + pid_n, 0)
    else:
        _epilogue(y[None, :], yu[None, :], Y, 0, Y2, 0, R, 0, tl.arange(0, 1), cols, 1, N_OUT, GATED, RESIDUAL,
                  EXTRA)


@triton.jit
def _stream_w(W, pid, P, it, KT, N_OUT, K, ks, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVICT: tl.constexpr):
    """The weight tile(s) of a streaming program's iteration ``it``: row block pid + (it // KT) * P,
    K block it % KT."""
    cols = (pid + (it // KT) * P) * BLOCK_N + tl.arange(0, BLOCK_N)
    wrows = tl.where(cols < N_OUT, cols, 0)
    kk = (it % KT) * BLOCK_K + ks
    return _load_w(W + wrows[:, None] * K, W + (wrows[:, None] + N_OUT) * K, kk, K, GATED, True, EVICT)


@triton.jit
def _gemv_stream_kernel(X, W, Y, R, G, Y2, N_OUT, K, eps, NORM: tl.constexpr, GATED: tl.constexpr,
                        RESIDUAL: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr, EARLY: tl.constexpr,
                        LATE: tl.constexpr, UNROLL: tl.constexpr):
    # one row, a fixed number of programs (a few per SM) each streaming the row blocks pid, pid + P, ...
    # as one loop over (row block, K block): the weight tiles AHEAD iterations ahead are in flight across
    # row-block boundaries, and the program's fixed costs (the first tile's latency, the RMSNorm pass)
    # are paid once, not once per row block. Each row block is reduced as _gemv_kernel reduces it (the
    # same lanes, the same order): the same bits as its tile. K is a multiple of BLOCK_K. LATE: 1/rms from
    # the sum of squares of the first row block's pass.
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    KT = K // BLOCK_K
    n_it = tl.cdiv(tl.cdiv(N_OUT, BLOCK_N) - pid, P) * KT
    ks = tl.arange(0, BLOCK_K)
    w1, wu1 = _stream_w(W, pid, P, 0, KT, N_OUT, K, ks, GATED, BLOCK_N, BLOCK_K, EVICT)
    w2, wu2 = w1, wu1
    if AHEAD > 1:
        w2, wu2 = _stream_w(W, pid, P, tl.minimum(1, n_it - 1), KT, N_OUT, K, ks, GATED, BLOCK_N, BLOCK_K, EVICT)
    rstd, ss, acc, accu = _gemv_start(X, K, eps, NORM, PDL, EARLY, LATE, BLOCK_N, BLOCK_K, UNROLL)
    for it in range(0, n_it):
        w, wu = w1, wu1
        nxt = tl.minimum(it + AHEAD, n_it - 1)            # past the end: the last tile again (an L2 hit)
        if AHEAD > 1:
            w1, wu1 = w2, wu2
            w2, wu2 = _stream_w(W, pid, P, nxt, KT, N_OUT, K, ks, GATED, BLOCK_N, BLOCK_K, EVICT)
        else:
            w1, wu1 = _stream_w(W, pid, P, nxt, KT, N_OUT, K, ks, GATED, BLOCK_N, BLOCK_K, EVICT)
        if LATE:
            x, d = _load_xg(X, 0, tl.arange(0, 1), 1, (it % KT) * BLOCK_K + ks, K, G, True)
            if it < KT:                                     # the first row block's pass: all of K once
                ss += d
        else:
            x = _load_x(X, 0, tl.arange(0, 1), 1, (it % KT) * BLOCK_K + ks, K, rstd, G, NORM, True)
        x = x.to(tl.float32)
        acc += w.to(tl.float32) * x
        if GATED:
            accu += wu.to(tl.float32) * x
        if it % KT == KT - 1:                               # the row block is done: reduce and store it
            cols = (pid + (it // KT) * P) * BLOCK_N + tl.arange(0, BLOCK_N)
            y = tl.sum(acc, axis=1)
            yu = tl.sum(accu, axis=1)
            if LATE:
                r = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
                y, yu = y * r, yu * r
            _epilogue(y[None, :], yu[None, :], Y, 0, Y2, 0, R, 0, tl.arange(0, 1), cols, 1, N_OUT, GATED, RESIDUAL,
                      EXTRA)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            accu = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()


class Gemv(NamedTuple):
    """A one-row GEMV's tile: BLOCK_N output columns x BLOCK_K of K per step, num_warps, the split of K
    (_gemv_kernel), or per_sm > 0: _gemv_stream_kernel with per_sm programs per SM; the weight tiles
    ``ahead`` steps ahead in flight (1-4 in _gemv_kernel, 1-2 in the streaming one: the first ``ahead``
    requested before the PDL wait)."""
    block_n: int
    block_k: int
    warps: int
    split: int = 1
    per_sm: int = 0
    ahead: int = 1


# One-row tiles per weight shape (N_OUT, K); shapes not listed run one-row calls on the tile kernel.
# Chosen by `python benchmarks/kernels.py --gemv` on the H200 (2026-12-01, third to fifth sessions: each
# shape called as the engines call it; split K never won), us against the tile kernel in the same run.
# The shapes with an RMSNorm prologue are from the fifth session with norm_late (kernels.SCHEDULE: 1/rms
# in the epilogue), under which per-block 4/256 GEMVs beat the streaming one (qkv, 16.7 us) and, for
# gate/up, the tile kernel (55.2 us in the run before, its pre-pass kept); o and down from the fourth.
# Twelfth session (2026-12-02, docs/BENCHMARKS.md): the 8B tiles swept again inside the graphed step
# (`benchmarks/fast_decode.py --variants "gemv_down=4/512/4/1/0/2;..."`: other blocks and warps, the
# streaming kernel, 2-4 tiles ahead): none faster but down 2 ahead, which changes no bits (graphed ms, 4352-slot
# cache, four runs each interleaved, one machine: 4.293 -> 4.280 at context 128, 4.491 -> 4.472 at 4096). The
# table is keyed by shape: the EAGLE3 head's o, gate/up and down (and its fc) take the 8B layer's tiles.
GEMV_TILES: dict[tuple[int, int], Gemv] = {
    (6144, 4096): Gemv(4, 256, 4),          # Qwen3-8B qkv (+ RMSNorm): 15.3 / 21.3
    (12288, 4096): Gemv(4, 256, 4),         # Qwen3-8B gate/up (+ RMSNorm, SiLU*mul): 53.8 / 55.2
    (4096, 4096): Gemv(4, 512, 4),          # Qwen3-8B o_proj (+ residual): 10.4 / 11.6
    (4096, 12288): Gemv(4, 512, 4, ahead=2),  # Qwen3-8B down_proj (+ residual), EAGLE3 down, fc: 27.0 / 28.0 (1 ahead)
    (6144, 8192): Gemv(16, 512, 4),         # EAGLE3 qkv: 27.5 / 28.5
}


def gemv_tile(n_out: int, k: int) -> Gemv | None:
    """The one-row GEMV's tile for this shape (any sequence of Gemv's fields, as a JSON table holds
    them), or None (the tile kernel): BLOCK_K divides K, a split covers whole K blocks."""
    tile = GEMV_TILES.get((n_out, k))
    if tile is None:
        return None
    tile = Gemv(*tile)
    if not 1 <= tile.ahead <= (2 if tile.per_sm > 0 else 4):
        raise EngineError(f"one-row GEMV tile {tuple(tile)} for ({n_out}, {k}): ahead must be 1-4 (1-2 with per_sm); "
                          "fix gemv.GEMV_TILES or the tiles file")
    if k % tile.block_k:
        return None
    if tile.per_sm > 0 or k % (tile.split * tile.block_k):
        tile = tile._replace(split=1)
    return tile


@functools.cache
def sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the interpreter: 2, so tests exercise the grid stride)."""
    return 2 if interpreted() else torch.cuda.get_device_properties(device).multi_processor_count


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: Gemv, *, norm: torch.Tensor | None, eps: float,
         gated: bool, residual: torch.Tensor | None, extra_out: torch.Tensor | None) -> torch.Tensor:
    """linear() of one row (its docstring) with ``tile``: x [1, K] -> out [1, N]."""
    n_out, k = out.shape[1], x.shape[1]
    dummy = out
    ptrs = (x, w, out, residual if residual is not None else dummy, norm if norm is not None else dummy,
            extra_out if extra_out is not None else dummy)
    flags = dict(NORM=norm is not None, GATED=gated, RESIDUAL=residual is not None, EXTRA=extra_out is not None,
                 PDL=pdl(), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, UNROLL=rstd_unroll(k, tile.block_k),
                 **schedule_flags(1), num_warps=tile.warps, num_stages=1, **launch())
    blocks = triton.cdiv(n_out, tile.block_n)
    if tile.per_sm > 0:
        programs = min(blocks, tile.per_sm * sms(x.device))
        late = norm_late(norm is not None, 1, True)
        _gemv_stream_kernel[(programs,)](*ptrs, n_out, k, eps, AHEAD=tile.ahead, LATE=late, **flags)
        return out
    split = tile.split
    ws = torch.empty(split, 2, n_out, dtype=torch.float32, device=x.device) if split > 1 else dummy
    cnt = _counters(x.device, blocks) if split > 1 else dummy
    _gemv_kernel[(blocks, split)](*ptrs, ws, cnt, n_out, k, k // split, eps, SPLIT=split, AHEAD=tile.ahead,
                                  LATE=norm_late(norm is not None, split, True), **flags)
    return out
