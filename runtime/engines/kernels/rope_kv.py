"""q/k RMSNorm + RoPE + KV-cache write for one step's new tokens, in one kernel.

    qkv [B*M, (Hq + 2 Hkv) * D]  the fused projection's output: q heads, then k heads, then v heads
    ->  q [B*M, Hq * D]           normed (Qwen3's q_norm) and rotated
        k_cache/v_cache [B, Hkv, S_max, D], row b at write_index[b] + m: sequence b's normed and rotated k, and v
        (an FP8 cache: their e4m3 codes, qcodes._to_e4m3, as the reference modules write them)

B sequences of M tokens each (rows b*M..b*M+M-1 are sequence b's; B = 1 but in the batch loop's steps).

One program per (token, head): each head's D values fit in registers. Rotate-half RoPE (HF
Qwen3/Llama) at position_ids[m]; tree nodes share their depth's position. The arithmetic rounds where
the reference modules do (norm output, x*cos, rot(x)*sin, their sum: each to the model dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from xcompile.runtime.engines.base import KV_FP8, fp8_codes
from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig
from xcompile.runtime.engines.kernels.qcodes import _to_e4m3


@triton.jit
def _normed(ptr, offs, w_ptr, eps, D: tl.constexpr, NORM: tl.constexpr, dt: tl.constexpr):
    """The head vector at ptr+offs (values permuted by offs), RMS-normalised over all D when NORM."""
    x = tl.load(ptr + offs).to(tl.float32)
    if NORM:
        full = tl.load(ptr + tl.arange(0, D)).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(full * full, axis=0) / D + eps)
        x = (x * rstd * tl.load(w_ptr + offs).to(tl.float32)).to(dt)
    return x.to(dt)


@triton.jit
def _rope_kv_kernel(QKV, Q, KC, VC, POS, WI, COS, SIN, QN, KN, M, stride_qkv, stride_q, stride_cb, stride_ch, eps,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, KV8: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:
        # attention may launch (and request the cached keys, which this kernel does not write) before the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0)                    # row m of the B*M: token m % M of sequence m // M
    h = tl.program_id(1)                    # 0..HQ-1: q heads; HQ..HQ+HKV-1: kv heads
    dt = Q.dtype.element_ty
    half: tl.constexpr = D // 2
    d = tl.arange(0, D)
    rot = tl.where(d < half, d + half, d - half)            # rotate-half partner of each lane
    sign = tl.where(d < half, -1.0, 1.0)
    pos = tl.load(POS + m)
    c = tl.load(COS + pos * half + d % half).to(dt).to(tl.float32)
    s = tl.load(SIN + pos * half + d % half).to(dt).to(tl.float32)
    row = QKV + m * stride_qkv
    src = row + h * D                       # q heads, then k heads: head h's D values either way
    if h < HQ:
        w = QN
    else:
        w = KN
    x = _normed(src, d, w, eps, D, NORM, dt).to(tl.float32)
    xr = _normed(src, rot, w, eps, D, NORM, dt).to(tl.float32) * sign
    y = ((x * c).to(dt).to(tl.float32) + (xr * s).to(dt).to(tl.float32)).to(dt)
    if h < HQ:
        tl.store(Q + m * stride_q + h * D + d, y)
    else:
        kv = h - HQ
        b = m // M
        at = b * stride_cb + kv * stride_ch + (tl.load(WI + b) + m % M) * D + d
        v = tl.load(row + (HQ + HKV + kv) * D + d)
        if KV8:
            tl.store(KC + at, _to_e4m3(y.to(tl.float32)))
            tl.store(VC + at, _to_e4m3(v.to(tl.float32)))
        else:
            tl.store(KC + at, y)
            tl.store(VC + at, v)


def rope_kv(qkv: torch.Tensor, position_ids: torch.Tensor, write_index: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
            head_dim: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
            eps: float = 1e-6, out: torch.Tensor | None = None, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """qkv [B*M, (Hq+2Hkv)*D]; position_ids [B*M]; write_index [B]; cos/sin [P, D/2] fp32; caches
    [B', Hkv, S_max, D] (B' >= B), row b written in place at write_index[b] + 0..M-1 -> q [B*M, Hq*D]."""
    rows, batch = qkv.shape[0], write_index.shape[0]
    assert rows % batch == 0 and k_cache.shape[0] >= batch and position_ids.shape == (rows,)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.stride(1) == 1
    if out is None:
        out = torch.empty(rows, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    norm, kv8 = q_norm is not None, k_cache.dtype == KV_FP8
    if kv8:                                             # the codes, as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _rope_kv_kernel[(rows, heads + kv_heads)](
        qkv, out, k_cache, v_cache, position_ids, write_index, cos, sin, q_norm if norm else cos,
        k_norm if norm else cos, rows // batch, qkv.stride(0), out.stride(0), k_cache.stride(0), k_cache.stride(1),
        eps, HQ=heads, HKV=kv_heads, D=head_dim, NORM=norm, KV8=kv8, PDL=cfg.pdl_on, num_warps=1, **cfg.launch())
    return out


def rope_kv_reference(qkv, position_ids, write_index, cos, sin, k_cache, v_cache, heads, kv_heads, head_dim,
                      q_norm=None, k_norm=None, eps=1e-6):
    """What ``rope_kv`` computes, in plain torch ops with the reference modules' rounding (layers.Rotary)."""
    m, dt = qkv.shape[0], qkv.dtype
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(m, heads, head_dim), k.view(m, kv_heads, head_dim), v.view(m, kv_heads, head_dim)
    if q_norm is not None:
        q, k = F.rms_norm(q, (head_dim,), q_norm, eps), F.rms_norm(k, (head_dim,), k_norm, eps)
    c, s = cos[position_ids][:, None].to(dt), sin[position_ids][:, None].to(dt)       # [M, 1, D/2]
    c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat((-x2, x1), dim=-1) * s

    q, k = rotate(q), rotate(k)
    per = m // write_index.shape[0]
    for b in range(write_index.shape[0]):                  # sequence b: rows b*per.., its cache row b
        slots, own = int(write_index[b]) + torch.arange(per), slice(b * per, (b + 1) * per)
        for cache, x in ((k_cache, k), (v_cache, v)):
            x = x[own].transpose(0, 1)
            if cache.dtype == KV_FP8:                       # as layers.write_kv writes an FP8 cache
                cache, x = cache.view(torch.uint8), fp8_codes(x)
            cache[b, :, slots] = x
    return q.reshape(m, heads * head_dim)
