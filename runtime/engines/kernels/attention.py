"""Split-KV attention of a step's new tokens over the live KV length, then the reduction of the splits.

    q [M, Hq*D] (rotated), k/v caches [1, Hkv, S_max, D], write_index [1], tree_mask [M, W] bool
    ->  out [M, Hq*D]

The I/O contract's rule: the mask's columns are keys origin..origin+W-1, origin = write_index + M - W;
token m sees every key j < origin and key origin + i iff tree_mask[m, i] (W = M: every committed key
and the new ones the mask allows). Only keys below write_index + M are read: the live length
lives on the device, so the same launch serves every context length inside one CUDA graph.

Split s covers keys [s*chunk, (s+1)*chunk) at absolute positions (chunk: the cache's for the call's rows,
chunk_for: a call of several rows takes at most SCHEDULE's verify_splits splits, one row MAX_SPLITS; or SCHEDULE's
short_chunk while write_index + MAX_ROWS keys fit the launch's splits at that size: more splits of one
BLOCK_S step each, all of whose cached keys load before the PDL wait), one program per (kv head, split,
tile of 16 query rows); the g query heads sharing a KV head ride along the rows (row r = token r//g,
head r%g), so each KV tile is read once per head group. Splits past the live length return at once;
the reduction combines the live ones in a fixed order. Chunks at absolute positions chosen from
write_index alone, and fixed row tiles, make a row's result independent of how many rows (from 2) the
call carries (kernels/__init__.py); a token decoded alone and verified as row r of a block at write_index
wi share the split layout while both are in short_chunk's range (on a 4352-slot cache: wi + 64 <= 1088,
the verify's 17 splits of 64 keys) and not past it (one row's chunk is 128 keys, several rows' 256).

Launch options (SCHEDULE; none changes a result but attn_warps, which lays the dot products out otherwise):
attn_maxnreg caps the split kernel's registers for grids of more than four programs a SM at the cache's
full length (``many``: ~180 registers uncapped, two programs a SM; 128, four); attn_stages, attn_warps and
attn_prefetch (a bulk L2 prefetch of a split's later cached keys before the PDL wait) were measured without
gain and stay at 2 / 4 / off. One that changes bits at long contexts (the fp32 sum over the splits in
another thread layout, the same for every row count): combine_block, the columns of a head each reduction
program sums (32: a one-row call's reduction on a 4352-slot cache on 128 one-warp programs, not 32 of
four).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xcompile.runtime.engines.kernels import MAX_ROWS, ROW_TILE, SCHEDULE, ieee_dot, launch, pdl
from xcompile.runtime.engines.kernels.common import attn_early, schedule_flags
from xcompile.runtime.engines.kernels.gemv import sms

BLOCK_S = 64        # keys per inner step
CHUNK = 128         # keys per split (splits past the live length return at once). The Qwen3-8B-shape step
                    # on the H200 (benchmarks/fast_decode.py --chunks 64,128,256, 2026-12-01), ms at 1 / 32
                    # tokens: context 128 4.521 / 6.619, 4.565 / 6.269, 4.632 / 6.217; context 4096 4.885 /
                    # 9.260, 4.798 / 8.198, 4.874 / 7.770
MAX_SPLITS = 128    # longer caches get longer chunks: the reduction holds every split's partial at once


@triton.jit
def _attend_block(q, k, v, keys, end, tok, live, TM, stride_tm, wi, M, W, sm_scale, m_i, l_i, acc,
                  IEEE: tl.constexpr):
    """Online-softmax update of one query tile's state (m_i, l_i, acc) with the keys ``keys``."""
    inside = keys < end
    if IEEE:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * sm_scale
    col = keys - (wi + M - W)                                               # >= 0: a column of the mask
    in_mask = (col >= 0) & inside
    seen = tl.load(TM + tok[:, None] * stride_tm + col[None, :], mask=live[:, None] & in_mask[None, :], other=0)
    visible = ((col < 0)[None, :] | (seen != 0)) & inside[None, :]
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                   # rows with nothing visible yet
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _prefetch_l2(P, first, last, ROW_BYTES: tl.constexpr, THREADS: tl.constexpr):
    """Ask L2 for rows first..last-1 of P (ROW_BYTES apart, contiguous), one bulk prefetch
    (cp.async.bulk.prefetch.L2, sm_90+) per row and thread: no result, nothing waits for it."""
    base = P.to(tl.pointer_type(tl.int8))
    for r0 in range(first, last, THREADS):
        r = (r0 + tl.arange(0, THREADS)).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.lt.s32 p, $2, $3; @p cp.async.bulk.prefetch.L2.global [$1], $4; }\n"
            "mov.u32 $0, 0;", "=r,l,r,r,r",
            [base + r.to(tl.int64) * ROW_BYTES, r, tl.zeros_like(r) + last.to(tl.int32), tl.zeros_like(r) + ROW_BYTES],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chunk(wi, CHUNK, splits, SMALL: tl.constexpr, MAX_M: tl.constexpr):
    """Keys per split: SMALL while write_index + MAX_M keys fit the launch's splits at that size (SCHEDULE's
    short_chunk; the same for every row count, so a row's bits stay those of a block's row), else CHUNK."""
    chunk = CHUNK + 0 * wi
    if SMALL > 0:
        chunk = tl.where(wi + MAX_M <= SMALL * splits, SMALL, chunk)
    return chunk


@triton.jit
def _split_kernel(Q, KC, VC, WI, TM, OP, MLP, M, W, stride_q, stride_ch, stride_tm, sm_scale, CHUNK,
                  SMALL: tl.constexpr, MAX_M: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                  EARLY: tl.constexpr, FIRST: tl.constexpr, PREFETCH: tl.constexpr, ROW_BYTES: tl.constexpr,
                  THREADS: tl.constexpr):
    if PDL and FIRST:
        tl.extra.cuda.gdc_launch_dependents()           # attn_early: the reduction, then the o projection, launch now
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    tok = rows // G
    head = kvh * G + rows % G
    live = tok < M
    d = tl.arange(0, D)
    # write_index and the cached keys below it are older than this launch's predecessor (rope_kv, which
    # writes only keys write_index..write_index+M-1 and lets this launch start once its own wait is over):
    # splits past the live length return at once, and the first block's cached keys and values are in
    # flight before the wait (programmatic dependent launch).
    wi = tl.load(WI)
    chunk = _chunk(wi, CHUNK, tl.num_programs(1), SMALL, MAX_M)
    start = split * chunk
    end = tl.minimum(start + chunk, wi + M)
    if start < end:
        base = kvh * stride_ch
        keys = start + tl.arange(0, BLOCK_S)
        cached = keys < tl.minimum(end, wi)
        offs = base + keys[:, None] * D + d[None, :]
        k = tl.load(KC + offs, mask=cached[:, None], other=0.0)
        v = tl.load(VC + offs, mask=cached[:, None], other=0.0)
        if PDL:
            if PREFETCH:                                # the later steps' cached keys, into L2 before the wait
                last = tl.minimum(end, wi)
                _prefetch_l2(KC + base, start + BLOCK_S, last, ROW_BYTES, THREADS)
                _prefetch_l2(VC + base, start + BLOCK_S, last, ROW_BYTES, THREADS)
            tl.extra.cuda.gdc_wait()
            if EARLY and not FIRST:
                tl.extra.cuda.gdc_launch_dependents()
        new = (keys >= wi) & (keys < end)                                   # this step's keys, written by rope_kv
        k = tl.load(KC + offs, mask=new[:, None], other=k)                  # in place: no second tile live
        v = tl.load(VC + offs, mask=new[:, None], other=v)
        q = tl.load(Q + tok[:, None] * stride_q + head[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
        m_i, l_i, acc = _attend_block(q, k, v, keys, end, tok, live, TM, stride_tm, wi, M, W, sm_scale, m_i, l_i,
                                      acc, IEEE)
        for s0 in range(start + BLOCK_S, end, BLOCK_S):
            ks = s0 + tl.arange(0, BLOCK_S)
            kv_offs = base + ks[:, None] * D + d[None, :]
            k = tl.load(KC + kv_offs, mask=(ks < end)[:, None], other=0.0)
            v = tl.load(VC + kv_offs, mask=(ks < end)[:, None], other=0.0)
            m_i, l_i, acc = _attend_block(q, k, v, ks, end, tok, live, TM, stride_tm, wi, M, W, sm_scale, m_i,
                                          l_i, acc, IEEE)
        if PDL and not EARLY and not FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        # partials [splits, M, HQ, (D | m, l)]; the combine reads the live splits only
        slot = (split * M + tok) * HQ + head
        tl.store(OP + slot[:, None] * D + d[None, :], acc, mask=live[:, None])
        tl.store(MLP + slot * 2, m_i, mask=live)
        tl.store(MLP + slot * 2 + 1, l_i, mask=live)


@triton.jit
def _combine_kernel(OP, MLP, OUT, WI, M, stride_o, CHUNK, SPLITS, SMALL: tl.constexpr, MAX_M: tl.constexpr,
                    HQ: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr,
                    FIRST: tl.constexpr):
    """One program per (token, head, DB of the head's D columns): the live splits' partials of those
    columns, weighted by their softmax statistics, summed over the splits."""
    if PDL:
        if FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not FIRST:
            tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    wi = tl.load(WI)
    ok = s < tl.cdiv(wi + M, _chunk(wi, CHUNK, SPLITS, SMALL, MAX_M))       # the splits that hold live keys
    slot = (s * M + tok) * HQ + head
    m = tl.load(MLP + slot * 2, mask=ok, other=float("-inf"))
    l = tl.load(MLP + slot * 2 + 1, mask=ok, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))                 # empty splits weigh nothing
    d = tl.program_id(2) * DB + tl.arange(0, DB)
    acc = tl.load(OP + slot[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    y = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(OUT + tok * stride_o + head * D + d, y.to(OUT.dtype.element_ty))


def many(programs: int, device: torch.device) -> bool:
    """Whether a split launch of ``programs`` programs (at the cache's full length) takes SCHEDULE's
    attn_maxnreg: more than 4 a SM. Uncapped the split kernel holds ~180 registers a thread at 4 warps,
    two programs a SM; capped at 128, four (scripts/compile_sm90.py --resources _split_kernel)."""
    return programs > 4 * sms(device)


def chunk_for(max_seq_len: int, rows: int = 1) -> int:
    """Keys per split for a call of ``rows`` rows on a cache of ``max_seq_len`` slots: CHUNK, or whole
    BLOCK_S steps such that at most MAX_SPLITS splits (one row) or SCHEDULE's verify_splits (several rows;
    0: MAX_SPLITS) cover the cache."""
    splits = int(SCHEDULE["verify_splits"]) if rows > 1 and SCHEDULE["verify_splits"] else MAX_SPLITS
    return max(CHUNK, BLOCK_S * math.ceil(max_seq_len / (splits * BLOCK_S)))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write_index: torch.Tensor,
              tree_mask: torch.Tensor, heads: int, chunk: int | None = None, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """q [M, Hq*D]; caches [1, Hkv, S_max, D]; write_index [1]; tree_mask [M, W >= M] bool (rows may be
    strided) -> [M, Hq*D]. chunk: keys per split (None or 0: chunk_for the cache and M)."""
    m = q.shape[0]
    _, kv_heads, max_seq_len, d = k_cache.shape
    g = heads // kv_heads
    chunk = chunk or chunk_for(max_seq_len, m)
    splits = math.ceil(max_seq_len / chunk)
    small = int(SCHEDULE["short_chunk"])
    assert small % BLOCK_S == 0 and m <= MAX_ROWS
    small = small if small < chunk else 0                   # a chunk no shorter than the cache's: nothing to switch
    w = tree_mask.shape[1]
    assert tree_mask.shape[0] == m and w >= m and tree_mask.stride(1) == 1 and q.stride(1) == 1
    warps = int(SCHEDULE["attn_warps"])
    row_bytes = d * k_cache.element_size()
    prefetch = (bool(SCHEDULE["attn_prefetch"]) and row_bytes % 16 == 0 and k_cache.stride() == v_cache.stride()
                and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)    # a bulk prefetch: 16-byte units
    grid = (kv_heads, splits, triton.cdiv(g * m, ROW_TILE))
    regs = {"maxnreg": int(SCHEDULE["attn_maxnreg"])} if SCHEDULE["attn_maxnreg"] and many(math.prod(grid), q.device) else {}
    partial = torch.empty(splits, m, heads, d, dtype=torch.float32, device=q.device)
    stats = torch.empty(splits, m, heads, 2, dtype=torch.float32, device=q.device)
    _split_kernel[grid](
        q, k_cache, v_cache, write_index, tree_mask.view(torch.uint8), partial, stats, m, w, q.stride(0),
        k_cache.stride(1), tree_mask.stride(0), d ** -0.5, chunk, SMALL=small, MAX_M=MAX_ROWS, G=g, HQ=heads, D=d,
        BLOCK_Q=ROW_TILE, BLOCK_S=BLOCK_S, IEEE=ieee_dot(q.dtype), PDL=pdl(), EARLY=schedule_flags(m)["EARLY"],
        FIRST=attn_early(m, "split"), PREFETCH=prefetch, ROW_BYTES=row_bytes,
        THREADS=32 * warps, num_warps=warps, num_stages=int(SCHEDULE["attn_stages"]), **regs, **launch())
    if out is None:
        out = torch.empty(m, heads * d, dtype=q.dtype, device=q.device)
    p2 = triton.next_power_of_2(splits)
    db = min(d, int(SCHEDULE["combine_block"]) or d)
    assert d % db == 0, f"combine_block {db} does not divide head_dim {d}"
    _combine_kernel[(m, heads, d // db)](partial, stats, out, write_index, m, out.stride(0), chunk, splits, SMALL=small,
                                         MAX_M=MAX_ROWS, HQ=heads, D=d, DB=db, SPLITS_P2=p2, PDL=pdl(),
                                         FIRST=attn_early(m, "combine"), num_warps=min(8, max(1, p2 * db // 2048)),
                                         **launch())
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
