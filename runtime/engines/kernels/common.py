"""Pieces the projection kernels share (linear.py's tile kernel, gemv.py's one-row GEMV): tiles of x, the weight
tiles, the epilogue (SiLU*mul, residual, the second output) and the split-K arrival counters."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_x(X, stride_xm, rows, M, ks, K, EVEN_K: tl.constexpr):
    """A [ROWS, BLOCK_K] tile of x (zeros past M and K)."""
    if EVEN_K:
        return tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=rows[:, None] < M, other=0.0)
    return tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                   other=0.0)


@triton.jit
def _load_xg(X, stride_xm, rows, M, ks, K, G, EVEN_K: tl.constexpr):
    """The RMSNorm prologue with 1/rms left for the epilogue: a [ROWS, BLOCK_K] tile of x * g (rounded to x's
    dtype) and x^2 (fp32), for the caller to add up per lane and reduce once at the end."""
    x = _load_x(X, stride_xm, rows, M, ks, K, EVEN_K)
    xf = x.to(tl.float32)
    g = tl.load(G + ks, mask=ks < K, other=0.0).to(tl.float32)
    return (xf * g[None, :]).to(X.dtype.element_ty), xf * xf


@triton.jit
def _epilogue(acc, accu, Y, stride_ym, Y2, stride_y2m, R, stride_rm, rows, cols, M, N_OUT,
              GATED: tl.constexpr, RESIDUAL: tl.constexpr, EXTRA: tl.constexpr):
    """Round the fp32 sums to y's dtype, then (GATED) silu(gate) * up, (RESIDUAL) + r, each rounded as the
    reference modules round; store y (and, EXTRA, a copy into Y2). Returns the tile as stored."""
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
    return y


@triton.jit
def _load_weight(ptr, mask, EVEN: tl.constexpr):
    """A weight tile (unmasked when EVEN, else 0 where ``mask`` is False), evict-first in L2: weights are
    read once a step (within noise of normal loads on the H200, kept for the L2 it leaves to activations)."""
    if EVEN:
        return tl.load(ptr, eviction_policy="evict_first")
    return tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _load_w(w_ptr, u_ptr, ks, K, GATED: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns ks (and its up tile when gated)."""
    w = _load_weight(w_ptr + ks[None, :], ks[None, :] < K, EVEN_K)
    wu = w
    if GATED:
        wu = _load_weight(u_ptr + ks[None, :], ks[None, :] < K, EVEN_K)
    return w, wu


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters of the split-K column blocks, zero between launches (each launch resets those it
    used); one buffer per device, allocated on first use (before any graph capture records it)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf
