"""RMSNorm launches of their own (the projections otherwise take theirs as a prologue, linear.py), and the
embedding rows with the sums of squares such a norm needs:

    embedding_rows  embed[ids] [M, H] for ids [M] int64, and (given sums) each row's fp32 sum of squares:
                 the target step's input, whose first qkv then takes its norm from them (linear.embedding)
    embed_norms  the EAGLE3 step's input: u = [RMSNorm(embed[ids]), RMSNorm(hidden)] (embedding first)
                 ids [M] int64, embed [V, H], hidden [M, H] (rows may be strided) -> u [M, 2H]
    rms_norm     x [M, K] (rows may be strided) -> RMSNorm(x) [M, K], for the tile kernel's projections with a
                 norm; or, given rows [R], RMSNorm(x[rows]) [R, K]: the lm_heads' logit rows gathered and
                 normalised in one launch

One program per row (and half); each is normalised on its own, in fp32, and rounded once (F.rms_norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig


@triton.jit
def _embedding_kernel(IDS, EMB, X, SQ, stride_ids, H: tl.constexpr, BLOCK: tl.constexpr, SUMS: tl.constexpr,
                      PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(EMB + tl.load(IDS + m * stride_ids) * H + cols, mask=ok, other=0.0)
    tl.store(X + m * H + cols, x, mask=ok)
    if SUMS:
        xf = x.to(tl.float32)
        tl.store(SQ + m, tl.sum(xf * xf, axis=0))


def embedding_rows(ids: torch.Tensor, embed: torch.Tensor, sums: torch.Tensor | None = None,
                   cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """F.embedding(ids, embed) for ids [M] int64 (any stride) -> a new [M, H] in one launch; with ``sums``
    (fp32, its first row at least M long and contiguous: a linear.RowSums buffer), also each row's sum of
    squares (fp32) into sums[0, :M]."""
    m = ids.shape[0]
    h = embed.shape[1]
    assert ids.dim() == 1 and ids.dtype == torch.int64 and embed.is_contiguous()
    assert sums is None or (sums.dtype == torch.float32 and sums.stride(-1) == 1 and sums.shape[-1] >= m), sums
    x = torch.empty(m, h, dtype=embed.dtype, device=embed.device)
    _embedding_kernel[(m,)](ids, embed, x, sums if sums is not None else x, ids.stride(0), H=h,
                            BLOCK=triton.next_power_of_2(h), SUMS=sums is not None, PDL=cfg.pdl_on, num_warps=4,
                            **cfg.launch())
    return x


@triton.jit
def _embed_norms_kernel(IDS, EMB, W1, HID, W2, U, stride_h, eps, H: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0)
    half = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    if half == 0:
        src = EMB + tl.load(IDS + m) * H
        w = W1
    else:
        src = HID + m * stride_h
        w = W2
    x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    y = x * rstd * tl.load(w + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(U + m * 2 * H + half * H + cols, y.to(U.dtype.element_ty), mask=ok)


def embed_norms(ids: torch.Tensor, embed: torch.Tensor, w_embed: torch.Tensor, hidden: torch.Tensor,
                w_hidden: torch.Tensor, eps: float, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    m, h = hidden.shape
    assert hidden.stride(1) == 1 and embed.is_contiguous() and ids.shape == (m,)
    u = torch.empty(m, 2 * h, dtype=hidden.dtype, device=hidden.device)
    _embed_norms_kernel[(m, 2)](ids, embed, w_embed, hidden, w_hidden, u, hidden.stride(0), eps, H=h,
                                BLOCK=triton.next_power_of_2(h), PDL=cfg.pdl_on, num_warps=4, **cfg.launch())
    return u


def embed_norms_reference(ids, embed, w_embed, hidden, w_hidden, eps):
    h = hidden.shape[-1]
    return torch.cat((F.rms_norm(F.embedding(ids, embed), (h,), w_embed, eps), F.rms_norm(hidden, (h,), w_hidden, eps)),
                     dim=-1)


@triton.jit
def _rms_norm_kernel(X, W, Y, ROWS, stride_x, eps, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                     GATHER: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0)
    src = tl.load(ROWS + m) if GATHER else m                 # GATHER: output row m is x's row ROWS[m]
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(X + src * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    y = x * rstd * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + m * K + cols, y.to(Y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, rows: torch.Tensor | None = None,
             cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """F.rms_norm(x, (K,), w, eps) of each row of x [M, K] -> a new [M, K]; with ``rows`` (int64 [R], each in
    [0, M)), of x[rows] -> [R, K], the same bits as normalising x.index_select(0, rows)."""
    m, k = x.shape
    assert x.stride(1) == 1 and w.shape == (k,) and w.is_contiguous()
    assert rows is None or (rows.dim() == 1 and rows.dtype == torch.int64 and rows.is_contiguous()), rows
    out_rows = m if rows is None else rows.shape[0]
    y = torch.empty(out_rows, k, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(out_rows,)](x, w, y, rows if rows is not None else y, x.stride(0), eps, K=k,
                                  BLOCK=triton.next_power_of_2(k), PDL=cfg.pdl_on, GATHER=rows is not None, num_warps=4,
                                  **cfg.launch())
    return y
