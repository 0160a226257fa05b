"""y = epilogue(prologue(x) @ W^T): every projection of a decode/verify step in one kernel.

    x [M, K] (M <= MAX_ROWS), W [N, K] row-major (K contiguous), y [M, N] (or [M, N/2] when gated)
    prologue  RMSNorm of each row of x (fp32 statistics, one rounding, as F.rms_norm)
    epilogue  gated: W stacks [gate; up] (each N/2 rows): y = silu(x Wg^T) * (x Wu^T)
              residual: y = r + x W^T (r may be y itself: each program reads its tile before writing it)
              extra: also store y into a second buffer (the EAGLE3 taps)

Memory-bound at these M: every weight byte is read once, by the program that owns its BLOCK_N output
columns; the rows of x ride along in tiles of 16 (tl.dot's smallest M) so one weight tile serves all
of them. Rounding follows the reference modules (each matmul output rounded to the model dtype
before the next elementwise op), so the reference below is what the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from xcompile.runtime.kernels import MAX_ROWS, ROW_TILE, ieee_dot, launch, pdl


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
def _dot(x, w, acc, IEEE: tl.constexpr):
    """acc + x @ w^T. IEEE: fp32 operands multiplied in full fp32 (not tf32), for fp32 engines and
    for the interpreter, whose tl.dot mishandles bf16 (products of bf16 values are exact in fp32)."""
    if IEEE:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


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
def _load_w(w_ptr, u_ptr, ks, K, GATED: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns ks (and its up tile when gated)."""
    if EVEN_K:
        w = tl.load(w_ptr + ks[None, :])
    else:
        w = tl.load(w_ptr + ks[None, :], mask=ks[None, :] < K, other=0.0)
    wu = w
    if GATED:
        if EVEN_K:
            wu = tl.load(u_ptr + ks[None, :])
        else:
            wu = tl.load(u_ptr + ks[None, :], mask=ks[None, :] < K, other=0.0)
    return w, wu


@triton.jit
def _mac(X, stride_xm, G, M, K, ks, w, wu, s0, s1, s2, s3, a0, a1, a2, a3, u0, u1, u2, u3,
         BLOCK_M: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr,
         EVEN_K: tl.constexpr, TILES: tl.constexpr):
    """Accumulate one K step of every row tile against the weight tile(s)."""
    r0 = tl.arange(0, BLOCK_M)
    x = _load_x(X, stride_xm, r0, M, ks, K, s0, G, NORM, EVEN_K)
    a0 = _dot(x, w, a0, IEEE)
    if GATED:
        u0 = _dot(x, wu, u0, IEEE)
    if TILES > 1:
        x = _load_x(X, stride_xm, r0 + BLOCK_M, M, ks, K, s1, G, NORM, EVEN_K)
        a1 = _dot(x, w, a1, IEEE)
        if GATED:
            u1 = _dot(x, wu, u1, IEEE)
    if TILES > 2:
        x = _load_x(X, stride_xm, r0 + 2 * BLOCK_M, M, ks, K, s2, G, NORM, EVEN_K)
        a2 = _dot(x, w, a2, IEEE)
        if GATED:
            u2 = _dot(x, wu, u2, IEEE)
    if TILES > 3:
        x = _load_x(X, stride_xm, r0 + 3 * BLOCK_M, M, ks, K, s3, G, NORM, EVEN_K)
        a3 = _dot(x, w, a3, IEEE)
        if GATED:
            u3 = _dot(x, wu, u3, IEEE)
    return a0, a1, a2, a3, u0, u1, u2, u3


@triton.jit
def _linear_kernel(X, W, Y, R, G, Y2, WS, CNT, M, N_OUT, K, K_SPLIT, stride_xm, stride_ym, stride_rm, stride_y2m,
                   eps, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, EXTRA: tl.constexpr,
                   IEEE: tl.constexpr, EVEN_K: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program: BLOCK_N output columns for all M rows (TILES tiles of BLOCK_M rows, unrolled), over
    # the K_SPLIT columns of x starting at program_id(1) * K_SPLIT (all of K unless split)
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(1) * K_SPLIT
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wrows = tl.where(cols < N_OUT, cols, 0)                 # clamp instead of masking the weight loads
    w_ptr = W + wrows[:, None] * K
    u_ptr = W + (wrows[:, None] + N_OUT) * K                # gated: the up rows follow the N_OUT gate rows
    # the weights never depend on the previous kernel: fetch the first tile before waiting for it
    # (programmatic dependent launch: this kernel may start while the previous one drains)
    ks = k_begin + tl.arange(0, BLOCK_K)
    w, wu = _load_w(w_ptr, u_ptr, ks, K, GATED, EVEN_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    r0 = tl.arange(0, BLOCK_M)
    # per-row 1/rms of each tile (unused without NORM)
    s0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    s1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    s3 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        s0 = _rstd(X, stride_xm, r0, M, K, eps, BLOCK_M, BLOCK_K)
        if TILES > 1:
            s1 = _rstd(X, stride_xm, r0 + BLOCK_M, M, K, eps, BLOCK_M, BLOCK_K)
        if TILES > 2:
            s2 = _rstd(X, stride_xm, r0 + 2 * BLOCK_M, M, K, eps, BLOCK_M, BLOCK_K)
        if TILES > 3:
            s3 = _rstd(X, stride_xm, r0 + 3 * BLOCK_M, M, K, eps, BLOCK_M, BLOCK_K)
    # accumulators of each tile (u*: the up half when gated)
    a0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a0, a1, a2, a3, u0, u1, u2, u3 = _mac(X, stride_xm, G, M, K, ks, w, wu, s0, s1, s2, s3, a0, a1, a2, a3,
                                          u0, u1, u2, u3, BLOCK_M, NORM, GATED, IEEE, EVEN_K, TILES)
    for k0 in range(k_begin + BLOCK_K, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w, wu = _load_w(w_ptr, u_ptr, ks, K, GATED, EVEN_K)
        a0, a1, a2, a3, u0, u1, u2, u3 = _mac(X, stride_xm, G, M, K, ks, w, wu, s0, s1, s2, s3, a0, a1, a2, a3,
                                              u0, u1, u2, u3, BLOCK_M, NORM, GATED, IEEE, EVEN_K, TILES)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()               # the next kernel may launch (and wait) now
    if SPLIT == 1:
        _epilogues(a0, a1, a2, a3, u0, u1, u2, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0, cols, M, N_OUT,
                   GATED, RESIDUAL, EXTRA, BLOCK_M, TILES)
    else:
        # Split K: each program leaves its fp32 partial sums in WS [SPLIT, 2 (gate, up), TILES*BLOCK_M, N_OUT];
        # the last of a column block's SPLIT programs to arrive (counter CNT[pid_n]) adds them up in split
        # order, so the result does not depend on which program finished last, and runs the epilogue.
        rows_pad = TILES * BLOCK_M
        part = WS + (tl.program_id(1) * 2 * rows_pad) * N_OUT
        _store_partials(part, a0, a1, a2, a3, r0, cols, N_OUT, BLOCK_M, TILES)
        if GATED:
            _store_partials(part + rows_pad * N_OUT, u0, u1, u2, u3, r0, cols, N_OUT, BLOCK_M, TILES)
        tl.debug_barrier()                                  # every thread's partials before the release
        arrived = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            a0, a1, a2, a3 = _sum_partials(WS, 0, SPLIT, r0, cols, N_OUT, BLOCK_M, BLOCK_N, TILES)
            if GATED:
                u0, u1, u2, u3 = _sum_partials(WS, rows_pad, SPLIT, r0, cols, N_OUT, BLOCK_M, BLOCK_N, TILES)
            _epilogues(a0, a1, a2, a3, u0, u1, u2, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0, cols, M,
                       N_OUT, GATED, RESIDUAL, EXTRA, BLOCK_M, TILES)
            tl.store(CNT + pid_n, 0)                        # ready for the next launch


@triton.jit
def _epilogues(a0, a1, a2, a3, u0, u1, u2, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0, cols, M, N_OUT,
               GATED: tl.constexpr, RESIDUAL: tl.constexpr, EXTRA: tl.constexpr, BLOCK_M: tl.constexpr,
               TILES: tl.constexpr):
    _epilogue(a0, u0, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0, cols, M, N_OUT, GATED, RESIDUAL, EXTRA)
    if TILES > 1:
        _epilogue(a1, u1, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0 + BLOCK_M, cols, M, N_OUT, GATED,
                  RESIDUAL, EXTRA)
    if TILES > 2:
        _epilogue(a2, u2, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0 + 2 * BLOCK_M, cols, M, N_OUT, GATED,
                  RESIDUAL, EXTRA)
    if TILES > 3:
        _epilogue(a3, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0 + 3 * BLOCK_M, cols, M, N_OUT, GATED,
                  RESIDUAL, EXTRA)


@triton.jit
def _store_partials(P, a0, a1, a2, a3, r0, cols, N_OUT, BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    """Row tiles of one program's partial sums into P [TILES*BLOCK_M, N_OUT] (fp32)."""
    ok = cols[None, :] < N_OUT
    tl.store(P + r0[:, None] * N_OUT + cols[None, :], a0, mask=ok)
    if TILES > 1:
        tl.store(P + (r0 + BLOCK_M)[:, None] * N_OUT + cols[None, :], a1, mask=ok)
    if TILES > 2:
        tl.store(P + (r0 + 2 * BLOCK_M)[:, None] * N_OUT + cols[None, :], a2, mask=ok)
    if TILES > 3:
        tl.store(P + (r0 + 3 * BLOCK_M)[:, None] * N_OUT + cols[None, :], a3, mask=ok)


@triton.jit
def _sum_tile(WS, offset, SPLIT: tl.constexpr, rows, cols, N_OUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              TILES: tl.constexpr):
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    stride = 2 * TILES * BLOCK_M * N_OUT                    # one split's partials (gate and up halves)
    for s in tl.static_range(SPLIT):                        # split order: deterministic
        # .cg: read through to L2, where the other programs' partials are (this SM's L1 may hold stale lines)
        acc += tl.load(WS + s * stride + (offset + rows)[:, None] * N_OUT + cols[None, :],
                       mask=cols[None, :] < N_OUT, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _sum_partials(WS, offset, SPLIT: tl.constexpr, r0, cols, N_OUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  TILES: tl.constexpr):
    a0 = _sum_tile(WS, offset, SPLIT, r0, cols, N_OUT, BLOCK_M, BLOCK_N, TILES)
    a1 = a0
    a2 = a0
    a3 = a0
    if TILES > 1:
        a1 = _sum_tile(WS, offset, SPLIT, r0 + BLOCK_M, cols, N_OUT, BLOCK_M, BLOCK_N, TILES)
    if TILES > 2:
        a2 = _sum_tile(WS, offset, SPLIT, r0 + 2 * BLOCK_M, cols, N_OUT, BLOCK_M, BLOCK_N, TILES)
    if TILES > 3:
        a3 = _sum_tile(WS, offset, SPLIT, r0 + 3 * BLOCK_M, cols, N_OUT, BLOCK_M, BLOCK_N, TILES)
    return a0, a1, a2, a3


@triton.jit
def _gemv_kernel(X, W, Y, R, G, Y2, WS, CNT, N_OUT, K, K_SPLIT, eps, NORM: tl.constexpr, GATED: tl.constexpr,
                 RESIDUAL: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one row (decode): BLOCK_N output columns per program on the CUDA cores, fp32 products accumulated
    # per lane over the program's K_SPLIT columns (all of K unless split) and reduced once at the end;
    # the next weight tile is requested before the current one is used (software double buffering),
    # and the first before waiting for the previous kernel (PDL). K_SPLIT is a multiple of BLOCK_K.
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = k_begin + K_SPLIT
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wrows = tl.where(cols < N_OUT, cols, 0)
    w_ptr = W + wrows[:, None] * K
    u_ptr = W + (wrows[:, None] + N_OUT) * K
    ks = tl.arange(0, BLOCK_K)
    w_next, wu_next = _load_w(w_ptr, u_ptr, k_begin + ks, K, GATED, True)
    if PDL:
        tl.extra.cuda.gdc_wait()
    rstd = tl.zeros([1], dtype=tl.float32) + 1.0
    if NORM:
        rstd = _rstd(X, 0, tl.arange(0, 1), 1, K, eps, 1, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    accu = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        w, wu = w_next, wu_next
        nk = k0 + BLOCK_K + ks
        w_next = tl.load(w_ptr + nk[None, :], mask=nk[None, :] < k_end, other=0.0)
        if GATED:
            wu_next = tl.load(u_ptr + nk[None, :], mask=nk[None, :] < k_end, other=0.0)
        x = _load_x(X, 0, tl.arange(0, 1), 1, k0 + ks, K, rstd, G, NORM, True).to(tl.float32)   # [1, BLOCK_K]
        acc += w.to(tl.float32) * x
        if GATED:
            accu += wu.to(tl.float32) * x
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    yu = tl.sum(accu, axis=1)
    if SPLIT > 1:
        # as the tile kernel's split K: partial sums [SPLIT, 2, N_OUT] in WS, the column block's last
        # program (counter CNT[pid_n]) adds them in split order and runs the epilogue
        ok = cols < N_OUT
        part = WS + tl.program_id(1) * 2 * N_OUT
        tl.store(part + cols, y, mask=ok)
        if GATED:
            tl.store(part + N_OUT + cols, yu, mask=ok)
        tl.debug_barrier()
        if tl.atomic_add(CNT + pid_n, 1, sem="acq_rel") == SPLIT - 1:
            tl.debug_barrier()
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
            yu = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                y += tl.load(WS + s * 2 * N_OUT + cols, mask=ok, other=0.0, cache_modifier=".cg")
                if GATED:
                    yu += tl.load(WS + s * 2 * N_OUT + N_OUT + cols, mask=ok, other=0.0, cache_modifier=".cg")
            _epilogue(y[None, :], yu[None, :], Y, 0, Y2, 0, R, 0, tl.arange(0, 1), cols, 1, N_OUT, GATED, RESIDUAL,
                      EXTRA)
            tl.store(CNT + pid_n, 0)
    else:
        _epilogue(y[None, :], yu[None, :], Y, 0, Y2, 0, R, 0, tl.arange(0, 1), cols, 1, N_OUT, GATED, RESIDUAL,
                  EXTRA)


# Tiles per weight shape (N_OUT, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, split of K); never per row
# count, so a row's reduction order is the same at every row count the tile kernel serves. The fastest
# of benchmarks/kernels.py's candidates at one row on the H200 (2026-12-01, `python benchmarks/kernels.py
# --sweep`, docs/BENCHMARKS.md); DEFAULT_TILE for other shapes.
DEFAULT_TILE = (32, 512, 4, 3, 1)
TILES: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (6144, 4096): (32, 256, 4, 3, 2),       # Qwen3-8B qkv
    (4096, 4096): (64, 256, 4, 3, 4),       # Qwen3-8B o_proj
    (12288, 4096): (128, 128, 8, 3, 1),     # Qwen3-8B gate/up (gated: 2 x 12288 rows)
    (4096, 12288): (32, 512, 4, 3, 1),      # Qwen3-8B down_proj, EAGLE3 fc
    (151936, 4096): (128, 128, 8, 3, 1),    # Qwen3-8B lm_head
    (6144, 8192): (32, 256, 4, 3, 2),       # EAGLE3 qkv (over [embedding, hidden])
    (32000, 4096): (128, 128, 8, 3, 1),     # EAGLE3 lm_head (draft vocabulary)
    (4096, 1024): (32, 256, 4, 3, 1),       # Qwen3-0.6B qkv
    (1024, 2048): (32, 256, 4, 3, 2),       # Qwen3-0.6B o_proj
    (3072, 1024): (64, 256, 4, 3, 2),       # Qwen3-0.6B gate/up
    (1024, 3072): (32, 256, 4, 3, 2),       # Qwen3-0.6B down_proj
    (151936, 1024): (128, 128, 8, 3, 1),    # Qwen3-0.6B lm_head
}


def tile_for(n_out: int, k: int) -> tuple[int, int, int, int, int]:
    block_n, block_k, warps, stages, split = TILES.get((n_out, k), DEFAULT_TILE)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if k % (split * block_k):                   # a split covers whole K blocks
        split = 1
    return block_n, block_k, warps, stages, split


# One-row (decode) tiles on the CUDA-core GEMV (N_OUT, K) -> (BLOCK_N, BLOCK_K, num_warps, split of K);
# shapes not listed run one-row calls on the tile kernel above. A row decoded alone then rounds
# differently from the same row inside a verify block (another reduction order), so speculative and
# plain greedy may part at near-ties; benchmarks/kernels.py measures both (--gemv: only these).
# Chosen by `python benchmarks/kernels.py --gemv` on the H200 (2026-12-01, third session: each shape called
# as the engines call it; split K never won at these shapes), us against the tile kernel in the same run:
GEMV_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (4, 1024, 4, 1),          # Qwen3-8B qkv (+ RMSNorm): 20.3 against 22.0 (16/512: 27.1)
    (4096, 4096): (4, 512, 4, 1),           # Qwen3-8B o_proj (+ residual): 10.2 / 12.0
    (4096, 12288): (4, 512, 4, 1),          # Qwen3-8B down_proj (+ residual), EAGLE3 fc: 26.3 / 28.3
    (6144, 8192): (16, 512, 4, 1),          # EAGLE3 qkv: 27.0 / 29.7
}


def gemv_tile(n_out: int, k: int) -> tuple[int, int, int, int] | None:
    """The one-row GEMV's tile for this shape, or None (the tile kernel): a split covers whole K blocks."""
    tile = GEMV_TILES.get((n_out, k))
    if tile is None:
        return None
    block_n, block_k, warps, split = (*tile, 1)[:4]
    if k % (split * block_k):
        return None if k % block_k else (block_n, block_k, warps, 1)
    return block_n, block_k, warps, split


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters of the split-K column blocks, zero between launches (each launch resets those it
    used); one buffer per device, allocated on first use (before any graph capture records it)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def linear(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 1e-6,
           gated: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           extra_out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] (module docstring). w [N, K] (gated: [2N, K], gate rows then up rows);
    norm [K]: RMSNorm weight of the prologue; residual [M, N] (may be ``out``); extra_out [M, N]
    (any row stride): a second copy of the result. Rows of x may be strided; columns contiguous."""
    m, k = x.shape
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    assert 1 <= m <= MAX_ROWS and w.shape[1] == k and x.stride(1) == 1 and w.is_contiguous(), (x.shape, w.shape)
    if out is None:
        out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    dummy = out
    gemv = gemv_tile(n_out, k) if m == 1 else None
    if gemv is not None:
        block_n, block_k, warps, split = gemv
        blocks = triton.cdiv(n_out, block_n)
        ws = torch.empty(split, 2, n_out, dtype=torch.float32, device=x.device) if split > 1 else dummy
        _gemv_kernel[(blocks, split)](
            x, w, out, residual if residual is not None else dummy, norm if norm is not None else dummy,
            extra_out if extra_out is not None else dummy, ws, _counters(x.device, blocks) if split > 1 else dummy,
            n_out, k, k // split, eps, NORM=norm is not None, GATED=gated, RESIDUAL=residual is not None,
            EXTRA=extra_out is not None, PDL=pdl(), SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
            num_stages=1, **launch())
        return out
    block_n, block_k, warps, stages, split = tile_for(n_out, k)
    blocks, tiles = triton.cdiv(n_out, block_n), triton.cdiv(m, ROW_TILE)
    ws = torch.empty(split, 2, tiles * ROW_TILE, n_out, dtype=torch.float32, device=x.device) if split > 1 else dummy
    cnt = _counters(x.device, blocks) if split > 1 else dummy
    _linear_kernel[(blocks, split)](
        x, w, out, residual if residual is not None else dummy, norm if norm is not None else dummy,
        extra_out if extra_out is not None else dummy, ws, cnt, m, n_out, k, k // split, x.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, extra_out.stride(0) if extra_out is not None else 0, eps,
        NORM=norm is not None, GATED=gated, RESIDUAL=residual is not None, EXTRA=extra_out is not None,
        IEEE=ieee_dot(x.dtype), EVEN_K=k % block_k == 0, TILES=tiles, PDL=pdl(), SPLIT=split,
        BLOCK_M=ROW_TILE, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **launch())
    return out


def linear_reference(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 1e-6,
                     gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """What ``linear`` computes, in plain torch ops with the reference modules' rounding."""
    if norm is not None:
        x = F.rms_norm(x, (x.shape[-1],), norm, eps)
    if gated:
        gate, up = w.chunk(2)
        y = F.silu(x @ gate.T) * (x @ up.T)
    else:
        y = x @ w.T
    return y if residual is None else residual + y
