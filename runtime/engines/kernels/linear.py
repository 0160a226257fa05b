"""y = epilogue(norm(x) @ W^T): every projection of a decode/verify step of up to MAX_ROWS rows.

    x [M, K] (M <= MAX_ROWS), W [N, K] row-major (K contiguous), y [M, N] (or [M, N/2] when gated)
    norm      an RMSNorm of x (fp32 statistics, one rounding, as F.rms_norm). One-row calls of the GEMV shapes
              take it as the GEMV's prologue (gemv.py, cuda_gemv.py). Calls on the tile kernel take each row's
              1/rms from the sums of squares the call that wrote x left (``RowSums``; the norm's weight folded
              into W at load, backends' job) and scale the fp32 sums by it before the epilogue, or else
              normalise x in a launch of their own (norm.rms_norm): no pass over x in every column block
              (32 tokens 5.62 -> 5.31 ms a step on the H200)
    epilogue  gated: W stacks [gate; up] (each N/2 rows): y = silu(x Wg^T) * (x Wu^T)
              residual: y = r + x W^T (r may be y itself: each program reads its tile before writing it)
              extra: also store y into a second buffer (the EAGLE3 taps)
              sums: also leave each row's sum of squares of y, one fp32 partial per column block (RowSums)

Memory-bound at these M: every weight byte is read once, by the program that owns its BLOCK_N output
columns; the rows of x ride along in tiles of 16 (tl.dot's smallest M) so one weight tile serves all of
them. On sm_90 (and in the interpreter) the weight tiles come by tensor descriptor: the copy engine's 2-D
copies into shared memory, ``num_stages`` tiles ahead, where loads would go through the registers (the
same bits; a 7-token verify 4.40 -> 4.33 ms). The first weight tile is requested before the PDL wait and
the next kernel may launch right after it (7-token verify 4.94 -> 4.84 ms). Rounding follows the reference
modules (each matmul output rounded to the model dtype before the next elementwise op), so
``linear_reference`` is what the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from xcompile.runtime.common.gpu import ieee_dot, interpreted
from xcompile.runtime.engines.kernels import MAX_ROWS, ROW_TILE, cuda_gemv
from xcompile.runtime.engines.kernels.common import _load_w, _load_x, counters
from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig, Tile, Tiles
from xcompile.runtime.engines.kernels.gemv import gemv, gemv_tile
from xcompile.runtime.engines.kernels.norm import embedding_rows, rms_norm
from xcompile.runtime.engines.kernels.tile_finish import RowSums, _finish, _zero_accs

DEFAULT_TILE = Tile(32, 512, 4, 3)   # shapes without a tuned tile


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    """acc + x @ w^T. IEEE: fp32 operands multiplied in full fp32 (not tf32), for fp32 engines and
    for the interpreter, whose tl.dot mishandles bf16 (products of bf16 values are exact in fp32)."""
    if IEEE:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _mac(X, stride_xm, M, K, ks, w, wu, a0, a1, a2, a3, u0, u1, u2, u3, BLOCK_M: tl.constexpr, GATED: tl.constexpr,
         IEEE: tl.constexpr, EVEN_K: tl.constexpr, TILES: tl.constexpr):
    """Accumulate one K step of every row tile (a*: gate or plain, u*: up) against the weight tile(s)."""
    r0 = tl.arange(0, BLOCK_M)
    x = _load_x(X, stride_xm, r0, M, ks, K, EVEN_K)
    a0 = _dot(x, w, a0, IEEE)
    if GATED:
        u0 = _dot(x, wu, u0, IEEE)
    if TILES > 1:
        x = _load_x(X, stride_xm, r0 + BLOCK_M, M, ks, K, EVEN_K)
        a1 = _dot(x, w, a1, IEEE)
        if GATED:
            u1 = _dot(x, wu, u1, IEEE)
    if TILES > 2:
        x = _load_x(X, stride_xm, r0 + 2 * BLOCK_M, M, ks, K, EVEN_K)
        a2 = _dot(x, w, a2, IEEE)
        if GATED:
            u2 = _dot(x, wu, u2, IEEE)
    if TILES > 3:
        x = _load_x(X, stride_xm, r0 + 3 * BLOCK_M, M, ks, K, EVEN_K)
        a3 = _dot(x, w, a3, IEEE)
        if GATED:
            u3 = _dot(x, wu, u3, IEEE)
    return a0, a1, a2, a3, u0, u1, u2, u3


@triton.jit
def _load_wt(w_ptr, u_ptr, n0, k0, ks, K, N_OUT, GATED: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """The weight tile(s) at output columns n0.. and K columns ks (= k0..): TMA, by the tensor descriptor
    w_ptr (rows and columns past the weight read as zeros); else _load_w."""
    if TMA:
        w = w_ptr.load([n0, k0])
        wu = w
        if GATED:
            wu = u_ptr.load([n0 + N_OUT, k0])
    else:
        w, wu = _load_w(w_ptr, u_ptr, ks, K, GATED, EVEN_K)
    return w, wu


@triton.jit
def _linear_kernel(X, W, Y, R, Y2, WS, CNT, SQ, SQO, M, N_OUT, K, K_SPLIT, stride_xm, stride_ym, stride_rm,
                   stride_y2m, eps, GATED: tl.constexpr, RESIDUAL: tl.constexpr, EXTRA: tl.constexpr,
                   IEEE: tl.constexpr, EVEN_K: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   NSUM: tl.constexpr, NSUM_P2: tl.constexpr, SUMS: tl.constexpr, TMA: tl.constexpr):
    # one program: BLOCK_N output columns for all M rows (TILES tiles of BLOCK_M rows, unrolled), over
    # the K_SPLIT columns of x starting at program_id(1) * K_SPLIT (all of K unless split).
    # NSUM > 0 (the norm's weight folded into W, x loaded as it is): the sums scaled by each row's 1/rms
    # before the epilogue, from the NSUM partial sums of squares SQ [NSUM, MAX_ROWS] that the call which wrote
    # x left. SUMS: this call leaves its own result's partials in SQO [blocks, MAX_ROWS]
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(1) * K_SPLIT
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if TMA:                                                 # W: a tensor descriptor of the [N, K] weight
        w_ptr = W
        u_ptr = W
    else:
        wrows = tl.where(cols < N_OUT, cols, 0)             # clamp instead of masking the weight loads
        w_ptr = W + wrows[:, None] * K
        u_ptr = W + (wrows[:, None] + N_OUT) * K            # gated: the up rows follow the N_OUT gate rows
    # the weights never depend on the previous kernel: fetch the first tile before waiting for it, and let
    # the next kernel launch (and fetch its own weights) once the wait is over
    ks = k_begin + tl.arange(0, BLOCK_K)
    w, wu = _load_wt(w_ptr, u_ptr, pid_n * BLOCK_N, k_begin, ks, K, N_OUT, GATED, EVEN_K, TMA)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r0 = tl.arange(0, BLOCK_M)
    a0, a1, a2, a3, u0, u1, u2, u3 = _zero_accs(BLOCK_M, BLOCK_N)
    a0, a1, a2, a3, u0, u1, u2, u3 = _mac(X, stride_xm, M, K, ks, w, wu, a0, a1, a2, a3, u0, u1, u2, u3, BLOCK_M,
                                          GATED, IEEE, EVEN_K, TILES)
    for k0 in range(k_begin + BLOCK_K, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w, wu = _load_wt(w_ptr, u_ptr, pid_n * BLOCK_N, k0, ks, K, N_OUT, GATED, EVEN_K, TMA)
        a0, a1, a2, a3, u0, u1, u2, u3 = _mac(X, stride_xm, M, K, ks, w, wu, a0, a1, a2, a3, u0, u1, u2, u3,
                                              BLOCK_M, GATED, IEEE, EVEN_K, TILES)
    _finish(a0, a1, a2, a3, u0, u1, u2, u3, Y, stride_ym, Y2, stride_y2m, R, stride_rm, WS, CNT, SQ, SQO, pid_n,
            tl.program_id(1), r0, cols, M, N_OUT, K, eps, GATED, RESIDUAL, EXTRA, SUMS, NSUM, NSUM_P2, SPLIT, BLOCK_M,
            BLOCK_N, TILES)


def tile_for(n_out: int, k: int, tiles: Tiles, one_row: bool = False) -> Tile:
    """The tile kernel's tile for this shape as it runs at this K (Tile.for_k): the table's or DEFAULT_TILE
    (one row: the one_row table's first, the same bits)."""
    tile = tiles.one_row.get((n_out, k)) if one_row else None
    return (tile or tiles.tile.get((n_out, k), DEFAULT_TILE)).for_k(k)


def embedding(ids: torch.Tensor, embed: torch.Tensor, sums_out: RowSums | None = None,
              cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """F.embedding(ids, embed) for ids [M] -> [M, H] in one launch (norm.embedding_rows); with sums_out, its
    rows' sums of squares too, one partial a row, so that a projection of several rows reading it next (the
    first qkv, its norm weight folded) takes its 1/rms from them: no norm launch."""
    if sums_out is not None:
        sums_out.reset()
    if ids.shape[0] > MAX_ROWS:                           # a wide step (wide_linear): no sums
        return F.embedding(ids, embed)
    x = embedding_rows(ids, embed, sums_out.buf if sums_out is not None else None, cfg)
    if sums_out is not None:
        sums_out.left_by(x, 1)
    return x


def linear(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 1e-6,
           gated: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           extra_out: torch.Tensor | None = None, sums: RowSums | None = None,
           sums_out: RowSums | None = None, rows: torch.Tensor | None = None,
           cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """x [M, K] -> [M, N] (module docstring). w [N, K] (gated: [2N, K], gate rows then up rows);
    norm [K]: the RMSNorm weight; residual [M, N] (may be ``out``); extra_out [M, N] (any row stride): a
    second copy of the result. Rows of x may be strided; columns contiguous.
    sums: x's row sums (RowSums) for a norm of weight ``sums.unit``, used where they are x's; sums_out:
    where this call leaves its result's (on the tile kernel). rows (int64 [R]): multiply x[rows] only (the
    lm_heads' logit rows) -> [R, N]; gathered by the norm launch where there is one (not at all for one row
    of x and one of rows, which can only be row 0)."""
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    tiles = cfg.tiles
    assert rows is None or (residual is None and out is None and extra_out is None), "rows: a new result only"
    if rows is not None and not (x.shape[0] == 1 and rows.shape == (1,)):    # else the only row: x itself
        rows = rows.contiguous()
        k = x.shape[1]
        one_row_gemv = rows.shape[0] == 1 and not cfg.row_invariant and (gemv_tile(n_out, k, tiles) is not None
                                                                          or (n_out, k) in tiles.cuda)
        if norm is not None and not one_row_gemv:
            x, norm = rms_norm(x, norm, eps, rows=rows, cfg=cfg), None     # gathered and normalised in one launch
        else:
            x = x.index_select(0, rows)
    m, k = x.shape
    if m > MAX_ROWS:
        return wide_linear(x, w, norm=norm, eps=eps, gated=gated, residual=residual, out=out, extra_out=extra_out,
                           sums_out=sums_out)
    assert 1 <= m <= MAX_ROWS and w.shape[1] == k and x.stride(1) == 1 and w.is_contiguous(), (x.shape, w.shape)
    if out is None:
        out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    assert sums is None or sums is not sums_out, "one RowSums to read and to write"
    if sums_out is not None:
        sums_out.reset()                                      # set again below if this call writes them
    if m == 1 and not cfg.row_invariant:
        cuda_tile = cuda_gemv.tile_for(x, w, n_out, k, norm, out, residual, extra_out, cfg=cfg)
        if cuda_tile is not None and cuda_gemv.gemv(x, w, out, cuda_tile, norm=norm, eps=eps, gated=gated,
                                                    residual=residual, extra_out=extra_out, cfg=cfg) is not None:
            return out
        tile = gemv_tile(n_out, k, tiles)
        if tile is not None:
            return gemv(x, w, out, tile, norm=norm, eps=eps, gated=gated, residual=residual, extra_out=extra_out,
                        cfg=cfg)
    t = tile_for(n_out, k, tiles, one_row=m == 1)
    # x's 1/rms from the sums the call that wrote x left (a norm of weight ones: the caller folded it into w),
    # else x normalised once, by a launch of its own
    from_sums = sums is not None and norm is sums.unit and sums.source == RowSums.key(x)
    if from_sums:
        norm = None
    elif norm is not None:
        x, norm = rms_norm(x, norm, eps, cfg=cfg), None
    blocks, tiles_m = triton.cdiv(n_out, t.block_n), triton.cdiv(m, ROW_TILE)
    dummy = out
    ws = torch.empty(t.split, 2, tiles_m * ROW_TILE, n_out, dtype=torch.float32, device=x.device) if t.split > 1 \
        else dummy
    cnt = counters(x.device, blocks) if t.split > 1 else dummy
    nsum = sums.blocks if from_sums else 0
    write = sums_out is not None
    if write:
        assert blocks <= sums_out.buf.shape[0], (blocks, sums_out.buf.shape)
    tma = use_tma(w)
    _linear_kernel[(blocks, t.split)](
        x, weight_descriptor(w, t.block_n, t.block_k) if tma else w, out,
        residual if residual is not None else dummy, extra_out if extra_out is not None else dummy, ws, cnt,
        sums.buf if from_sums else dummy, sums_out.buf if write else dummy, m, n_out, k, k // t.split,
        x.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0,
        extra_out.stride(0) if extra_out is not None else 0, eps, GATED=gated, RESIDUAL=residual is not None,
        EXTRA=extra_out is not None, IEEE=ieee_dot(x.dtype), EVEN_K=k % t.block_k == 0, TILES=tiles_m,
        PDL=cfg.pdl_on, SPLIT=t.split, BLOCK_M=ROW_TILE, BLOCK_N=t.block_n, BLOCK_K=t.block_k, NSUM=nsum,
        NSUM_P2=triton.next_power_of_2(max(nsum, 1)), SUMS=write, TMA=tma, num_warps=t.warps, num_stages=t.stages,
        **cfg.launch())
    if write:
        sums_out.left_by(out, blocks)
    return out


def wide_linear(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 1e-6,
                gated: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                extra_out: torch.Tensor | None = None, sums_out: RowSums | None = None) -> torch.Tensor:
    """``linear`` past MAX_ROWS rows (a batch step that carries prompt chunks, B sequences x S tokens): the norm
    by F.rms_norm, the product by cuBLAS, the epilogue in torch ops. It leaves no row sums, so the call that reads
    its result normalises x itself (its norm weight given, ones where folded)."""
    if sums_out is not None:
        sums_out.reset()
    if norm is not None:
        x = F.rms_norm(x, (x.shape[1],), norm, eps)
    y = F.linear(x, w)
    if gated:
        gate, up = y.chunk(2, dim=1)
        y = F.silu(gate).mul_(up)
    if residual is not None:
        y = torch.add(residual, y, out=y)
    if out is None:
        out = y
    else:
        out.copy_(y)
    if extra_out is not None:
        extra_out.copy_(out)
    return out


def use_tma(w: torch.Tensor) -> bool:
    """Whether the tile kernel loads w's tiles by tensor descriptor: the copy engine's 2-D copies need sm_90
    (or the interpreter) and a 16-byte aligned weight."""
    if (w.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.data_ptr() % 16
            or (w.shape[1] * w.element_size()) % 16):
        return False
    return interpreted() or (w.is_cuda and torch.cuda.get_device_capability(w.device)[0] >= 9)


def weight_descriptor(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The tensor descriptor of weight w [N, K] in [block_n, block_k] tiles (made per launch: a graph keeps
    the one it captured)."""
    return TensorDescriptor.from_tensor(w, [block_n, block_k])


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
