"""Split-KV attention of a step's new tokens over the live KV length, then the reduction of the splits.

    q [B*M, Hq*D] (rotated), k/v caches [B, Hkv, S_max, D], write_index [B], tree_mask [B, M, W] bool
    ->  out [B*M, Hq*D]

The caches are in q's dtype or FP8 (e4m3 codes, converted exactly to q's dtype as they are read).

B sequences of M tokens each (the continuous-batching loop's step; B = 1 everywhere else): sequence b's rows
are b*M..b*M+M-1 of q, it reads and writes row b of the caches at its own write_index[b], under its own mask.

The I/O contract's rule: the mask's columns are keys origin..origin+W-1, origin = write_index + M - W;
token m sees every key j < origin and key origin + i iff tree_mask[m, i] (W = M: every committed key
and the new ones the mask allows). Only keys below write_index + M are read: the live length
lives on the device, so the same launch serves every context length inside one CUDA graph.

Split s covers keys [s*chunk, (s+1)*chunk), one program per (sequence and kv head, split, tile of query rows);
the g query heads sharing a KV head ride along the rows (row r = token r//g, head r%g), so each KV tile is read
once per head group. Splits past the live length return at once; the reduction combines the live ones in a
fixed order. Two layouts (``layout``):

- One row (decode), and every call under row_invariant: chunks at absolute positions, chosen from write_index
  alone, and 16-row tiles, so a row's result does not depend on how many rows (from 2) the call carries. The
  chunk: CHUNK keys, or whole BLOCK_S steps such that a call of one row divides the cache into at most
  MAX_SPLITS splits and one of several rows into at most VERIFY_SPLITS (a decode step at context 4096 wants one
  row's 34 splits of 128 keys on a 4352-slot cache, 4.41 ms against 4.48 at 17). And SHORT_CHUNK keys while
  write_index + MAX_ROWS keys fit the launch's splits at that size: every split one BLOCK_S step, all of its
  cached keys requested before the PDL wait (1 / 7 / 32 tokens at context 128: 4.32 / 4.61 / 5.20 -> 4.26 /
  4.56 / 5.14 ms).
- Several rows (a verify block, a batch step's chains): EVEN_SPLITS splits share each sequence's live keys, the
  chunk computed at run time from its write_index, and 32-row tiles. A recorded graph then keeps every split
  busy at any context, where fixed chunks sized for the whole cache left a verify at a shorter context a few
  live ones. A token decoded alone and verified as a block's row then sum their keys in other groupings, and
  speculative and plain greedy may part at a near tie; row_invariant keeps one layout for both.

Under KernelConfig.row_invariant the key steps from the mask's first column on are read per token, its visible
columns packed in order onto consecutive positions (_attend_packed): a tree node then sums its ancestors' keys
in the grouping its token decoded alone sums them, where the mask alone would leave them at scattered slots.

Launches: the split kernel at 4 warps holds ~180 registers a thread, two programs a SM; grids of more than
four programs a SM at the cache's full length are capped at MAXNREG (four a SM: a 32-token verify at
context 4096 7.06 -> 6.73 ms). The reduction sums COMBINE_BLOCK columns of a head a program (a one-row
call's reduction on a 4352-slot cache on 128 one-warp programs, not 32 of four: 4.56 -> 4.45 ms at
context 4096). Calls of several rows let the next launch start before their own PDL wait (the o
projection's programs resident while attention runs: 7 / 32 tokens 4.64 / 5.28 -> 4.60 / 5.18 ms); one-row
calls only from rope_kv (the split kernel requests its cached keys before rope_kv's wait is over).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from xcompile.runtime.common.gpu import ieee_dot, interpreted
from xcompile.runtime.engines.base import KV_FP8
from xcompile.runtime.engines.kernels import MAX_ROWS, ROW_TILE
from xcompile.runtime.engines.kernels.attention_steps import _attend_block, _attend_packed
from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig
from xcompile.runtime.engines.kernels.qcodes import _e4m3

BLOCK_S = 64        # keys per inner step
CHUNK = 128         # keys per split: ms at 1 / 32 tokens on the H200 (Qwen3-8B shape), context 4096: 4.885 /
                    # 9.260 at 64, 4.798 / 8.198 at 128, 4.874 / 7.770 at 256
MAX_SPLITS = 128    # longer caches get longer chunks: the reduction holds every split's partial at once
VERIFY_SPLITS = 17  # the most splits a call of several rows takes under row_invariant (module docstring)
EVEN_SPLITS = 32    # splits sharing the live keys in a call of several rows (``layout``)
VERIFY_TILE = 32    # query rows a program of such a call reads each KV tile for: a 7-token verify's 28 in one
VERIFY_STAGES = 3   # KV tiles in flight a program of such a call on a grid of few programs (``stages_for``)
SHORT_CHUNK = 64    # keys per split while the live keys fit the launch's splits at that size (docstring)
MAXNREG = 128       # the split kernel's register cap for grids of more than four programs a SM
COMBINE_BLOCK = 32  # columns of a head each reduction program sums
WARPS = 4           # of the split kernel (8: within noise at one row, slower at 32 rows)


@triton.jit
def _chunk(wi, CHUNK, splits, SMALL: tl.constexpr, MAX_M: tl.constexpr, EVEN: tl.constexpr, BLOCK_S: tl.constexpr):
    """Keys per split: SMALL while write_index + MAX_M keys fit the launch's splits at that size (the same for
    every row count, so a row's bits stay those of a block's row), else CHUNK. EVEN: the fewest whole BLOCK_S
    steps with which the launch's splits cover write_index + MAX_M keys (``attention``'s ``even``)."""
    if EVEN:
        chunk = BLOCK_S * tl.cdiv(wi + MAX_M, splits * BLOCK_S)
    else:
        chunk = CHUNK + 0 * wi
        if SMALL > 0:
            chunk = tl.where(wi + MAX_M <= SMALL * splits, SMALL, chunk)
    return chunk


@triton.jit
def _split_kernel(Q, KC, VC, WI, TM, OP, MLP, M, W, stride_q, stride_cb, stride_ch, stride_tb, stride_tm, sm_scale,
                  CHUNK, SMALL: tl.constexpr, MAX_M: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                  FIRST: tl.constexpr, KV8: tl.constexpr, NATIVE: tl.constexpr, PACKED: tl.constexpr,
                  WP2: tl.constexpr, EVEN: tl.constexpr):
    if PDL and FIRST:
        tl.extra.cuda.gdc_launch_dependents()           # the reduction, then the o projection, launch now
    HKV: tl.constexpr = HQ // G
    b = tl.program_id(0) // HKV                         # the sequence: its cache row, write_index and mask
    kvh = tl.program_id(0) % HKV
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    tok = rows // G                                     # the sequence's token; its row of Q is b*M + tok
    TM += b * stride_tb
    head = kvh * G + rows % G
    live = tok < M
    d = tl.arange(0, D)
    # write_index and the cached keys below it are older than this launch's predecessor (rope_kv, which
    # writes only keys write_index..write_index+M-1 and lets this launch start once its own wait is over):
    # splits past the live length return at once, and the first block's cached keys and values are in
    # flight before the wait (programmatic dependent launch).
    wi = tl.load(WI + b)
    chunk = _chunk(wi, CHUNK, tl.num_programs(1), SMALL, MAX_M, EVEN, BLOCK_S)
    start = split * chunk
    end = tl.minimum(start + chunk, wi + M)
    if start < end:
        base = b * stride_cb + kvh * stride_ch
        keys = start + tl.arange(0, BLOCK_S)
        cached = keys < tl.minimum(end, wi)
        offs = base + keys[:, None] * D + d[None, :]
        k = tl.load(KC + offs, mask=cached[:, None], other=0)
        v = tl.load(VC + offs, mask=cached[:, None], other=0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            if not FIRST:
                tl.extra.cuda.gdc_launch_dependents()
        new = (keys >= wi) & (keys < end)                                   # this step's keys, written by rope_kv
        k = tl.load(KC + offs, mask=new[:, None], other=k)                  # in place: no second tile live
        v = tl.load(VC + offs, mask=new[:, None], other=v)
        q = tl.load(Q + (b * M + tok)[:, None] * stride_q + head[:, None] * D + d[None, :], mask=live[:, None],
                    other=0.0)
        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
        origin = wi + M - W                                                 # the mask's first column
        if PACKED and start + BLOCK_S > origin:
            m_i, l_i, acc = _attend_packed(q, KC, VC, base, keys, end, tok, live, TM, stride_tm, origin, W, sm_scale,
                                           m_i, l_i, acc, WP2, D, IEEE, KV8, NATIVE)
        else:       # (names of their own: a branch may not retype k, v)
            k_b, v_b = k, v
            if KV8:
                k_b, v_b = _e4m3(k, NATIVE).to(q.dtype), _e4m3(v, NATIVE).to(q.dtype)
            m_i, l_i, acc = _attend_block(q, k_b, v_b, keys, end, tok, live, TM, stride_tm, wi, M, W, sm_scale, m_i,
                                          l_i, acc, IEEE)
        for s0 in range(start + BLOCK_S, end, BLOCK_S):
            ks = s0 + tl.arange(0, BLOCK_S)
            kv_offs = base + ks[:, None] * D + d[None, :]
            if PACKED and s0 + BLOCK_S > origin:
                m_i, l_i, acc = _attend_packed(q, KC, VC, base, ks, end, tok, live, TM, stride_tm, origin, W,
                                               sm_scale, m_i, l_i, acc, WP2, D, IEEE, KV8, NATIVE)
            else:
                k_s = tl.load(KC + kv_offs, mask=(ks < end)[:, None], other=0)
                v_s = tl.load(VC + kv_offs, mask=(ks < end)[:, None], other=0)
                if KV8:
                    k_s, v_s = _e4m3(k_s, NATIVE).to(q.dtype), _e4m3(v_s, NATIVE).to(q.dtype)
                m_i, l_i, acc = _attend_block(q, k_s, v_s, ks, end, tok, live, TM, stride_tm, wi, M, W, sm_scale,
                                              m_i, l_i, acc, IEEE)
        # partials [splits, B*M, HQ, (D | m, l)]; the combine reads the live splits only
        slot = ((split * (tl.num_programs(0) // HKV) + b) * M + tok) * HQ + head
        tl.store(OP + slot[:, None] * D + d[None, :], acc, mask=live[:, None])
        tl.store(MLP + slot * 2, m_i, mask=live)
        tl.store(MLP + slot * 2 + 1, l_i, mask=live)


@triton.jit
def _combine_kernel(OP, MLP, OUT, WI, M, stride_o, CHUNK, SPLITS, SMALL: tl.constexpr, MAX_M: tl.constexpr,
                    HQ: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr,
                    FIRST: tl.constexpr, EVEN: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per (row of the B*M, head, DB of the head's D columns): the live splits' partials of those
    columns, weighted by their softmax statistics, summed over the splits."""
    if PDL:
        if FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not FIRST:
            tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)                                                  # of sequence row // M
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    wi = tl.load(WI + row // M)
    ok = s < tl.cdiv(wi + M, _chunk(wi, CHUNK, SPLITS, SMALL, MAX_M, EVEN, BLOCK_S))    # those with live keys
    slot = (s * tl.num_programs(0) + row) * HQ + head
    m = tl.load(MLP + slot * 2, mask=ok, other=float("-inf"))
    l = tl.load(MLP + slot * 2 + 1, mask=ok, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))                 # empty splits weigh nothing
    d = tl.program_id(2) * DB + tl.arange(0, DB)
    acc = tl.load(OP + slot[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    y = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(OUT + row * stride_o + head * D + d, y.to(OUT.dtype.element_ty))


@functools.cache
def sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the interpreter: 2)."""
    return 2 if interpreted() else torch.cuda.get_device_properties(device).multi_processor_count


def many(programs: int, device: torch.device) -> bool:
    """Whether a split launch of ``programs`` programs (at the cache's full length) takes the register cap:
    more than 4 a SM (scripts/compile_sm90.py --resources _split_kernel shows the registers)."""
    return programs > 4 * sms(device)


def chunk_for(max_seq_len: int, rows: int = 1) -> int:
    """Keys per split for a call of ``rows`` rows on a cache of ``max_seq_len`` slots: CHUNK, or whole
    BLOCK_S steps such that at most MAX_SPLITS splits (one row) or VERIFY_SPLITS (several rows) cover it."""
    splits = VERIFY_SPLITS if rows > 1 else MAX_SPLITS
    return max(CHUNK, BLOCK_S * math.ceil(max_seq_len / (splits * BLOCK_S)))


def layout(max_seq_len: int, rows: int, cfg: KernelConfig = DEFAULT) -> dict:
    """The shipped split layout of a call of ``rows`` rows a sequence, as ``attention``'s keywords. Several rows:
    EVEN_SPLITS splits share the live keys, VERIFY_TILE rows a program. Fixed chunks (chunk_for) on a long cache
    leave a verify at a shorter context few live splits, and 16-row tiles read each KV tile twice for a 7-token
    verify's 28 rows (H100, one 8B layer on a 32,256-slot cache, 7 rows at context 4096 / 16K / 32K: 61.2 / 67.4 /
    70.4 -> 15.6 / 38.9 / 64.6 us; 32 rows 84.1 / 121.4 / 209.8 -> 34.9 / 89.5 / 146.8, but 10.4 -> 12.0 at 128;
    benchmarks/attention_splits.py). One row, and every call under row_invariant: fixed chunks at absolute
    positions and ROW_TILE rows, so a row's bits do not depend on the call's row count or its write_index."""
    if rows > 1 and not cfg.row_invariant:
        return dict(even=EVEN_SPLITS, row_tile=VERIFY_TILE)
    return dict(chunk=chunk_for(max_seq_len, max(rows, 2) if cfg.row_invariant else rows), row_tile=ROW_TILE)


def stages_for(even: int, programs: int, device: torch.device) -> int:
    """The split kernel's num_stages: VERIFY_STAGES for the even layout when its grid runs at most four programs a
    SM (``many``: no register cap), else 2. H100, one 8B layer on a 32,256-slot cache (attention_splits.py --stages
    2,3): 7 rows (one 32-row tile a split, 256 programs) at 32K 63.6 -> 55.1 us, 16K 37.4 -> 33.8, but 4096
    15.6 -> 16.1 and 128 6.0 -> 6.4; 32 rows (four tiles a split, 1,024 programs, capped) 144.9 -> 212.7 at 32K."""
    return VERIFY_STAGES if even and not many(programs, device) else 2


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write_index: torch.Tensor,
              tree_mask: torch.Tensor, heads: int, chunk: int | None = None, out: torch.Tensor | None = None,
              cfg: KernelConfig = DEFAULT, row_tile: int | None = None, even: int = 0, warps: int = WARPS,
              stages: int | None = None) -> torch.Tensor:
    """q [B*M, Hq*D]; caches [B, Hkv, S_max, D]; write_index [B]; tree_mask [B, M, W >= M] bool, or [M, W] for
    B = 1 (rows may be strided) -> [B*M, Hq*D]. Without chunk and even, ``layout``'s. chunk: keys per split at
    absolute positions; even: that many splits share each sequence's live keys at run time (the fewest whole
    BLOCK_S steps covering write_index + MAX_ROWS keys), not under row_invariant (the layout then moves with
    write_index); row_tile: query rows (token x head of a group) a program reads each KV tile for (None: the
    layout's); warps, stages: the split kernel's num_warps and num_stages (None: ``stages_for``'s). The tests and
    benchmarks/attention_splits.py set them."""
    if tree_mask.dim() == 2:
        tree_mask = tree_mask[None]
    batch, m, w = tree_mask.shape
    rows = q.shape[0]
    _, kv_heads, max_seq_len, d = k_cache.shape
    g = heads // kv_heads
    assert not (even and (chunk or cfg.row_invariant)), "even: a layout of its own, not with chunk or row_invariant"
    if not (chunk or even):
        shipped = layout(max_seq_len, m, cfg)
        chunk, even, row_tile = shipped.get("chunk"), shipped.get("even", 0), row_tile or shipped["row_tile"]
    row_tile = row_tile or ROW_TILE
    if even:
        splits = min(even, triton.cdiv(max_seq_len, BLOCK_S))
        chunk = BLOCK_S * triton.cdiv(max_seq_len, splits * BLOCK_S)           # (the kernels' own from write_index)
    else:
        splits = math.ceil(max_seq_len / chunk)
    assert m <= MAX_ROWS and rows == batch * m and write_index.shape == (batch,) and k_cache.shape[0] >= batch
    assert row_tile in (16, 32, 64), f"row_tile {row_tile}: 16, 32 or 64"
    small = SHORT_CHUNK if SHORT_CHUNK < chunk and not even else 0    # no longer than the short one: no switch
    assert w >= m and tree_mask.stride(2) == 1 and q.stride(1) == 1 and k_cache.stride() == v_cache.stride()
    kv8 = k_cache.dtype == KV_FP8
    if kv8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    grid = (batch * kv_heads, splits, triton.cdiv(g * m, row_tile))
    regs = {"maxnreg": MAXNREG} if many(math.prod(grid), q.device) else {}
    stages = stages or stages_for(even, math.prod(grid), q.device)
    partial = torch.empty(splits, rows, heads, d, dtype=torch.float32, device=q.device)
    stats = torch.empty(splits, rows, heads, 2, dtype=torch.float32, device=q.device)
    _split_kernel[grid](
        q, k_cache, v_cache, write_index, tree_mask.view(torch.uint8), partial, stats, m, w, q.stride(0),
        k_cache.stride(0), k_cache.stride(1), tree_mask.stride(0), tree_mask.stride(1), d ** -0.5, chunk, SMALL=small,
        MAX_M=MAX_ROWS, G=g, HQ=heads, D=d, BLOCK_Q=row_tile, BLOCK_S=BLOCK_S, IEEE=ieee_dot(q.dtype),
        PDL=cfg.pdl_on, FIRST=rows > 1, KV8=kv8, NATIVE=not interpreted(), PACKED=cfg.row_invariant,
        WP2=triton.next_power_of_2(w), EVEN=bool(even), num_warps=warps, num_stages=stages, **regs, **cfg.launch())
    if out is None:
        out = torch.empty(rows, heads * d, dtype=q.dtype, device=q.device)
    p2 = triton.next_power_of_2(splits)
    db = min(d, COMBINE_BLOCK)
    assert d % db == 0, f"combine_block {db} does not divide head_dim {d}"
    _combine_kernel[(rows, heads, d // db)](partial, stats, out, write_index, m, out.stride(0), chunk, splits,
                                            SMALL=small, MAX_M=MAX_ROWS, HQ=heads, D=d, DB=db, SPLITS_P2=p2,
                                            PDL=cfg.pdl_on, FIRST=rows > 1, EVEN=bool(even), BLOCK_S=BLOCK_S,
                                            num_warps=min(8, max(1, p2 * db // 2048)),
                                            **cfg.launch())
    return out


def attention_reference(q, k_cache, v_cache, write_index, tree_mask, heads):
    """What ``attention`` computes: softmax(q k^T / sqrt(D) + mask) v over the visible keys, in fp32; each
    sequence of a batch (tree_mask [B, M, W]) over its own cache row."""
    if tree_mask.dim() == 3:
        m = tree_mask.shape[1]
        return torch.cat([attention_reference(q[i * m:(i + 1) * m], k_cache[i:i + 1], v_cache[i:i + 1],
                                              write_index[i:i + 1], tree_mask[i], heads)
                          for i in range(tree_mask.shape[0])])
    m = q.shape[0]
    _, kv_heads, _, d = k_cache.shape
    wi = int(write_index[0])
    n = wi + m
    keys, values = k_cache[0, :, :n].float(), v_cache[0, :, :n].float()          # [Hkv, n, D] (FP8: exact)
    visible = torch.ones(m, n, dtype=torch.bool)
    visible[:, n - tree_mask.shape[1]:] = tree_mask.cpu()
    qh = q.float().view(m, heads, d).transpose(0, 1)                             # [Hq, M, D]
    kh = keys.repeat_interleave(heads // kv_heads, 0)
    vh = values.repeat_interleave(heads // kv_heads, 0)
    scores = (qh @ kh.transpose(1, 2)) * d ** -0.5
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    y = torch.softmax(scores, -1) @ vh                                           # [Hq, M, D]
    return y.transpose(0, 1).reshape(m, heads * d).to(q.dtype)
