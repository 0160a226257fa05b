"""Time the quantized projections (runtime/engines/kernels/qlinear.py) at the Qwen3-8B shapes, per candidate tile.

    python benchmarks/qlinear_tiles.py [--kinds fp8,int4] [--rows 1,7] [--cuda]

For each kind (FP8 in 128 x 128 blocks, INT4 in groups of 128, as the published Qwen3-8B checkpoints store
them) and each decoder projection, called as the fast engines call it (qkv and gate/up with the norm's weight
and the 1/rms from row sums, o and down adding into their output), every candidate tile is
checked against qlinear_reference, then timed: the median µs of one call inside a CUDA graph of calls over
rotating weight copies (L2 never holds the weights), with GB/s of the bytes the call reads. The last lines are
each kind's best tile by the time of one decoder layer at each row count, which is what ``qlinear.GEMV_TILE`` (one
row) and ``qlinear.TILE`` (several) ship. With --cuda, one row times qgemv.cu's launches instead
(``cuda_qgemv.TILE``), beside the shipped Triton GEMV ("triton").
"""

from __future__ import annotations

import argparse
import itertools

import torch

from xcompile.runtime.engines.kernels import cuda_gemv
from xcompile.runtime.engines.kernels import cuda_qgemv as C
from xcompile.runtime.engines.kernels import qlinear as Q
from xcompile.runtime.engines.kernels.config import KernelConfig
from xcompile.runtime.engines.kernels.tile_finish import RowSums
from xcompile.runtime.engines.qweight import FP8, INT4, quantize

DEV, DT = torch.device("cuda"), torch.bfloat16
BLOCKS = {FP8: (128, 128), INT4: (1, 128)}
# (name, N, K, parts stacked, gated, norm from sums, residual)
CALLS = [("qkv", 6144, 4096, 1, False, True, False), ("o", 4096, 4096, 1, False, False, True),
         ("gate_up", 12288, 4096, 2, True, True, False), ("down", 4096, 12288, 1, False, False, True)]
# the GEMV's (BLOCK_N, inputs a step, warps, steps loaded ahead) at one row (a step is one scale column of the
# blocks here), the tile kernel's (BLOCK_N, warps, stages, programs) at several: the five best (BLOCK_N, warps,
# stages) of a sweep over (16, 32, 64) x (1, 2, 4) x (3, 5) unsplit (at least 16 columns a warp: an MMA's 16
# rows of codes; fewer would convert codes twice), each unsplit and split to 512 and 1024 programs
CANDIDATES = {True: list(itertools.product((4, 8), (512, 1024), (1, 2, 4), (0, 1, 2))),
              False: [(*t, p) for t in ((16, 1, 5), (16, 1, 8), (32, 1, 3), (32, 1, 5), (32, 2, 5))
                      for p in (0, 512, 1024)]}
# qgemv.cu's (warps, bytes of a row a stage, stages), as many blocks as fit (one block an SM was slower at every
# shape, H100 2026-12-05)
CUDA = [C.QGemv(*t) for t in itertools.product((4, 8), (1024, 2048, 4096), (2, 3, 4))] + ["triton"]
COPIES, CALLS_PER_GRAPH = 4, 32


def graph_us(fn, calls: int) -> float:
    """Median µs of one ``fn(i)`` over replays of a CUDA graph of ``calls`` of them."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description="Time the quantized projections per candidate tile (module docstring).")
    ap.add_argument("--kinds", default="fp8,int4", help="fp8 and/or int4")
    ap.add_argument("--rows", default="1,7", help="row counts: 1 times the GEMV's candidates, more the tile kernel's")
    ap.add_argument("--cuda", action="store_true", help="one row: time qgemv.cu's tiles and the Triton GEMV")
    args = ap.parse_args()
    if args.cuda:
        CANDIDATES[True] = CUDA
    kinds = args.kinds.split(",")
    if any(k not in BLOCKS for k in kinds):
        raise SystemExit(f"qlinear_tiles.py: --kinds {args.kinds!r}: expected fp8 and/or int4")
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise SystemExit(f"qlinear_tiles.py: --rows {args.rows!r}: expected row counts such as 1,7") from None
    if not all(1 <= r <= 64 for r in rows_list):
        raise SystemExit(f"qlinear_tiles.py: --rows {args.rows!r}: each row count must be 1..64 (MAX_ROWS)")
    if not torch.cuda.is_available():
        raise SystemExit("qlinear_tiles.py times kernels in CUDA graphs: no CUDA device is visible here")
    if args.cuda and cuda_gemv.library(0) is None:       # else the CUDA rows would time the Triton fallback
        raise SystemExit("qlinear_tiles.py --cuda: qgemv.cu is not built here (nvcc and an sm_90+ GPU; the log says why)")
    shipped = {1: {kind: (C.TILE.get(kind) if args.cuda else Q.GEMV_TILE[kind]) for kind in kinds}, 0: dict(Q.TILE)}
    for kind in kinds:
        layer = {r: {c: 0.0 for c in CANDIDATES[r == 1]} for r in rows_list}
        for name, n, k, parts, gated, norm, residual in CALLS:
            qws = [quantize(torch.randn(n, k, device=DEV) * k ** -0.5, kind, BLOCKS[kind]) for _ in range(parts)]
            copies = [Q.QLinear.pack(qws) for _ in range(COPIES)]
            g = torch.randn(k, device=DEV).to(DT) + 1 if norm else None
            for rows in rows_list:
                x = torch.randn(rows, k, device=DEV).to(DT)
                sums = RowSums(k, DT, DEV)
                if norm:                                    # the row sums a previous call would have left
                    sums.buf[0, :rows] = x.float().pow(2).sum(1)
                    sums.left_by(x, 1)
                res = torch.randn(rows, n, device=DEV).to(DT)
                out = torch.empty(rows, n, device=DEV, dtype=DT)
                kw = dict(norm=g, sums=sums if norm else None, gated=gated)
                want = Q.qlinear_reference(x, qws, norm=g, gated=gated)
                table = (C.TILE if args.cuda else Q.GEMV_TILE) if rows == 1 else Q.TILE
                for c in CANDIDATES[rows == 1]:
                    kw["cfg"] = KernelConfig(cuda_gemv=args.cuda and c != "triton")
                    if args.cuda and rows == 1 and c != "triton" and C.fit(copies[0], c, gated) is None:
                        layer[rows][c] = float("inf")           # a tile this shape cannot take
                        continue
                    if c != "triton":
                        table[kind] = c
                    got = Q.qlinear(x, copies[0], **kw)
                    if C.REFUSED:
                        raise SystemExit(f"{kind} {name}: qgemv.cu refused {C.REFUSED}")
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    if err > 2e-2:
                        raise SystemExit(f"{kind} {name} rows {rows} tile {c}: relative error {err:.3g}")
                    us = graph_us(lambda i: Q.qlinear(x, copies[i % COPIES], residual=res if residual else None,
                                                      out=out, **kw), CALLS_PER_GRAPH)
                    layer[rows][c] += us
                    print(f"{kind:5} {name:8} rows {rows:2} tile {c}: {us:7.1f} us "
                          f"{copies[0].nbytes() / us / 1e3:6.0f} GB/s", flush=True)
        for rows in rows_list:
            best = min(layer[rows], key=layer[rows].get)
            ship = shipped[rows == 1][kind]
            was = f"{layer[rows][ship]:.1f} us" if ship in layer[rows] else "not a candidate"
            if ship is None:
                was = f"the Triton GEMV, {layer[rows]['triton']:.1f} us"
            print(f"BEST {kind} rows {rows}: tile {best}, one layer's projections {layer[rows][best]:.1f} us "
                  f"(shipped {ship}: {was})")


if __name__ == "__main__":
    main()
