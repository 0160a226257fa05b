"""What every tile kernel (linear.py, qlinear.py) does after its K loop, and the row sums that carry an RMSNorm
from one call to the next.

    _finish     a program's fp32 accumulators (up to four row tiles of BLOCK_M rows, a gated call's up halves
                beside them) to y: each row scaled by its 1/rms where the call takes its norm from row sums,
                then the epilogues (common._epilogue), leaving the result's own row sums where asked; with K
                split over programs, each leaves its partials and the last to arrive adds them in split order
    RowSums     the buffer of those sums between two calls ([blocks, MAX_ROWS] fp32 partials) and which result
                they belong to

The accumulators travel as eight named values (a0..a3, u0..u3) because a Triton function cannot index a list of
tensors; TILES (a constexpr) says how many are live.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xcompile.runtime.engines.kernels import MAX_ROWS
from xcompile.runtime.engines.kernels.common import _epilogue

SUM_ROWS = tl.constexpr(MAX_ROWS)    # a row sums buffer's stride: one partial of every row a column block


@triton.jit
def _zero_accs(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Accumulators of each row tile (a*) and their up halves when gated (u*)."""
    z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return z, z, z, z, z, z, z, z


@triton.jit
def _scale_rows(a0, a1, a2, a3, u0, u1, u2, u3, r0, r1, r2, r3, TILES: tl.constexpr):
    """Each row tile's accumulators times its rows' 1/rms r*."""
    a0, u0 = a0 * r0[:, None], u0 * r0[:, None]
    if TILES > 1:
        a1, u1 = a1 * r1[:, None], u1 * r1[:, None]
    if TILES > 2:
        a2, u2 = a2 * r2[:, None], u2 * r2[:, None]
    if TILES > 3:
        a3, u3 = a3 * r3[:, None], u3 * r3[:, None]
    return a0, a1, a2, a3, u0, u1, u2, u3


@triton.jit
def _finish(a0, a1, a2, a3, u0, u1, u2, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, WS, CNT, SQ, SQO, pid_n, pid_k,
            r0, cols, M, N_OUT, K, eps, GATED: tl.constexpr, RESIDUAL: tl.constexpr, EXTRA: tl.constexpr,
            SUMS: tl.constexpr, NSUM: tl.constexpr, NSUM_P2: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, TILES: tl.constexpr):
    """A program's accumulators [BLOCK_M, BLOCK_N] to y: each row scaled by its 1/rms (NSUM > 0), then the
    epilogues; split K (program pid_k of SPLIT over K) through the partials as below."""
    if SPLIT == 1:
        if NSUM > 0:
            q0, q1, q2, q3 = _sums_rstds(SQ, r0, M, K, eps, NSUM, NSUM_P2, BLOCK_M, TILES)
            a0, a1, a2, a3, u0, u1, u2, u3 = _scale_rows(a0, a1, a2, a3, u0, u1, u2, u3, q0, q1, q2, q3, TILES)
        _epilogues(a0, a1, a2, a3, u0, u1, u2, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, SQO, pid_n, r0, cols,
                   M, N_OUT, GATED, RESIDUAL, EXTRA, SUMS, BLOCK_M, TILES)
    else:
        # Split K: each program leaves its fp32 partial sums in WS [SPLIT, 2 (gate, up), TILES*BLOCK_M, N_OUT];
        # the last of a column block's SPLIT programs to arrive (counter CNT[pid_n]) adds them up in split
        # order, so the result does not depend on which program finished last, and runs the epilogue.
        rows_pad = TILES * BLOCK_M
        part = WS + (pid_k * 2 * rows_pad) * N_OUT
        _store_partials(part, a0, a1, a2, a3, r0, cols, M, N_OUT, BLOCK_M, TILES)
        if GATED:
            _store_partials(part + rows_pad * N_OUT, u0, u1, u2, u3, r0, cols, M, N_OUT, BLOCK_M, TILES)
        tl.debug_barrier()                                  # every thread's partials before the release
        arrived = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            a0, a1, a2, a3 = _sum_partials(WS, 0, SPLIT, r0, cols, M, N_OUT, BLOCK_M, BLOCK_N, TILES)
            if GATED:
                u0, u1, u2, u3 = _sum_partials(WS, rows_pad, SPLIT, r0, cols, M, N_OUT, BLOCK_M, BLOCK_N, TILES)
            if NSUM > 0:
                q0, q1, q2, q3 = _sums_rstds(SQ, r0, M, K, eps, NSUM, NSUM_P2, BLOCK_M, TILES)
                a0, a1, a2, a3, u0, u1, u2, u3 = _scale_rows(a0, a1, a2, a3, u0, u1, u2, u3, q0, q1, q2, q3, TILES)
            _epilogues(a0, a1, a2, a3, u0, u1, u2, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, SQO, pid_n, r0,
                       cols, M, N_OUT, GATED, RESIDUAL, EXTRA, SUMS, BLOCK_M, TILES)
            tl.store(CNT + pid_n, 0)                        # ready for the next launch


@triton.jit
def _epilogues(a0, a1, a2, a3, u0, u1, u2, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, SQO, pid_n, r0, cols, M,
               N_OUT, GATED: tl.constexpr, RESIDUAL: tl.constexpr, EXTRA: tl.constexpr, SUMS: tl.constexpr,
               BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    y = _epilogue(a0, u0, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0, cols, M, N_OUT, GATED, RESIDUAL, EXTRA)
    if SUMS:
        _store_sums(SQO, y, pid_n, r0, cols, M, N_OUT)
    if TILES > 1:
        y = _epilogue(a1, u1, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0 + BLOCK_M, cols, M, N_OUT, GATED,
                      RESIDUAL, EXTRA)
        if SUMS:
            _store_sums(SQO, y, pid_n, r0 + BLOCK_M, cols, M, N_OUT)
    if TILES > 2:
        y = _epilogue(a2, u2, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0 + 2 * BLOCK_M, cols, M, N_OUT, GATED,
                      RESIDUAL, EXTRA)
        if SUMS:
            _store_sums(SQO, y, pid_n, r0 + 2 * BLOCK_M, cols, M, N_OUT)
    if TILES > 3:
        y = _epilogue(a3, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, r0 + 3 * BLOCK_M, cols, M, N_OUT, GATED,
                      RESIDUAL, EXTRA)
        if SUMS:
            _store_sums(SQO, y, pid_n, r0 + 3 * BLOCK_M, cols, M, N_OUT)


@triton.jit
def _store_sums(SQO, y, pid_n, rows, cols, M, N_OUT):
    """Each row's sum of squares of this program's columns of the stored result y [BLOCK_M, BLOCK_N] (fp32, the
    columns in the tile's reduction order) into SQO [blocks, SUM_ROWS] at row pid_n."""
    yf = tl.where(cols[None, :] < N_OUT, y.to(tl.float32), 0.0)
    tl.store(SQO + pid_n * SUM_ROWS + rows, tl.sum(yf * yf, axis=1), mask=rows < M)


@triton.jit
def _sums_rstd(SQ, rows, M, K, eps, NSUM: tl.constexpr, NSUM_P2: tl.constexpr):
    """The rows' 1/rms from the NSUM partial sums of squares SQ [NSUM, SUM_ROWS] of their K columns, added in
    one fixed order (the same at every row count)."""
    b = tl.arange(0, NSUM_P2)
    s = tl.load(SQ + b[:, None] * SUM_ROWS + rows[None, :], mask=(b[:, None] < NSUM) & (rows[None, :] < M),
                other=0.0)
    return tl.rsqrt(tl.sum(s, axis=0) / K + eps)


@triton.jit
def _sums_rstds(SQ, r0, M, K, eps, NSUM: tl.constexpr, NSUM_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                TILES: tl.constexpr):
    """_sums_rstd of each of the TILES row tiles."""
    s0 = _sums_rstd(SQ, r0, M, K, eps, NSUM, NSUM_P2)
    s1 = s0
    s2 = s0
    s3 = s0
    if TILES > 1:
        s1 = _sums_rstd(SQ, r0 + BLOCK_M, M, K, eps, NSUM, NSUM_P2)
    if TILES > 2:
        s2 = _sums_rstd(SQ, r0 + 2 * BLOCK_M, M, K, eps, NSUM, NSUM_P2)
    if TILES > 3:
        s3 = _sums_rstd(SQ, r0 + 3 * BLOCK_M, M, K, eps, NSUM, NSUM_P2)
    return s0, s1, s2, s3


@triton.jit
def _store_partials(P, a0, a1, a2, a3, r0, cols, M, N_OUT, BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    """Row tiles of one program's partial sums into P [TILES*BLOCK_M, N_OUT] (fp32), the live rows only."""
    ok = cols[None, :] < N_OUT
    tl.store(P + r0[:, None] * N_OUT + cols[None, :], a0, mask=ok & (r0[:, None] < M))
    if TILES > 1:
        r1 = r0 + BLOCK_M
        tl.store(P + r1[:, None] * N_OUT + cols[None, :], a1, mask=ok & (r1[:, None] < M))
    if TILES > 2:
        r2 = r0 + 2 * BLOCK_M
        tl.store(P + r2[:, None] * N_OUT + cols[None, :], a2, mask=ok & (r2[:, None] < M))
    if TILES > 3:
        r3 = r0 + 3 * BLOCK_M
        tl.store(P + r3[:, None] * N_OUT + cols[None, :], a3, mask=ok & (r3[:, None] < M))


@triton.jit
def _sum_tile(WS, offset, SPLIT: tl.constexpr, rows, cols, M, N_OUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              TILES: tl.constexpr):
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    stride = 2 * TILES * BLOCK_M * N_OUT                    # one split's partials (gate and up halves)
    for s in tl.static_range(SPLIT):                        # split order: deterministic
        # .cg: read through to L2, where the other programs' partials are (this SM's L1 may hold stale lines)
        acc += tl.load(WS + s * stride + (offset + rows)[:, None] * N_OUT + cols[None, :],
                       mask=(cols[None, :] < N_OUT) & (rows[:, None] < M), other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _sum_partials(WS, offset, SPLIT: tl.constexpr, r0, cols, M, N_OUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  TILES: tl.constexpr):
    a0 = _sum_tile(WS, offset, SPLIT, r0, cols, M, N_OUT, BLOCK_M, BLOCK_N, TILES)
    a1 = a0
    a2 = a0
    a3 = a0
    if TILES > 1:
        a1 = _sum_tile(WS, offset, SPLIT, r0 + BLOCK_M, cols, M, N_OUT, BLOCK_M, BLOCK_N, TILES)
    if TILES > 2:
        a2 = _sum_tile(WS, offset, SPLIT, r0 + 2 * BLOCK_M, cols, M, N_OUT, BLOCK_M, BLOCK_N, TILES)
    if TILES > 3:
        a3 = _sum_tile(WS, offset, SPLIT, r0 + 3 * BLOCK_M, cols, M, N_OUT, BLOCK_M, BLOCK_N, TILES)
    return a0, a1, a2, a3


class RowSums:
    """The rows' sums of squares of one call's result, left by the tile kernel's epilogue as one fp32 partial
    per column block ([blocks, MAX_ROWS]), for the RMSNorm of the call that reads that result next, whose
    norm weight the caller folded into its W (W * g, packed once) and gives as ``unit`` (ones): that call
    multiplies x as it is and scales each row's sums by its 1/rms from these before the epilogue, with no
    norm launch and no pass over x (71 fewer launches a 36-layer verify step). ``source`` names the result
    they belong to (its address, rows, columns, row stride); None when the last call given these sums to
    write did not (a GEMV), and then the reader takes its norm as without them (an RMSNorm of weight ones).
    A step resets it first, so no sums outlive it."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device):
        # one partial per column block of the narrowest writer (4 columns: below every tile that writes them)
        self.buf = torch.zeros(triton.cdiv(n, 4), MAX_ROWS, dtype=torch.float32, device=device)
        self.unit = torch.ones(n, dtype=dtype, device=device)
        self.source: tuple | None = None
        self.blocks = 0

    def reset(self) -> None:
        self.source = None

    def left_by(self, t: torch.Tensor, blocks: int) -> None:
        """The sums now in ``buf`` are t's, ``blocks`` partials a row."""
        self.source, self.blocks = RowSums.key(t), blocks

    @staticmethod
    def key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), t.shape[0], t.shape[1], t.stride(0)
