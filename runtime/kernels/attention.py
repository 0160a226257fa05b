"""Split-KV attention of a step's new tokens over the live KV length, then the reduction of the splits.

    q [M, Hq*D] (rotated), k/v caches [1, Hkv, S_max, D], write_index [1], tree_mask [M, W] bool
    ->  out [M, Hq*D]

The I/O contract's rule: the mask's columns are keys origin..origin+W-1, origin = write_index + M - W;
token m sees every key j < origin and key origin + i iff tree_mask[m, i] (W = M: every committed key
and the new ones the mask allows). Only keys below write_index + M are read: the live length
lives on the device, so the same launch serves every context length inside one CUDA graph.

Split s covers keys [s*chunk, (s+1)*chunk) at absolute positions, one program per (kv head, split,
tile of 16 query rows); the g query heads sharing a KV head ride along the rows (row r = token r//g,
head r%g), so each KV tile is read once per head group. Splits past the live length write an empty
partial. The reduction combines the splits in a fixed order. Chunks at absolute positions and fixed
row tiles make a row's result independent of how many rows the call carries (kernels/__init__.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xcompile.runtime.kernels import ROW_TILE, ieee_dot, launch, pdl

BLOCK_S = 64        # keys per inner step
MIN_SPLITS = 16     # splits per KV head at full length: with 8 KV heads, 128 programs for 132 SMs


@triton.jit
def _split_kernel(Q, KC, VC, WI, TM, OP, MLP, M, W, stride_q, stride_ch, stride_tm, sm_scale, CHUNK,
                  G: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_S: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    tok = rows // G
    head = kvh * G + rows % G
    live = tok < M
    d = tl.arange(0, D)
    q = tl.load(Q + tok[:, None] * stride_q + head[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    wi = tl.load(WI)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, wi + M)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    base = kvh * stride_ch
    for s0 in range(start, end, BLOCK_S):
        keys = s0 + tl.arange(0, BLOCK_S)
        inside = keys < end
        k = tl.load(KC + base + keys[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * sm_scale
        col = keys - (wi + M - W)                                           # >= 0: a column of the mask
        in_mask = (col >= 0) & inside
        seen = tl.load(TM + tok[:, None] * stride_tm + col[None, :], mask=live[:, None] & in_mask[None, :], other=0)
        visible = ((col < 0)[None, :] | (seen != 0)) & inside[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)               # rows with nothing visible yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(VC + base + keys[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # partials [splits, M, HQ, (D | m, l)]
    slot = (split * M + tok) * HQ + head
    tl.store(OP + slot[:, None] * D + d[None, :], acc, mask=live[:, None])
    tl.store(MLP + slot * 2, m_i, mask=live)
    tl.store(MLP + slot * 2 + 1, l_i, mask=live)


@triton.jit
def _combine_kernel(OP, MLP, OUT, M, stride_o, SPLITS, HQ: tl.constexpr, D: tl.constexpr,
                    SPLITS_P2: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    ok = s < SPLITS
    slot = (s * M + tok) * HQ + head
    m = tl.load(MLP + slot * 2, mask=ok, other=float("-inf"))
    l = tl.load(MLP + slot * 2 + 1, mask=ok, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))                 # empty splits weigh nothing
    d = tl.arange(0, D)
    acc = tl.load(OP + slot[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    y = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(OUT + tok * stride_o + head * D + d, y.to(OUT.dtype.element_ty))


def chunk_for(max_seq_len: int) -> int:
    """Keys per split: MIN_SPLITS splits over the whole cache, in whole BLOCK_S steps."""
    return BLOCK_S * max(1, math.ceil(max_seq_len / (MIN_SPLITS * BLOCK_S)))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write_index: torch.Tensor,
              tree_mask: torch.Tensor, heads: int, chunk: int | None = None, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """q [M, Hq*D]; caches [1, Hkv, S_max, D]; write_index [1]; tree_mask [M, W >= M] bool (rows may be
    strided) -> [M, Hq*D]."""
    m = q.shape[0]
    _, kv_heads, max_seq_len, d = k_cache.shape
    g = heads // kv_heads
    chunk = chunk or chunk_for(max_seq_len)
    splits = math.ceil(max_seq_len / chunk)
    w = tree_mask.shape[1]
    assert tree_mask.shape[0] == m and w >= m and tree_mask.stride(1) == 1 and q.stride(1) == 1
    partial = torch.empty(splits, m, heads, d, dtype=torch.float32, device=q.device)
    stats = torch.empty(splits, m, heads, 2, dtype=torch.float32, device=q.device)
    _split_kernel[(kv_heads, splits, triton.cdiv(g * m, ROW_TILE))](
        q, k_cache, v_cache, write_index, tree_mask.view(torch.uint8), partial, stats, m, w, q.stride(0),
        k_cache.stride(1), tree_mask.stride(0), d ** -0.5, chunk, G=g, HQ=heads, D=d, BLOCK_Q=ROW_TILE, BLOCK_S=BLOCK_S,
        IEEE=ieee_dot(q.dtype), PDL=pdl(), num_warps=4, num_stages=2, **launch())
    if out is None:
        out = torch.empty(m, heads * d, dtype=q.dtype, device=q.device)
    _combine_kernel[(m, heads)](partial, stats, out, m, out.stride(0), splits, HQ=heads, D=d,
                                SPLITS_P2=triton.next_power_of_2(splits), PDL=pdl(), num_warps=1, **launch())
    return out


def attention_reference(q, k_cache, v_cache, write_index, tree_mask, heads):
    """What ``attention`` computes: softmax(q k^T / sqrt(D) + mask) v over the visible keys, in fp32."""
    m = q.shape[0]
    _, kv_heads, _, d = k_cache.shape
    wi = int(write_index[0])
    n = wi + m
    keys, values = k_cache[0, :, :n].float(), v_cache[0, :, :n].float()          # [Hkv, n, D]
    visible = torch.ones(m, n, dtype=torch.bool)
    visible[:, n - tree_mask.shape[1]:] = tree_mask.cpu()
    qh = q.float().view(m, heads, d).transpose(0, 1)                             # [Hq, M, D]
    kh = keys.repeat_interleave(heads // kv_heads, 0)
    vh = values.repeat_interleave(heads // kv_heads, 0)
    scores = (qh @ kh.transpose(1, 2)) * d ** -0.5
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    y = torch.softmax(scores, -1) @ vh                                           # [Hq, M, D]
    return y.transpose(0, 1).reshape(m, heads * d).to(q.dtype)
