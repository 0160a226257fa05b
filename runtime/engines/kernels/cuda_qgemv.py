"""One-row quantized projections on qgemv.cu's kernel (built with gemv.cu into one library, cuda_gemv.py): the
codes multiplied as stored by 8-bit tensor-core MMAs against x cut into two 8-bit terms, the rows streamed
into shared memory by the copy engine (qgemv.cu's header). Where it runs (sm_90+, nvcc found, bf16, a layout it
takes) qlinear() sends its one-row calls here; elsewhere they stay on the Triton GEMV (qgemv.py), which is
also what CI's interpreter checks. Its tests are marked ``gpu``.
"""

from __future__ import annotations

import torch

from xcompile.runtime.common.logs import logger
from xcompile.runtime.engines.kernels import cuda_gemv
from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig, QGemv
from xcompile.runtime.engines.qweight import FP8, INT4

log = logger(__name__)
SPAN, PAD = 64, 64      # qgemv.cu: bytes of a row a warp covers at once; the padding of a row in shared memory


# by kind, the launch of shapes the tile tables leave out (KernelConfig.tiles.qgemv_fp8 / qgemv_int4): the
# fastest for one decoder layer's projections at the Qwen3-8B shapes (benchmarks/qlinear_tiles.py --cuda, one
# H100, 2026-12-05): FP8 81.3 us against the Triton GEMV's 83.6, INT4 64.6 against 77.3
TILE = {FP8: QGemv(8, 2048, 2), INT4: QGemv(8, 2048, 2)}
TABLE = {FP8: "qgemv_fp8", INT4: "qgemv_int4"}      # by kind, its table of the tile tables (KernelConfig.tiles)


def tile_for(kind: str, n_out: int, k: int, cfg: KernelConfig = DEFAULT) -> QGemv | None:
    """The launch of a ``kind`` call of (n_out, k): its tile tables' entry, else the kind's TILE."""
    table = getattr(cfg.tiles, TABLE[kind]) if kind in TABLE else {}
    return table.get((n_out, k)) or TILE.get(kind)


def smem_bytes(tile: QGemv, gated: bool, k: int) -> int:
    """Shared memory of a launch (xc_qgemv): the stages, x's two 8-bit terms with a scale and a sum per 64 bytes
    of codes, two mbarriers a stage (full, empty), the consumer warps' sums, a float a warp for the RMSNorm."""
    rows = 32 if gated else 16
    return (tile.stages * rows * (tile.ks + PAD) + k * 2 + k // 8 + tile.stages * 16
            + (tile.stages * tile.warps * rows + tile.warps + 1) * 4)


def fit(w, tile: QGemv, gated: bool, smem_limit: int = cuda_gemv.SMEM_LIMIT) -> QGemv | None:
    """``tile`` for QLinear ``w``, its ``ks`` halved until it divides a row's bytes of codes and each warp's
    share is whole spans and whole scale blocks; None where qgemv.cu cannot take ``w`` (K not a multiple of
    128, INT4 chunks other than 128 or groups not a multiple of 128, FP8 blocks not a multiple of 64 inputs)
    or the tile cannot fit it."""
    k = w.shape[1]
    if k % 128 or (w.kind == INT4 and (w.chunk != 128 or w.cols % 128)) or (w.kind == FP8 and w.cols % SPAN):
        return None
    if not (1 <= tile.warps <= 16 and 2 <= tile.stages <= 8 and tile.grid >= 0):
        return None
    period = w.cols // 2 if w.kind == INT4 else w.cols          # bytes of codes under one scale
    ck, ks = w.codes.shape[1], tile.ks
    while ks >= SPAN * tile.warps and (ck % ks or ks % (SPAN * tile.warps) or (ks // tile.warps) % period):
        ks //= 2
    tile = tile._replace(ks=ks)
    if ks < SPAN * tile.warps or smem_bytes(tile, gated, k) > smem_limit:
        return None
    return tile


REFUSED: set[tuple] = set()         # (kind, shape, tile) whose launch the device refused


def qgemv(x: torch.Tensor, w, out: torch.Tensor, *, norm: torch.Tensor | None, eps: float, gated: bool,
          residual: torch.Tensor | None, extra_out: torch.Tensor | None, tile: QGemv | None = None,
          cfg: KernelConfig = DEFAULT) -> torch.Tensor | None:
    """qlinear() of one row (its docstring) on qgemv.cu: x [1, K] -> out [1, N]; None where the kernel does not
    run here (``cfg.cuda_gemv`` off, not CUDA or interpreted, not bf16, a kind with no launch (``tile_for``)
    and no ``tile`` given, a layout or tile it cannot take, operands not dense rows of w's shape, no
    library, a pointer not 16-byte aligned, the launch refused: warned once, and that shape stays on Triton)."""
    if not cuda_gemv.runnable(x, cfg, bf16=(x, out, norm, residual, extra_out), aligned=(x, w.codes, norm)):
        return None
    n_out, k = (w.shape[0] // 2 if gated else w.shape[0]), x.shape[1]
    tile = tile or tile_for(w.kind, n_out, k, cfg)
    if tile is None:
        return None
    index = x.device.index or 0
    tile = fit(w, tile, gated, cuda_gemv.smem_limit(index))
    key = (w.kind, w.shape, tile)
    if tile is None or key in REFUSED:
        return None
    # the kernel indexes x, out, the residual and the second output as dense rows of w's output columns
    if (x.shape != (1, w.shape[1]) or out.shape != (1, n_out) or (gated and n_out % w.rows)
            or any(t is not None and t.stride(-1) != 1 for t in (x, out, residual, extra_out))):
        return None
    lib = cuda_gemv.library(index)
    if lib is None:
        return None
    ptrs = [t.data_ptr() if t is not None else None for t in (x, w.codes, w.scale, w.zero, out, residual, norm,
                                                              extra_out)]
    flags = (w.kind == INT4, *tile, norm is not None, gated, residual is not None, extra_out is not None, True,
             cfg.pdl_on, torch.cuda.current_stream(x.device).cuda_stream)
    with torch.cuda.device(x.device):
        err = lib.xc_qgemv(*ptrs, n_out, k, w.codes.shape[1], w.scale.shape[1], w.rows, w.cols, eps, *flags)
    if err:
        reason = "no kernel for these flags" if err == -1 else f"cudaError_t {err}"
        log.warning("CUDA quantized GEMV launch for %s %s with tile %s refused (%s); that shape stays on the "
                    "Triton GEMV", w.kind, w.shape, tuple(tile), reason)
        REFUSED.add(key)
        return None
    return out
