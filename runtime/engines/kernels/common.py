"""Pieces the projection kernels share (linear.py's tile kernel, gemv.py's one-row GEMVs): loading a
tile of x with its RMSNorm prologue, the per-row 1/rms, the weight tiles, the epilogue (SiLU*mul,
residual, the second output), the split-K arrival counters, and the schedule flags (SCHEDULE in
__init__.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xcompile.runtime.engines.kernels import SCHEDULE


@triton.jit
def _load_x(X, stride_xm, rows, M, ks, K, rstd, G, NORM: tl.constexpr, EVEN_K: tl.constexpr):
    """A [ROWS, BLOCK_K] tile of x, RMS-normalised when NORM (rstd [ROWS], weight G [K])."""
    if EVEN_K:
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=rows[:, None] < M, other=0.0)
    else:
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
    if NORM:
        g = tl.load(G + ks, mask=ks < K, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * rstd[:, None] * g[None, :]).to(X.dtype.element_ty)
    return x


@triton.jit
def _load_xg(X, stride_xm, rows, M, ks, K, G, EVEN_K: tl.constexpr):
    """The RMSNorm prologue with 1/rms left for the epilogue (norm_late): a [ROWS, BLOCK_K] tile of x * g
    (rounded to x's dtype) and x^2 (fp32), for the caller to add up per lane and reduce once at the end."""
    if EVEN_K:
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=rows[:, None] < M, other=0.0)
    else:
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
    xf = x.to(tl.float32)
    g = tl.load(G + ks, mask=ks < K, other=0.0).to(tl.float32)
    return (xf * g[None, :]).to(X.dtype.element_ty), xf * xf


@triton.jit
def _sq(X, stride_xm, rows, M, ks, K):
    """The sum of x^2 over columns ks of each row (fp32, [ROWS])."""
    x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0).to(tl.float32)
    return tl.sum(x * x, axis=1)


@triton.jit
def _rstd(X, stride_xm, rows, M, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
    """Each row's 1/rms, in one pass over x: the sums of BLOCK_K columns added in column order, UNROLL steps
    per loop iteration (their loads in flight together; the same sums, in the same order, at any UNROLL)."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, UNROLL * BLOCK_K):
        for u in tl.static_range(UNROLL):
            ss += _sq(X, stride_xm, rows, M, k0 + u * BLOCK_K + tl.arange(0, BLOCK_K), K)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _epilogue(acc, accu, Y, stride_ym, Y2, stride_y2m, R, stride_rm, rows, cols, M, N_OUT,
              GATED: tl.constexpr, RESIDUAL: tl.constexpr, EXTRA: tl.constexpr):
    dt = Y.dtype.element_ty
    y = acc.to(dt)
    if GATED:
        g = y.to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dt)                                  # F.silu, rounded
        y = (s.to(tl.float32) * accu.to(dt).to(tl.float32)).to(dt)      # * up, rounded
    mask = (rows[:, None] < M) & (cols[None, :] < N_OUT)
    if RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y, mask=mask)
    if EXTRA:
        tl.store(Y2 + rows[:, None] * stride_y2m + cols[None, :], y, mask=mask)
    return y                                                            # the tile as stored (row sums)


@triton.jit
def _load_weight(ptr, mask, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """A weight tile (unmasked when EVEN, else 0 where ``mask`` is False); EVICT: evict-first in L2
    (weights are read once per step)."""
    if EVEN:
        if EVICT:
            return tl.load(ptr, eviction_policy="evict_first")
        return tl.load(ptr)
    if EVICT:
        return tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _load_w(w_ptr, u_ptr, ks, K, GATED: tl.constexpr, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns ks (and its up tile when gated)."""
    w = _load_weight(w_ptr + ks[None, :], ks[None, :] < K, EVEN_K, EVICT)
    wu = w
    if GATED:
        wu = _load_weight(u_ptr + ks[None, :], ks[None, :] < K, EVEN_K, EVICT)
    return w, wu


def norm_late(norm: bool, split: int, gemv: bool) -> bool:
    """Whether a call's RMSNorm takes its 1/rms in the epilogue (SCHEDULE's norm_late for the one-row
    GEMVs, norm_late_tile for the tile kernel; not with split K, whose programs each see part of the row)."""
    return norm and split == 1 and bool(SCHEDULE["norm_late" if gemv else "norm_late_tile"])


def rstd_unroll(k: int, block_k: int, tiles: int = 1) -> int:
    """Steps of the RMSNorm pre-pass per loop iteration (the UNROLL constexpr): SCHEDULE's rstd_span columns
    of every row tile in flight at once, at least one step and at most K's."""
    return max(1, min(triton.cdiv(k, block_k), int(SCHEDULE["rstd_span"]) // (block_k * tiles)))


def schedule_flags(rows: int) -> dict:
    """The EVICT / EARLY constexprs of a projection or attention call of ``rows`` rows (SCHEDULE)."""
    early = SCHEDULE["early_trigger_verify" if rows > 1 else "early_trigger_decode"]
    return dict(EVICT=bool(SCHEDULE["evict_first"]), EARLY=bool(early))


ATTN_CHAIN = ("rope_kv", "split", "combine")     # attention's launches, in order


def attn_early(rows: int, kernel: str) -> bool:
    """The FIRST constexpr of ``kernel`` (one of ATTN_CHAIN) in a call of ``rows`` rows: trigger its
    dependents before waiting. SCHEDULE's attn_early for calls of several rows; for one row,
    attn_early_decode: how many of the chain's launches do (0: none, 1: rope_kv, 2: and the split kernel,
    3: all three)."""
    if rows > 1:
        return bool(SCHEDULE["attn_early"])
    return ATTN_CHAIN.index(kernel) < int(SCHEDULE["attn_early_decode"])


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters of the split-K column blocks, zero between launches (each launch resets those it
    used); one buffer per device, allocated on first use (before any graph capture records it)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf
