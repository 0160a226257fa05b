"""Pieces the projection kernels share (linear.py's tile kernel, gemv.py's one-row GEMVs): loading a
tile of x with its RMSNorm prologue, the per-row 1/rms, the weight tiles, the epilogue (SiLU*mul,
residual, the second output), the split-K arrival counters, and L2 prefetches of another kernel's
weights (SCHEDULE in __init__.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from xcompile.runtime.kernels import SCHEDULE, interpreted


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
def _rstd(X, stride_xm, rows, M, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
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


class Prefetch(NamedTuple):
    """Weight bytes for L2 to fetch ahead of the kernel that reads them: ``items`` segments of
    ``item_bytes`` (a multiple of 16) every ``stride`` bytes from ``base``'s first byte (16-aligned)."""
    base: torch.Tensor
    items: int
    item_bytes: int
    stride: int


def prefetch_args(prefetch: Prefetch | None, dummy: torch.Tensor) -> tuple[tuple, bool]:
    """A kernel's (PF, pf_items, pf_bytes, pf_stride) arguments and its PREFETCH flag (never in the
    interpreter: the prefetch is inline PTX)."""
    if prefetch is None or prefetch.items <= 0 or interpreted():
        return (dummy, 0, 16, 16), False
    return (prefetch.base, prefetch.items, prefetch.item_bytes, prefetch.stride), True


def schedule_flags() -> dict:
    """The projection and attention kernels' EVICT / EARLY constexprs from SCHEDULE."""
    return dict(EVICT=bool(SCHEDULE["evict_first"]), EARLY=bool(SCHEDULE["early_trigger"]))


@triton.jit
def _prefetch_l2(PF, items, item_bytes, stride, part, parts, THREADS: tl.constexpr):
    """Ask L2 for this program's share (``part`` of ``parts``) of a Prefetch box, one bulk prefetch
    (cp.async.bulk.prefetch.L2, sm_90+) per segment and thread: no result, nothing waits for it."""
    per = tl.cdiv(items, parts)
    first = part * per
    last = tl.minimum(first + per, items)
    base = PF.to(tl.pointer_type(tl.int8))
    for i0 in range(first, last, THREADS):
        i = i0 + tl.arange(0, THREADS)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.lt.s32 p, $2, $3; @p cp.async.bulk.prefetch.L2.global [$1], $4; }\n"
            "mov.u32 $0, 0;", "=r,l,r,r,r",
            [base + i.to(tl.int64) * stride, i, tl.zeros_like(i) + last, tl.zeros_like(i) + item_bytes],
            dtype=tl.int32, is_pure=False, pack=1)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters of the split-K column blocks, zero between launches (each launch resets those it
    used); one buffer per device, allocated on first use (before any graph capture records it)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf
