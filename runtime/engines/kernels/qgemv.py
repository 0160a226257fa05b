"""One-row quantized projections (decode, single draft steps) on the CUDA cores: qlinear()'s operands and
epilogues (qlinear.py) for M = 1, where a tensor-core tile would compute 16 rows (its minimum) for one useful
row and stage the codes through shared memory.

One program owns BLOCK_N output columns and streams STEP inputs of each a step (INT4: whole packing chunks),
16 bytes of codes a lane: the codes tile is [BLOCK_N, T, 16] bytes (FP8) or [BLOCK_N, T, 4] int32 words of 8
codes (INT4). Each lane adds up its codes times x in fp32 inside the lane (no shuffle) and scales only that sum,
with the scale (and zero point) of the lane's block:

    fp8    acc[n, t] += s * sum c x
    int4   acc[n, t] += s * (16 * (sum f x - sum x) - z * sum x),   f = 1 + q / 16

where f is the 4-bit code moved into the top of 1.0's mantissa by two integer ops (an int-to-float conversion
runs at a quarter of their rate); sum f x - sum x gives sum q x / 16 losing under 2 of fp32's 24 bits. Narrow
programs streaming long steps keep enough bytes in flight: at the Qwen3-8B shapes on the H200 one decoder
layer's four FP8 projections took 154 us with 16 columns a program and 128 inputs a step, 67 us with 4 and 512
(benchmarks/qlinear_tiles.py). The tiles AHEAD steps ahead are requested before the current one is used
(INT4's best; FP8's best loads each tile in its step, as a tile held across steps is repacked byte by byte).

A norm's 1/rms comes from x's squares as x streams (every program reads all of x): reading the row sums the
previous call left cost every program one load per 4 columns of that call, and made the step slower than
without them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from xcompile.runtime.engines.kernels.common import _epilogue
from xcompile.runtime.engines.kernels.qcodes import _e4m3, _f


@triton.jit
def _columns(pid_n, N_OUT, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Program pid_n's output columns; the same clamped into range (the weight loads need no mask); the scale
    rows of those columns and of their up rows (gated: N_OUT rows further)."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = tl.where(cols < N_OUT, cols, 0)
    return cols, wcols, wcols // ROWS, (wcols + N_OUT) // ROWS


@triton.jit
def _codes_tile(ptr, kb, CU, MASKED: tl.constexpr):
    """The codes tile kb units on from ptr (MASKED: 0 from the row's end CU on, for tiles loaded ahead)."""
    if MASKED:
        inside = tl.full(ptr.shape, kb, tl.int32) < CU       # one bound for the whole tile (a tensor: interpreter)
        return tl.load(ptr + kb, mask=inside, other=0, eviction_policy="evict_first")
    return tl.load(ptr + kb, eviction_policy="evict_first")


@triton.jit
def _x(X, G, ks, NORM: tl.constexpr):
    """x at inputs ks in fp32 (NORM: times the norm's weight, rounded to x's dtype, as the reference norm
    rounds), and x^2 in fp32 (NORM: for the 1/rms; else unused)."""
    x = tl.load(X + ks).to(tl.float32)
    xn = x
    if NORM:
        xn = (x * tl.load(G + ks).to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
    return xn, x * x


@triton.jit
def _step_x(X, G, k0, j, INT4: tl.constexpr, NORM: tl.constexpr, CHUNK: tl.constexpr):
    """A step's x at inputs k0 + j [T, 16] (INT4: and at the chunk's second half, k0 + CHUNK / 2 + j), in fp32
    (NORM: times the norm's weight, rounded); and each lane's sum of x^2 [T] (NORM: for the 1/rms)."""
    xa, sa = _x(X, G, k0 + j, NORM)
    if INT4:
        xb, sb = _x(X, G, k0 + CHUNK // 2 + j, NORM)
        sa += sb
    else:
        xb = xa
    return xa, xb, tl.sum(sa, axis=1)


@triton.jit
def _step_sums(c, xa, xb, k0, first, S, Z, srow, SK, INT4: tl.constexpr, CHUNK: tl.constexpr, COLS: tl.constexpr,
               NATIVE: tl.constexpr, T: tl.constexpr):
    """One step's scaled sums [BLOCK_N, T] of the codes tile c against the step's x (_step_x; a lane's first
    input: k0 + first), module docstring."""
    sz = srow[:, None] * SK + ((k0 + first) // COLS)[None, :]
    s = tl.load(S + sz)
    if INT4:    # c: int32 words [BLOCK_N, T, 4]; x [T, 4 words, 4 bytes] of each chunk half
        xs = tl.sum(xa + xb, axis=1)[None, :]
        xa_even, xa_odd = tl.split(tl.reshape(xa, [T, 4, 2, 2]))   # split() halves the last dimension
        xa0, xa2 = tl.split(xa_even)
        xa1, xa3 = tl.split(xa_odd)
        xb_even, xb_odd = tl.split(tl.reshape(xb, [T, 4, 2, 2]))
        xb0, xb2 = tl.split(xb_even)
        xb1, xb3 = tl.split(xb_odd)
        p = (_f(c, 0) * xa0[None] + _f(c, 8) * xa1[None] + _f(c, 16) * xa2[None] + _f(c, 24) * xa3[None]
             + _f(c, 4) * xb0[None] + _f(c, 12) * xb1[None] + _f(c, 20) * xb2[None] + _f(c, 28) * xb3[None])
        p = tl.sum(p, axis=2)
        z = tl.load(Z + sz)
        out = s * (16.0 * (p - xs) - z * xs)
    else:
        out = s * tl.sum(_e4m3(c, NATIVE) * xa[None, :, :], axis=2)
    return out


@triton.jit
def _qgemv_kernel(X, CODES, S, Z, G, Y, R, Y2, N_OUT, K, SK, CK, eps, GATED: tl.constexpr,
                  RESIDUAL: tl.constexpr, EXTRA: tl.constexpr, INT4: tl.constexpr, NORM: tl.constexpr,
                  PDL: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr, AHEAD: tl.constexpr,
                  CHUNK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, NATIVE: tl.constexpr):
    # a step: STEP inputs (INT4: whole chunks); its codes tile holds UNITS loads of each row, 16 bytes a lane:
    # FP8 bytes [BLOCK_N, T, 16], INT4 int32 words [BLOCK_N, T, 4] (a chunk's byte j: codes j and j + CHUNK / 2)
    T: tl.constexpr = STEP // 32 if INT4 else STEP // 16
    UNITS: tl.constexpr = STEP // 8 if INT4 else STEP
    pid_n = tl.program_id(0)
    cols, wcols, srow, urow = _columns(pid_n, N_OUT, BLOCK_N, ROWS)
    t = tl.arange(0, T)
    if INT4:                                    # a lane's first input (INT4: of the chunk's first half)
        first = (t // (CHUNK // 32)) * CHUNK + (t % (CHUNK // 32)) * 16
    else:
        first = t * 16
    j = first[:, None] + tl.arange(0, 16)[None, :]                                  # [T, 16] x's inputs
    if INT4:
        base = CODES.to(tl.pointer_type(tl.int32))
        CU = CK // 4
        u = t[:, None] * 4 + tl.arange(0, 4)[None, :]
    else:
        base = CODES
        CU = CK
        u = j
    ptr = base + wcols[:, None, None] * CU + u[None, :, :]
    uptr = base + (wcols + N_OUT)[:, None, None] * CU + u[None, :, :]
    # step 0's tile, requested before the wait; AHEAD 0 requests it again in the loop (the measured FP8 tile:
    # whether the L2 then holds it, or the first request is wasted, is not measured apart)
    c1, u1 = _tiles(ptr, uptr, 0, CU, GATED, False)
    c2, u2, c3, u3 = c1, u1, c1, u1
    if AHEAD > 1:
        c2, u2 = _tiles(ptr, uptr, UNITS, CU, GATED, True)
    if AHEAD > 2:
        c3, u3 = _tiles(ptr, uptr, 2 * UNITS, CU, GATED, True)
    if PDL:     # weights never depend on the previous kernel, but x does: its first read waits
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, T], dtype=tl.float32)
    accu = acc
    ss = tl.zeros([T], dtype=tl.float32)
    for k0 in range(0, K, STEP):
        c, cu = c1, u1
        kb = (k0 // STEP + AHEAD) * UNITS
        if AHEAD == 0:
            c, cu = _tiles(ptr, uptr, kb, CU, GATED, False)
        elif AHEAD == 1:
            c1, u1 = _tiles(ptr, uptr, kb, CU, GATED, True)
        elif AHEAD == 2:
            c1, u1 = c2, u2
            c2, u2 = _tiles(ptr, uptr, kb, CU, GATED, True)
        else:
            c1, u1, c2, u2 = c2, u2, c3, u3
            c3, u3 = _tiles(ptr, uptr, kb, CU, GATED, True)
        xa, xb, sq = _step_x(X, G, k0, j, INT4, NORM, CHUNK)         # once for the gate and the up rows
        ss += sq
        acc += _step_sums(c, xa, xb, k0, first, S, Z, srow, SK, INT4, CHUNK, COLS, NATIVE, T)
        if GATED:
            accu += _step_sums(cu, xa, xb, k0, first, S, Z, urow, SK, INT4, CHUNK, COLS, NATIVE, T)
    y = tl.sum(acc, axis=1)
    yu = tl.sum(accu, axis=1)
    if NORM:    # every program streams all of x: its 1/rms from the squares it gathered
        r = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        y, yu = y * r, yu * r
    _epilogue(y[None, :], yu[None, :], Y, 0, Y2, 0, R, 0, tl.arange(0, 1), cols, 1, N_OUT, GATED, RESIDUAL, EXTRA)


@triton.jit
def _tiles(ptr, uptr, kb, CU, GATED: tl.constexpr, MASKED: tl.constexpr):
    """The codes tile kb units into every row (and into its up row when gated)."""
    c = _codes_tile(ptr, kb, CU, MASKED)
    cu = c
    if GATED:
        cu = _codes_tile(uptr, kb, CU, MASKED)
    return c, cu
