"""Weight-only quantized projections (W8A16 FP8, W4A16 INT4): linear()'s operands and epilogues with W stored as
codes and per-block scales (runtime/engines/qweight.py), for every row count up to MAX_ROWS.

Batch-1 decoding reads every weight once a token, so a byte saved is time saved: FP8 reads half of bf16's
bytes, INT4 a quarter (plus a scale, and a zero point, per group). One program owns BLOCK_N output columns for
all rows; each K step loads the codes tile of one scale column (cp.async, ``stages`` ahead), converts the
codes in registers (exact in bf16, qcodes.py: an e4m3 value, or q - z within +-15) and multiplies them, as the
tensor cores' first operand, with the rows of x (y^T = W x^T: the codes are read from the copy stage straight
into the MMA's operand layout and converted there; as the second operand, converted in the layout they were
loaded in, they went back through shared memory), then scales the fp32 block sums per output column:

    fp8    acc += s[n, b] * (c[n, b-block] . x)
    int4   acc += s[n, b] * ((q - z)[n, b-block] . x)

so no dequantized weight is ever rounded, and each row's sums run in the same order at any row count above
one. The scales of the next step are requested before this step's sums. One row (decode) runs a GEMV: on
qgemv.cu's kernel where it is built (cuda_qgemv.py: 8-bit MMAs on the codes as stored, FP8 and INT4), else
qgemv.py's on the CUDA cores; either's sums round in another order (as bf16's GEMVs do, kernels/gemv.py).

The INT4 codes are packed for this K step (``chunk``): byte j of a chunk holds code j in its low nibble and code
j + chunk/2 in its high one, so a loaded tile splits into two halves that each meet a contiguous half of x, with
no shuffle.

A norm is not folded into quantized weights (it would change their codes): x is multiplied by the norm's
weight as it is loaded and each row's sums are scaled by its 1/rms, from the row sums the call that wrote x
left (``RowSums``), else x is normalised by a launch of its own (the GEMV: from x as it streams).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xcompile.runtime.common.gpu import ieee_dot, interpreted
from xcompile.runtime.engines.kernels import MAX_ROWS, ROW_TILE, cuda_qgemv
from xcompile.runtime.engines.kernels.common import _load_x, counters
from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig
from xcompile.runtime.engines.kernels.norm import rms_norm
from xcompile.runtime.engines.kernels.qcodes import _tile_codes
from xcompile.runtime.engines.kernels.qgemv import _columns, _qgemv_kernel
from xcompile.runtime.engines.kernels.tile_finish import RowSums, _finish, _zero_accs
from xcompile.runtime.engines.qweight import FP8, INT4, QWeight

# by kind: the tile kernel's (BLOCK_N, warps, stages, programs: K split until the grid has that many), the
# one-row GEMV's (BLOCK_N, inputs a step, warps, steps loaded ahead); the fastest for one decoder layer's
# projections on the H200 (benchmarks/qlinear_tiles.py)
TILE = {FP8: (32, 2, 5, 512), INT4: (32, 1, 3, 512)}
GEMV_TILE = {FP8: (4, 512, 2, 0), INT4: (4, 512, 2, 1)}


@dataclass(frozen=True)
class QLinear:
    """Codes and scales of one or more stacked linears [N, K], laid out for the kernel (module docstring)."""

    kind: str
    codes: torch.Tensor         # FP8: uint8 [N, K] (e4m3 bits); INT4: uint8 [N, K/2] packed by chunk
    scale: torch.Tensor         # fp32 [ceil(N/rows), K/cols]
    zero: torch.Tensor          # INT4: fp32 zero points like scale; FP8: scale again (unused)
    rows: int                   # output rows sharing a scale
    cols: int                   # inputs sharing a scale (a multiple of chunk)
    chunk: int                  # inputs per K step
    shape: tuple[int, int]      # [N, K]

    @staticmethod
    def pack(weights: list[QWeight], device: torch.device | str | None = None) -> QLinear:
        """Weights stacked along N (q/k/v, gate/up) in the kernel's layout, on ``device`` (default: theirs);
        ValueError where the kernels cannot take them (the caller runs those dense)."""
        first = weights[0]
        rows, cols = first.block
        k = first.shape[1]
        for w in weights:
            if w.kind != first.kind or w.block != first.block or w.shape[1] != k:
                raise ValueError(f"stacked linears differ: {w.kind} {w.block} {w.shape} after {first.kind} "
                                 f"{first.block} {first.shape}")
            if len(weights) > 1 and w.shape[0] % rows:
                raise ValueError(f"a stacked linear of {w.shape[0]} rows does not cover whole {rows}-row blocks")
        chunk = next((c for c in (128, 64, 32) if cols % c == 0 and k % c == 0), None)
        if chunk is None or k % cols:
            raise ValueError(f"quantized weight [{sum(w.shape[0] for w in weights)}, {k}] with {first.block} blocks: "
                             "the fast kernels need groups of a multiple of 32 inputs that tile K")
        weights = [w.to(device) for w in weights] if device is not None else weights
        codes = torch.cat([w.codes for w in weights])
        if first.kind == FP8:
            codes = codes.view(torch.uint8)
        else:                                           # [N, K] 0..15 -> [N, K/2]: chunk halves in the nibbles
            c = codes.reshape(codes.shape[0], k // chunk, 2, chunk // 2)
            codes = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], k // 2)
        scale = torch.cat([w.scale for w in weights])
        zero = torch.cat([w.zero for w in weights]).float() if first.kind == INT4 else scale
        n = sum(w.shape[0] for w in weights)
        return QLinear(first.kind, codes.contiguous(), scale.contiguous(), zero.contiguous(), rows, cols, chunk,
                       (n, k))

    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4 + (self.zero.numel() * 4 if self.kind == INT4 else 0)


@triton.jit
def _codes(CODES, X, rows, z, k0, CK, INT4: tl.constexpr, CHUNK: tl.constexpr, NATIVE: tl.constexpr):
    """The codes of output rows ``rows`` at inputs k0..k0+CHUNK in x's dtype (exact, qcodes.py): FP8 one
    [BLOCK_N, CHUNK] tile (returned twice); INT4 the tiles q - z of the chunk's first and second halves."""
    if INT4:
        b = tl.load(CODES + rows[:, None] * CK + (k0 // 2 + tl.arange(0, CHUNK // 2))[None, :],
                    eviction_policy="evict_first")
    else:
        b = tl.load(CODES + rows[:, None] * CK + (k0 + tl.arange(0, CHUNK))[None, :], eviction_policy="evict_first")
    return _tile_codes(b, z, X.dtype.element_ty, INT4, NATIVE)


@triton.jit
def _dot_w(w, x, acc, IEEE: tl.constexpr):
    """acc + w @ x^T [BLOCK_N, BLOCK_M] in fp32: the codes as the tensor cores' first operand, converted in the
    registers the MMA reads them from (module docstring); IEEE as linear._dot."""
    if IEEE:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _block(X, stride_xm, r, M, k0, G, lo, hi, IEEE: tl.constexpr, INT4: tl.constexpr, NORM: tl.constexpr,
           CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One row tile's fp32 sums over one K step before the scale, transposed [BLOCK_N, BLOCK_M]: c . x (INT4:
    (q - z) . x)."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if INT4:
        half: tl.constexpr = CHUNK // 2
        ks = k0 + tl.arange(0, half)
        xa = _load_x(X, stride_xm, r, M, ks, 0, True)
        xb = _load_x(X, stride_xm, r, M, ks + half, 0, True)
        if NORM:
            xa = (xa.to(tl.float32) * tl.load(G + ks).to(tl.float32)[None, :]).to(xa.dtype)
            xb = (xb.to(tl.float32) * tl.load(G + ks + half).to(tl.float32)[None, :]).to(xb.dtype)
        acc = _dot_w(hi, xb, _dot_w(lo, xa, acc, IEEE), IEEE)
    else:
        ks = k0 + tl.arange(0, CHUNK)
        x = _load_x(X, stride_xm, r, M, ks, 0, True)
        if NORM:
            x = (x.to(tl.float32) * tl.load(G + ks).to(tl.float32)[None, :]).to(x.dtype)
        acc = _dot_w(lo, x, acc, IEEE)
    return acc


@triton.jit
def _rows(X, stride_xm, r, M, k0, G, lo, hi, s, ulo, uhi, su, a, u, GATED: tl.constexpr, IEEE: tl.constexpr,
          INT4: tl.constexpr, NORM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One row tile's accumulators (a: plain or gate, u: up; [BLOCK_N, BLOCK_M]) plus one K step, scaled per
    output column."""
    a += _block(X, stride_xm, r, M, k0, G, lo, hi, IEEE, INT4, NORM, CHUNK, BLOCK_M, BLOCK_N) * s[:, None]
    if GATED:
        u += _block(X, stride_xm, r, M, k0, G, ulo, uhi, IEEE, INT4, NORM, CHUNK, BLOCK_M, BLOCK_N) * su[:, None]
    return a, u


@triton.jit
def _scales(S, Z, srow, urow, SK, k, K, COLS: tl.constexpr, GATED: tl.constexpr, INT4: tl.constexpr):
    """The scales and (INT4) zero points of the K step at input k (and of the up rows when gated; 1 past K)."""
    inside = tl.full(srow.shape, k, tl.int32) < K          # a tensor (the interpreter's masks)
    s = tl.load(S + srow * SK + k // COLS, mask=inside, other=1.0)
    z = tl.load(Z + srow * SK + k // COLS, mask=inside, other=1.0) if INT4 else s
    su, zu = s, z
    if GATED:
        su = tl.load(S + urow * SK + k // COLS, mask=inside, other=1.0)
        zu = tl.load(Z + urow * SK + k // COLS, mask=inside, other=1.0) if INT4 else su
    return s, z, su, zu


@triton.jit
def _step(X, stride_xm, M, k0, K, G, CODES, S, Z, cols, srow, urow, SK, CK, N_OUT, s, z, su, zu, a0, a1, a2, a3, u0,
          u1, u2, u3, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, GATED: tl.constexpr,
          IEEE: tl.constexpr, INT4: tl.constexpr, NORM: tl.constexpr, CHUNK: tl.constexpr, COLS: tl.constexpr,
          NATIVE: tl.constexpr):
    """One K step of every row tile (a*: plain or gate, u*: up) with its scales (s, z, su, zu); returns the
    accumulators and the next step's scales, requested here so that no step waits on its own."""
    lo, hi = _codes(CODES, X, cols, z, k0, CK, INT4, CHUNK, NATIVE)
    ulo, uhi = lo, hi
    if GATED:
        ulo, uhi = _codes(CODES, X, cols + N_OUT, zu, k0, CK, INT4, CHUNK, NATIVE)
    sn, zn, sun, zun = _scales(S, Z, srow, urow, SK, k0 + CHUNK, K, COLS, GATED, INT4)
    r = tl.arange(0, BLOCK_M)
    a0, u0 = _rows(X, stride_xm, r, M, k0, G, lo, hi, s, ulo, uhi, su, a0, u0, GATED, IEEE, INT4, NORM, CHUNK,
                   BLOCK_M, BLOCK_N)
    if TILES > 1:
        a1, u1 = _rows(X, stride_xm, r + BLOCK_M, M, k0, G, lo, hi, s, ulo, uhi, su, a1, u1, GATED, IEEE, INT4,
                       NORM, CHUNK, BLOCK_M, BLOCK_N)
    if TILES > 2:
        a2, u2 = _rows(X, stride_xm, r + 2 * BLOCK_M, M, k0, G, lo, hi, s, ulo, uhi, su, a2, u2, GATED, IEEE,
                       INT4, NORM, CHUNK, BLOCK_M, BLOCK_N)
    if TILES > 3:
        a3, u3 = _rows(X, stride_xm, r + 3 * BLOCK_M, M, k0, G, lo, hi, s, ulo, uhi, su, a3, u3, GATED, IEEE,
                       INT4, NORM, CHUNK, BLOCK_M, BLOCK_N)
    return a0, a1, a2, a3, u0, u1, u2, u3, sn, zn, sun, zun


@triton.jit
def _transposed(a0, a1, a2, a3, u0, u1, u2, u3):
    """The accumulators [BLOCK_N, BLOCK_M] as the epilogues take them, [BLOCK_M, BLOCK_N] (the unused ones too:
    they are zeros, and every accumulator must keep one shape)."""
    return (tl.trans(a0), tl.trans(a1), tl.trans(a2), tl.trans(a3), tl.trans(u0), tl.trans(u1), tl.trans(u2),
            tl.trans(u3))


@triton.jit
def _qlinear_kernel(X, CODES, S, Z, G, Y, R, Y2, WS, CNT, SQ, SQO, M, N_OUT, K, K_SPLIT, SK, CK, stride_xm,
                    stride_ym, stride_rm, stride_y2m, eps, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                    EXTRA: tl.constexpr, IEEE: tl.constexpr, INT4: tl.constexpr, NORM: tl.constexpr,
                    TILES: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                    NSUM: tl.constexpr, NSUM_P2: tl.constexpr, SUMS: tl.constexpr, NATIVE: tl.constexpr):
    # one program: BLOCK_N output columns for all M rows (TILES tiles of BLOCK_M rows, unrolled), over the
    # K_SPLIT inputs from program_id(1) * K_SPLIT (all of K unless split: tile_finish._finish)
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(1) * K_SPLIT
    cols, wcols, srow, urow = _columns(pid_n, N_OUT, BLOCK_N, ROWS)
    if PDL:     # weights never depend on the previous kernel, but x does: its first read waits
        tl.extra.cuda.gdc_wait()
    a0, a1, a2, a3, u0, u1, u2, u3 = _zero_accs(BLOCK_N, BLOCK_M)      # transposed: [columns, rows]
    s, z, su, zu = _scales(S, Z, srow, urow, SK, k_begin, K, COLS, GATED, INT4)
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), CHUNK):
        a0, a1, a2, a3, u0, u1, u2, u3, s, z, su, zu = _step(
            X, stride_xm, M, k0, K, G, CODES, S, Z, wcols, srow, urow, SK, CK, N_OUT, s, z, su, zu, a0, a1, a2, a3,
            u0, u1, u2, u3, BLOCK_M, BLOCK_N, TILES, GATED, IEEE, INT4, NORM, CHUNK, COLS, NATIVE)
    if PDL:     # the next kernel launches once the weights are read: earlier, its waiting programs slowed this one
        tl.extra.cuda.gdc_launch_dependents()
    a0, a1, a2, a3, u0, u1, u2, u3 = _transposed(a0, a1, a2, a3, u0, u1, u2, u3)
    _finish(a0, a1, a2, a3, u0, u1, u2, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, WS, CNT, SQ, SQO, pid_n,
            tl.program_id(1), tl.arange(0, BLOCK_M), cols, M, N_OUT, K, eps, GATED, RESIDUAL, EXTRA, SUMS, NSUM,
            NSUM_P2, SPLIT, BLOCK_M, BLOCK_N, TILES)


def qlinear(x: torch.Tensor, w: QLinear, *, norm: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
            residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
            extra_out: torch.Tensor | None = None, sums: RowSums | None = None, sums_out: RowSums | None = None,
            rows: torch.Tensor | None = None, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """linear() (its docstring) with a quantized W; ``norm`` is the norm's own weight (never folded)."""
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    if rows is not None:
        x, norm = (rms_norm(x, norm, eps, rows=rows.contiguous(), cfg=cfg) if norm is not None
                   else x.index_select(0, rows)), None
    m, k = x.shape
    assert 1 <= m <= MAX_ROWS and w.shape[1] == k and x.stride(1) == 1, (x.shape, w.shape)
    assert not gated or n_out % w.rows == 0, "gated: the up rows start on a scale row"
    if out is None:
        out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    assert sums is None or sums is not sums_out, "one RowSums to read and to write"
    if sums_out is not None:
        sums_out.reset()
    dummy = out
    common = (x, w.codes, w.scale, w.zero, norm if norm is not None else dummy, out,
              residual if residual is not None else dummy, extra_out if extra_out is not None else dummy)
    flags = dict(GATED=gated, RESIDUAL=residual is not None, EXTRA=extra_out is not None, INT4=w.kind == INT4,
                 PDL=cfg.pdl_on, CHUNK=w.chunk, ROWS=w.rows, COLS=w.cols, NATIVE=not interpreted())
    if m == 1 and not cfg.row_invariant:
        # a GEMV (qgemv.cu where it runs, else qgemv.py): its 1/rms from x as x streams, so it neither reads nor
        # leaves row sums
        if cuda_qgemv.qgemv(x, w, out, norm=norm, eps=eps, gated=gated, residual=residual, extra_out=extra_out,
                            cfg=cfg) is not None:
            return out
        block_n, step, warps, ahead = GEMV_TILE[w.kind]
        least = w.chunk if w.kind == INT4 else 16         # a step: whole INT4 chunks
        step = max(step, least)
        while k % step and step > least:
            step //= 2
        _qgemv_kernel[(triton.cdiv(n_out, block_n),)](
            *common, n_out, k, w.scale.shape[1], w.codes.shape[1], eps, NORM=norm is not None, BLOCK_N=block_n,
            STEP=step, AHEAD=ahead, **flags, num_warps=warps, num_stages=1, **cfg.launch())
        return out
    from_sums = norm is not None and sums is not None and sums.source == RowSums.key(x)
    if norm is not None and not from_sums:
        x, norm = rms_norm(x, norm, eps, cfg=cfg), None
        common = (x, *common[1:4], dummy, *common[5:])
    nsum = sums.blocks if from_sums else 0
    block_n, warps, stages, programs = TILE[w.kind]
    blocks, tiles_m = triton.cdiv(n_out, block_n), triton.cdiv(m, ROW_TILE)
    chunks = k // w.chunk               # K split into whole chunks until the grid has ``programs`` programs
    per = triton.cdiv(chunks, min(chunks, max(1, triton.cdiv(programs, blocks))))
    split = triton.cdiv(chunks, per)
    ws = torch.empty(split, 2, tiles_m * ROW_TILE, n_out, dtype=torch.float32, device=x.device) if split > 1 \
        else dummy
    cnt = counters(x.device, blocks) if split > 1 else dummy
    assert sums_out is None or blocks <= sums_out.buf.shape[0], (blocks, sums_out.buf.shape)
    _qlinear_kernel[(blocks, split)](
        *common, ws, cnt, sums.buf if from_sums else dummy, sums_out.buf if sums_out is not None else dummy, m,
        n_out, k, per * w.chunk, w.scale.shape[1], w.codes.shape[1], x.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, extra_out.stride(0) if extra_out is not None else 0, eps,
        NORM=norm is not None, NSUM=nsum, NSUM_P2=triton.next_power_of_2(max(nsum, 1)), SUMS=sums_out is not None,
        IEEE=ieee_dot(x.dtype), TILES=tiles_m, SPLIT=split, BLOCK_M=ROW_TILE, BLOCK_N=block_n, **flags,
        num_warps=warps, num_stages=stages, **cfg.launch())
    if sums_out is not None:
        sums_out.left_by(out, blocks)
    return out


def qlinear_reference(x: torch.Tensor, w: list[QWeight], **kwargs) -> torch.Tensor:
    """What ``qlinear`` computes, through linear_reference on the dequantized (fp32) weights stacked."""
    from xcompile.runtime.engines.kernels.linear import linear_reference

    dense = torch.cat([q.dequantize() for q in w]).to(x.device)
    return linear_reference(x.float(), dense, **{k: (v.float() if torch.is_tensor(v) else v)
                                                   for k, v in kwargs.items()}).to(x.dtype)
