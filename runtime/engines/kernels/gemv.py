"""One-row projections (decode, single draft steps) on the CUDA cores: y = epilogue(norm(x) W^T).

Same operands and epilogues as linear.py's tile kernel (its docstring), for M = 1, where tl.dot's 16-row
minimum would waste the tensor cores' tile and the row is bandwidth-bound anyway (Qwen3-8B qkv 15.3 us
against the tile kernel's 21.3 on the H200). One program per BLOCK_N output columns, fp32 products
accumulated per lane and reduced once at the end. The RMSNorm prologue multiplies x by its weight only
(rounded) and scales the fp32 sums by the 1/rms at the end, x^2 gathered per lane on the way: no pass over
x before the weights stream (decode 4.525 -> 4.468 ms a step).

A shape runs here when the tile tables' ``gemv`` lists it. A row decoded alone then rounds differently from
the same row inside a verify block (another reduction order, the 1/rms applied after the sums), so
speculative and plain greedy may part at near ties (benchmarks/fast_agreement.py counts them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xcompile.runtime.engines.kernels.common import _epilogue, _load_w, _load_x, _load_xg
from xcompile.runtime.engines.kernels.config import DEFAULT, Gemv, KernelConfig, Tiles


@triton.jit
def _gemv_kernel(X, W, Y, R, G, Y2, N_OUT, K, eps, NORM: tl.constexpr, GATED: tl.constexpr,
                 RESIDUAL: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, AHEAD: tl.constexpr):
    # the weight tiles AHEAD (1-4) steps ahead are requested before the current one is used (software
    # pipelining), the first AHEAD before waiting for the previous kernel (PDL); tiles are used in the same
    # order whatever AHEAD is, so it changes no bits. K is a multiple of BLOCK_K.
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wrows = tl.where(cols < N_OUT, cols, 0)
    w_ptr = W + wrows[:, None] * K
    u_ptr = W + (wrows[:, None] + N_OUT) * K
    ks = tl.arange(0, BLOCK_K)
    w_next, wu_next = _load_w(w_ptr, u_ptr, ks, K, GATED, True)
    w2, wu2 = w_next, wu_next                   # the tiles 2 / 3 / 4 steps ahead (AHEAD > 1)
    w3, wu3 = w_next, wu_next
    w4, wu4 = w_next, wu_next
    if AHEAD > 1:
        w2, wu2 = _load_w(w_ptr, u_ptr, BLOCK_K + ks, K, GATED, False)
    if AHEAD > 2:
        w3, wu3 = _load_w(w_ptr, u_ptr, 2 * BLOCK_K + ks, K, GATED, False)
    if AHEAD > 3:
        w4, wu4 = _load_w(w_ptr, u_ptr, 3 * BLOCK_K + ks, K, GATED, False)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ss = tl.zeros([1, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    accu = acc
    for k0 in range(0, K, BLOCK_K):
        w, wu = w_next, wu_next
        nk = k0 + AHEAD * BLOCK_K + ks
        if AHEAD == 1:
            w_next, wu_next = _load_w(w_ptr, u_ptr, nk, K, GATED, False)         # 0 from K on
        elif AHEAD == 2:
            w_next, wu_next = w2, wu2
            w2, wu2 = _load_w(w_ptr, u_ptr, nk, K, GATED, False)
        elif AHEAD == 3:
            w_next, wu_next, w2, wu2 = w2, wu2, w3, wu3
            w3, wu3 = _load_w(w_ptr, u_ptr, nk, K, GATED, False)
        else:
            w_next, wu_next, w2, wu2, w3, wu3 = w2, wu2, w3, wu3, w4, wu4
            w4, wu4 = _load_w(w_ptr, u_ptr, nk, K, GATED, False)
        if NORM:
            x, d = _load_xg(X, 0, tl.arange(0, 1), 1, k0 + ks, K, G, True)
            ss += d
        else:
            x = _load_x(X, 0, tl.arange(0, 1), 1, k0 + ks, K, True)             # [1, BLOCK_K]
        x = x.to(tl.float32)
        acc += w.to(tl.float32) * x
        if GATED:
            accu += wu.to(tl.float32) * x
    y = tl.sum(acc, axis=1)
    yu = tl.sum(accu, axis=1)
    if NORM:
        r = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
        y, yu = y * r, yu * r
    _epilogue(y[None, :], yu[None, :], Y, 0, Y2, 0, R, 0, tl.arange(0, 1), cols, 1, N_OUT, GATED, RESIDUAL, EXTRA)


def gemv_tile(n_out: int, k: int, tiles: Tiles) -> Gemv | None:
    """The one-row GEMV's tile for this shape, or None (the tile kernel): the table lists it and BLOCK_K
    divides K."""
    tile = tiles.gemv.get((n_out, k))
    if tile is None or k % tile.block_k:
        return None
    assert 1 <= tile.ahead <= 4, f"one-row GEMV tile {tuple(tile)} for ({n_out}, {k}): ahead must be 1-4"
    return tile


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: Gemv, *, norm: torch.Tensor | None, eps: float,
         gated: bool, residual: torch.Tensor | None, extra_out: torch.Tensor | None,
         cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """linear() of one row (its docstring) with ``tile``: x [1, K] -> out [1, N]."""
    n_out, k = out.shape[1], x.shape[1]
    dummy = out
    _gemv_kernel[(triton.cdiv(n_out, tile.block_n),)](
        x, w, out, residual if residual is not None else dummy, norm if norm is not None else dummy,
        extra_out if extra_out is not None else dummy, n_out, k, eps, NORM=norm is not None, GATED=gated,
        RESIDUAL=residual is not None, EXTRA=extra_out is not None, PDL=cfg.pdl_on, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, AHEAD=tile.ahead, num_warps=tile.warps, num_stages=1, **cfg.launch())
    return out
