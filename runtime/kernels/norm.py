"""The EAGLE3 step's input in one launch: u = [RMSNorm(embed[ids]), RMSNorm(hidden)] (embedding first).

    ids [M] int64, embed [V, H], hidden [M, H] (rows may be strided) -> u [M, 2H]

One program per (row, half); each half is normalised on its own, in fp32, and rounded once (F.rms_norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from xcompile.runtime.kernels import launch, pdl


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
                w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    m, h = hidden.shape
    assert hidden.stride(1) == 1 and embed.is_contiguous() and ids.shape == (m,)
    u = torch.empty(m, 2 * h, dtype=hidden.dtype, device=hidden.device)
    _embed_norms_kernel[(m, 2)](ids, embed, w_embed, hidden, w_hidden, u, hidden.stride(0), eps, H=h,
                                BLOCK=triton.next_power_of_2(h), PDL=pdl(), num_warps=4, **launch())
    return u


def embed_norms_reference(ids, embed, w_embed, hidden, w_hidden, eps):
    h = hidden.shape[-1]
    return torch.cat((F.rms_norm(F.embedding(ids, embed), (h,), w_embed, eps), F.rms_norm(hidden, (h,), w_hidden, eps)),
                     dim=-1)
