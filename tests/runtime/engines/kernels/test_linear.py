"""The tile kernel (runtime/engines/kernels/linear.py) against its plain-torch reference.

On the CPU it runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when no GPU is visible)
at small shapes that still cover partial tiles, several row tiles and split K; tests marked ``gpu`` run the
compiled kernel at the Qwen3-8B shapes. Tolerances: fp32 agrees to float rounding (1e-5 relative); bf16 to a
few roundings (2e-2 relative, the 1e-3..1e-2 band of bf16 operands plus reduction-order flips of single
roundings).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from kernel_checks import DEV, DTYPES, TOL, randn, rel, with_tiles  # noqa: E402

from xcompile.runtime.common.errors import EngineError  # noqa: E402
from xcompile.runtime.engines.kernels import common as C  # noqa: E402
from xcompile.runtime.engines.kernels import linear as L  # noqa: E402
from xcompile.runtime.engines.kernels.attention import attention  # noqa: E402
from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig, Tiles  # noqa: E402
from xcompile.runtime.engines.kernels.linear import linear, linear_reference  # noqa: E402
from xcompile.runtime.engines.kernels.norm import embedding_rows, rms_norm  # noqa: E402
from xcompile.runtime.engines.kernels.tile_finish import RowSums  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64])
@pytest.mark.parametrize("kind", ["plain", "norm+residual", "gated", "ragged K"])
def test_linear_matches_reference(kind, rows, dtype):
    torch.manual_seed(rows)
    n, k = (80, 200) if kind == "ragged K" else (96, 256)
    gated = kind == "gated"
    w = randn(2 * n if gated else n, k, dtype=dtype, scale=k ** -0.5)
    x = randn(rows, k, dtype=dtype)
    norm = randn(k, dtype=dtype) + 1 if kind in ("norm+residual", "gated") else None
    residual = randn(rows, n, dtype=dtype) if kind == "norm+residual" else None
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=DEV)          # every element must be written
    linear(x, w, norm=norm, gated=gated, residual=residual, out=out)
    ref = linear_reference(x, w, norm=norm, gated=gated, residual=residual)
    assert not out.isnan().any()
    assert rel(out, ref) < TOL[dtype]


def test_linear_residual_in_place_and_extra_out():
    x, w = randn(3, 64, dtype=torch.float32), randn(32, 64, dtype=torch.float32)
    y = randn(3, 32, dtype=torch.float32)
    want = y + x @ w.T
    taps = torch.zeros(3, 96, device=DEV)
    linear(x, w, residual=y, out=y, extra_out=taps[:, 32:64])
    assert rel(y, want) < 1e-6 and torch.equal(taps[:, 32:64], y) and not taps[:, :32].any()


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("gated", [False, True])
def test_linear_split_k_matches_reference(split, gated):
    """Split K: partial sums of each split, added in split order by the column block's last program; a
    second call reuses the arrival counters (each launch resets them)."""

    n, k, rows = 48, 512, 21
    cfg = with_tiles(tile={(n, k): (16, 64, 4, 2, split)})
    w, g = randn(2 * n if gated else n, k, dtype=torch.float32, scale=k ** -0.5), randn(k, dtype=torch.float32) + 1
    x, r = randn(rows, k, dtype=torch.float32), randn(rows, n, dtype=torch.float32)
    for _ in range(2):
        got = linear(x, w, norm=g, gated=gated, residual=None if gated else r, cfg=cfg)
        want = linear_reference(x, w, norm=g, gated=gated, residual=None if gated else r)
        assert rel(got, want) < 1e-5
    assert torch.equal(linear(x[:1], w, norm=g, gated=gated, residual=None if gated else r[:1], cfg=cfg)[0], got[0])
    assert not C.counters(x.device, 1).any()


def test_tile_for_falls_back_and_clamps():
    """BLOCK_K is capped at K's power of two; a split that does not cover whole K blocks means no split; a shape
    the table lacks takes DEFAULT_TILE."""
    tiles = Tiles(tile={(8, 96): (16, 512, 4, 3, 2), (8, 192): (16, 64, 4, 3, 4), (8, 200): (16, 64, 4, 3, 3)})
    assert L.tile_for(8, 96, tiles) == L.Tile(16, 128, 4, 3, 1)
    assert L.tile_for(8, 192, tiles) == L.Tile(16, 64, 4, 3, 1)
    assert L.tile_for(8, 200, tiles) == L.Tile(16, 64, 4, 3, 1)
    assert L.tile_for(3, 100, tiles) == L.DEFAULT_TILE._replace(block_k=128)
    tiles = tiles.replace(one_row={(8, 192): (32, 32, 8, 4, 4)})                # a one-row tile of its own
    assert L.tile_for(8, 192, tiles, one_row=True) == L.Tile(32, 32, 8, 4, 1)     # unsplit, as the tile
    assert L.tile_for(8, 192, tiles) == L.Tile(16, 64, 4, 3, 1)


GPU_ONLY = pytest.mark.skipif(DEV != "cuda", reason="in the interpreter tl.dot is numpy's sgemm, whose sums at another "
                              "block width are the BLAS kernel's choice, not the Triton kernel's")


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("blocks", [pytest.param("same", id="warps-stages"),
                                    pytest.param("other", id="block-sizes", marks=GPU_ONLY)])
def test_one_row_tile_keeps_a_blocks_bits(gated, blocks):
    """A one_row tile gives one row under row_invariant the bits it has as a block's first row on the shape's
    tile, its row sums included: with other warps and stages anywhere; with another BLOCK_K (and BLOCK_N, where
    the call leaves no row sums) on the GPU, as benchmarks/kernels.py --one-row checks for each tile it ships."""
    n, k = 48, 512
    block_n, block_k = (32 if gated else 16, 128) if blocks == "other" else (16, 64)
    cfg = KernelConfig(row_invariant=True, tiles=Tiles(tile={(n, k): (16, 64, 4, 2, 2)},
                                                       one_row={(n, k): (block_n, block_k, 8, 3, 2)}))
    w, g = randn(2 * n if gated else n, k, dtype=torch.float32, scale=k ** -0.5), randn(k, dtype=torch.float32) + 1
    x, r = randn(5, k, dtype=torch.float32), randn(5, n, dtype=torch.float32)
    sums = [RowSums(n, torch.float32, DEV) for _ in range(2)]
    res = {}
    for m, s in zip((5, 1), sums):
        res[m] = linear(x[:m], w, norm=g, gated=gated, residual=None if gated else r[:m].clone(),
                        sums_out=None if gated else s, cfg=cfg)
    assert rel(res[1], linear_reference(x[:1], w, norm=g, gated=gated, residual=None if gated else r[:1])) < 1e-5
    assert torch.equal(res[1][0], res[5][0])
    assert torch.equal(sums[0].buf[:, 0], sums[1].buf[:, 0])


def test_a_one_row_tile_must_keep_the_split():
    with pytest.raises(EngineError, match=r"one_row \(48, 512\): its K split must be the tile entry's"):
        Tiles(tile={(48, 512): (16, 64, 4, 2, 2)}, one_row={(48, 512): (16, 64, 4, 2, 4)})
    with pytest.raises(EngineError, match="split"):
        Tiles(one_row={(48, 512): (16, 64, 4, 2, 1)})                          # no tile entry to keep it with
    Tiles(tile={(48, 96): (16, 64, 4, 2, 2)}, one_row={(48, 96): (16, 32, 4, 2, 1)})  # 64 x 2 runs unsplit at K 96


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_row_count(dtype):
    """A row's output is the same bits alone and inside a block (speculative == plain greedy) on the tile
    kernel, with its RMSNorm in a launch of its own."""
    torch.manual_seed(0)
    w, g = randn(96, 256, dtype=dtype, scale=1 / 16), randn(256, dtype=dtype) + 1
    x = randn(40, 256, dtype=dtype)
    full = linear(x, w, norm=g)
    for m in (1, 7, 17):
        assert torch.equal(linear(x[:m], w, norm=g), full[:m])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [L.Tile(32, 64, 4, 3), L.Tile(32, 64, 4, 2, 2), L.Tile(16, 128, 4, 3)])
def test_tma_weight_tiles_give_the_bits_of_loads(tile, dtype, monkeypatch):
    """The tile kernel's weight tiles by tensor descriptor (sm_90 and the interpreter) against the loads through the
    registers: the same bits for a column count and a K that the tiles do not divide (the descriptor reads
    zeros past the weight, the loads mask), K split, gated (the last gate block reading into the up rows),
    a residual, a norm, and 1 to 17 rows."""
    torch.manual_seed(14)
    n, k = 72, 320
    for gated in (False, True):
        w = randn(2 * n if gated else n, k, dtype=dtype, scale=k ** -0.5)
        g, r = randn(k, dtype=dtype) + 1, randn(17, n, dtype=dtype)
        x = 3 * randn(17, k, dtype=dtype)
        cfg = with_tiles(tile={(n, k): tile})
        got = {}
        assert L.use_tma(w)
        for tma in (False, True):
            monkeypatch.setattr(L, "use_tma", lambda w, tma=tma: tma)
            got[tma] = [linear(x[:m], w, norm=g, gated=gated, residual=None if gated else r[:m], cfg=cfg)
                        for m in (1, 5, 17)]
        assert all(torch.equal(a, b) for a, b in zip(got[False], got[True])), (tile, gated)
        ref = linear_reference(x, w, norm=g, gated=gated, residual=None if gated else r)
        assert rel(got[True][2], ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
def test_the_norm_launch_matches_reference(gated, dtype):
    """Calls of several rows on the tile kernel normalise x in a launch of their own: the norm kernel against
    F.rms_norm, each projection against the reference (rows from a strided x), and a row the same bits at
    every row count above one."""
    torch.manual_seed(6)
    n, k = 48, 320
    w, g = randn(2 * n if gated else n, k, dtype=dtype, scale=k ** -0.5), randn(k, dtype=dtype) + 1
    xs = 3 * randn(40, 2 * k, dtype=dtype)
    assert rel(rms_norm(xs[:, :k], g, 1e-6), F.rms_norm(xs[:, :k], (k,), g, 1e-6)) < TOL[dtype]
    full = linear(xs[:, :k], w, norm=g, gated=gated)
    assert rel(full, linear_reference(xs[:, :k], w, norm=g, gated=gated)) < TOL[dtype]
    for m in (2, 7, 17):
        assert torch.equal(linear(xs[:m, :k], w, norm=g, gated=gated), full[:m])


@pytest.mark.parametrize("gated", [False, True])
def test_linear_of_logit_rows_gives_the_bits_of_the_gathered_rows(gated):
    """linear(x, w, rows=...) multiplies x[rows] only: with a norm the norm launch gathers them, else
    index_select; the same bits as calling it on the gathered rows. One row of x and rows [0]: no gather at
    all. A shape whose one row runs on a GEMV takes its norm as the GEMV's prologue."""
    torch.manual_seed(12)
    n, k = 48, 256
    w, g = randn(2 * n if gated else n, k, dtype=torch.float32, scale=k ** -0.5), randn(k, dtype=torch.float32) + 1
    x = randn(7, k, dtype=torch.float32)
    for norm in (None, g):
        for rows in ([6], [0, 3, 5], [2, 2]):
            idx = torch.tensor(rows, device=DEV)
            got = linear(x, w, norm=norm, gated=gated, rows=idx)
            assert torch.equal(got, linear(x.index_select(0, idx), w, norm=norm, gated=gated))
        assert torch.equal(linear(x[:1], w, norm=norm, gated=gated, rows=torch.zeros(1, dtype=torch.int64, device=DEV)),
                           linear(x[:1], w, norm=norm, gated=gated))
    cfg = with_tiles(gemv={(n, k): (4, 128, 4)})
    idx = torch.tensor([3], device=DEV)
    assert torch.equal(linear(x, w, norm=g, gated=gated, rows=idx, cfg=cfg),
                       linear(x[3:4], w, norm=g, gated=gated, cfg=cfg))


def fold(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """w [N, K] with the RMSNorm weight g folded in (W * g per column, rounded once), as fast.py packs it."""
    return w * g[None, :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2])
def test_norm_sums_match_reference_and_the_row_count(split, dtype):
    """Row sums: a residual projection (one K split or two) leaves its result's row sums of squares, and the
    gated and plain projections after it (their norm weight folded into W, the norm given as the sums' unit)
    scale by the 1/rms from them: each the reference's result with the unfolded weights, the sums those of
    the stored result, and a row the same bits at every row count (1 is a GEMV's; from 2)."""
    torch.manual_seed(7 + split)
    h, k, n = 160, 128, 48
    cfg = with_tiles(tile={(h, k): L.Tile(32, 64, 4, 2, split)})
    wo, a = randn(h, k, dtype=dtype, scale=k ** -0.5), randn(40, k, dtype=dtype)
    x0, g = 3 * randn(40, h, dtype=dtype), randn(h, dtype=dtype) + 1
    readers = [(randn(2 * n, h, dtype=dtype, scale=h ** -0.5), True), (randn(n, h, dtype=dtype, scale=h ** -0.5), False)]
    full = None
    for m in (40, 2, 7, 17):
        sums = RowSums(h, dtype, torch.device(DEV))
        x = x0[:m].clone()
        linear(a[:m], wo, residual=x, out=x, sums_out=sums, cfg=cfg)
        assert sums.source == RowSums.key(x) and sums.blocks == 5
        assert rel(sums.buf[:5, :m].sum(0), (x.float() ** 2).sum(1)) < 1e-6
        got = [linear(x, fold(w, g), norm=sums.unit, gated=gated, sums=sums, cfg=cfg) for w, gated in readers]
        for out, (w, gated) in zip(got, readers):
            assert rel(out, linear_reference(x, w, norm=g, gated=gated)) < TOL[dtype]
        if full is None:
            full = got
        else:
            assert all(torch.equal(o, f[:m]) for o, f in zip(got, full))


def test_row_sums_are_used_only_for_the_result_they_were_left_for():
    """A reader takes the sums only when they are its x's and its norm is their unit: after a one-row GEMV
    (which leaves none), for another tensor, with another norm weight, or after a reset it computes its norm
    as without them, in a norm launch of its own."""
    torch.manual_seed(8)
    h, n = 96, 64
    wo, wg = randn(h, h, dtype=torch.float32, scale=h ** -0.5), randn(2 * n, h, dtype=torch.float32, scale=h ** -0.5)
    cfg = with_tiles(gemv={(h, h): (4, 32, 4)})
    sums = RowSums(h, torch.float32, torch.device(DEV))
    x = randn(5, h, dtype=torch.float32)
    linear(x[:1], wo, residual=x[:1], out=x[:1], sums_out=sums, cfg=cfg)         # a GEMV: no sums
    assert sums.source is None
    linear(x, wo, residual=x, out=x, sums_out=sums, cfg=cfg)
    assert sums.source == RowSums.key(x)
    want = linear(x, wg, norm=sums.unit, gated=True, cfg=cfg)                    # no sums: the norm launch
    other = x.clone()
    assert torch.equal(linear(other, wg, norm=sums.unit, gated=True, sums=sums, cfg=cfg), want)   # not other's
    assert torch.equal(linear(x, wg, norm=sums.unit.clone(), gated=True, sums=sums, cfg=cfg), want)  # not the unit
    got = linear(x, wg, norm=sums.unit, gated=True, sums=sums, cfg=cfg)
    assert not torch.equal(got, want) and rel(got, want) < 1e-5                 # x's own: another rounding
    sums.reset()
    assert torch.equal(linear(x, wg, norm=sums.unit, gated=True, sums=sums, cfg=cfg), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_leaves_the_row_sums_the_first_qkv_reads(dtype):
    """linear.embedding: F.embedding's rows (ids of any stride) and their fp32 sums of squares, one partial a
    row; the projection after it (its norm weight folded) takes its 1/rms from them: the reference's result
    with the unfolded weight, a row the same bits at every row count from 2; without a RowSums none are
    written."""
    torch.manual_seed(11)
    v, h, n = 50, 160, 48
    embed, g = 3 * randn(v, h, dtype=dtype), randn(h, dtype=dtype) + 1
    w = randn(n, h, dtype=dtype, scale=h ** -0.5)
    ids0 = torch.randint(0, v, (40,), device=DEV)
    full = None
    for m in (40, 2, 7, 17):
        sums = RowSums(h, dtype, torch.device(DEV))
        x = L.embedding(ids0[:m], embed, sums_out=sums)
        assert torch.equal(x, F.embedding(ids0[:m], embed))
        assert sums.source == RowSums.key(x) and sums.blocks == 1
        assert rel(sums.buf[0, :m], (x.float() ** 2).sum(1)) < 1e-6
        out = linear(x, fold(w, g), norm=sums.unit, sums=sums)
        assert rel(out, linear_reference(x, w, norm=g)) < TOL[dtype]
        full = out if full is None else full
        assert torch.equal(out, full[:m])
    strided = torch.randint(0, v, (5, 3), device=DEV)[:, 1]
    assert torch.equal(embedding_rows(strided, embed), F.embedding(strided, embed))
    assert torch.equal(L.embedding(ids0[:5], embed), F.embedding(ids0[:5], embed))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_pdl_changes_no_bits_at_qwen3_8b_shapes(rows):
    """Programmatic dependent launch (KernelConfig.pdl) is scheduling only: every projection shape of an 8B
    layer, lm_head (with the final norm) and attention (the step's keys in a split's first block, its
    second, near the end of the cache) give the same bits with it on as off."""
    torch.manual_seed(rows)
    shapes = [(6144, 4096, False), (4096, 4096, False), (12288, 4096, True), (4096, 12288, False),
              (151936, 4096, False)]
    ws = [randn(2 * n if gated else n, k, dtype=torch.bfloat16, scale=k ** -0.5) for n, k, gated in shapes]
    xs = [randn(rows, k, dtype=torch.bfloat16) for _, k, _ in shapes]
    g = randn(4096, dtype=torch.bfloat16) + 1
    kc, vc = randn(1, 8, 4352, 128, dtype=torch.bfloat16), randn(1, 8, 4352, 128, dtype=torch.bfloat16)
    q = randn(rows, 32 * 128, dtype=torch.bfloat16)
    tm = torch.ones(rows, rows, dtype=torch.bool, device=DEV).tril()
    results = []
    for pdl in (False, True):
        cfg = KernelConfig(pdl=pdl)
        results.append([linear(x, w, norm=g if k == 4096 else None, gated=gated, cfg=cfg)
                        for (n, k, gated), w, x in zip(shapes, ws, xs)] +
                       [attention(q, kc, vc, torch.tensor([wi], device=DEV), tm, 32, cfg=cfg) for wi in (300, 350, 4000)])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (4096, 4096, False), (12288, 4096, True),
                                       (4096, 12288, False), (151936, 4096, False), (6144, 8192, False)])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_linear_at_qwen3_8b_shapes(n, k, gated, rows):
    """Accurate at every row count; a row alone gets the same bits as inside a block on the tile kernel.
    Shapes with a one-row CUDA-core GEMV (the tile tables' gemv) round a lone row differently (another reduction
    order, the documented price of its speed): that row is checked against the reference instead."""
    torch.manual_seed(n + rows)
    w = randn(2 * n if gated else n, k, dtype=torch.bfloat16, scale=k ** -0.5)
    x, g = randn(rows, k, dtype=torch.bfloat16), randn(k, dtype=torch.bfloat16) + 1
    out = linear(x, w, norm=g, gated=gated)
    assert rel(out, linear_reference(x, w, norm=g, gated=gated)) < 1e-2
    alone = linear(x[:1], w, norm=g, gated=gated)
    assert rel(alone, linear_reference(x[:1], w, norm=g, gated=gated)) < 1e-2
    tile_only = KernelConfig(cuda_gemv=False, tiles=Tiles(tile=DEFAULT.tiles.tile))   # the tile kernel for one row
    block = linear(x, w, norm=g, gated=gated, cfg=tile_only)
    assert torch.equal(linear(x[:1], w, norm=g, gated=gated, cfg=tile_only)[0], block[0])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (12288, 4096, True), (151936, 4096, False)])
def test_the_norm_launch_at_qwen3_8b_shapes(n, k, gated):
    """The RMSNorm in a launch of its own before the 8B projections with a norm: accurate at 7 and 33 rows,
    row 0 the same bits in both."""
    torch.manual_seed(n)
    w = randn(2 * n if gated else n, k, dtype=torch.bfloat16, scale=k ** -0.5)
    x, g = randn(33, k, dtype=torch.bfloat16), randn(k, dtype=torch.bfloat16) + 1
    outs = [linear(x[:m], w, norm=g, gated=gated) for m in (7, 33)]
    for out in outs:
        assert rel(out, linear_reference(x[:out.shape[0]], w, norm=g, gated=gated)) < 1e-2
    assert torch.equal(outs[0][0], outs[1][0])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [151936, 32000])
def test_lm_heads_of_logit_rows_at_qwen3_8b_shapes(n):
    """The lm_heads (Qwen3-8B's, the EAGLE3 head's draft vocabulary): 7 rows' logit rows [6, 2] gathered by
    the norm launch give the bits of the gathered rows, and are accurate."""
    torch.manual_seed(n)
    k = 4096
    w = randn(n, k, dtype=torch.bfloat16, scale=k ** -0.5)
    x, g = randn(7, k, dtype=torch.bfloat16), randn(k, dtype=torch.bfloat16) + 1
    idx = torch.tensor([6, 2], device=DEV)
    got = linear(x, w, norm=g, rows=idx)
    assert torch.equal(got, linear(x.index_select(0, idx), w, norm=g))
    assert rel(got, linear_reference(x.index_select(0, idx), w, norm=g)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("writer,reader", [((4096, 4096), (12288, 4096, True)), ((4096, 12288), (6144, 4096, False))])
def test_row_sums_at_qwen3_8b_shapes(writer, reader):
    """Row sums at the 8B layer's pairs (o -> gate/up, down -> the next qkv; both writers split K): the
    sums are the stored result's, the reader (its norm folded into W) matches the reference at 7 and 33
    rows, row 0 the same bits in both, and each within bf16 rounding of the unfolded call (a norm launch)."""
    torch.manual_seed(writer[1])
    (h, kw), (n, k, gated) = writer, reader
    ww, a = randn(h, kw, dtype=torch.bfloat16, scale=kw ** -0.5), randn(33, kw, dtype=torch.bfloat16)
    wr, g = randn(2 * n if gated else n, k, dtype=torch.bfloat16, scale=k ** -0.5), randn(k, dtype=torch.bfloat16) + 1
    x0, wf = 3 * randn(33, h, dtype=torch.bfloat16), fold(wr, g)
    outs = []
    for m in (7, 33):
        sums, x = RowSums(h, torch.bfloat16, torch.device(DEV)), x0[:m].clone()
        linear(a[:m], ww, residual=x, out=x, sums_out=sums)
        assert sums.source is not None
        assert rel(sums.buf[:sums.blocks, :m].sum(0), (x.float() ** 2).sum(1)) < 1e-5
        out = linear(x, wf, norm=sums.unit, gated=gated, sums=sums)
        assert rel(out, linear_reference(x, wr, norm=g, gated=gated)) < 1e-2
        assert rel(out, linear(x, wr, norm=g, gated=gated)) < 1e-2
        outs.append(out)
    assert torch.equal(outs[0][0], outs[1][0])


@pytest.mark.gpu
def test_embedding_sums_at_qwen3_8b_qkv():
    """The embedding's row sums read by the 8B qkv (its norm folded) at 7 and 32 rows: the gather exact, the
    sums those of the rows, the reader within bf16 rounding of the reference and of the unfolded call (a norm
    launch), row 0 the same bits at both row counts."""
    torch.manual_seed(12)
    embed, g = randn(1000, 4096, dtype=torch.bfloat16), randn(4096, dtype=torch.bfloat16) + 1
    w = randn(6144, 4096, dtype=torch.bfloat16, scale=4096 ** -0.5)
    ids, wf = torch.randint(0, 1000, (32,), device=DEV), fold(w, g)
    outs = []
    for m in (7, 32):
        sums = RowSums(4096, torch.bfloat16, torch.device(DEV))
        x = L.embedding(ids[:m], embed, sums_out=sums)
        assert torch.equal(x, F.embedding(ids[:m], embed))
        assert rel(sums.buf[0, :m], (x.float() ** 2).sum(1)) < 1e-5
        out = linear(x, wf, norm=sums.unit, sums=sums)
        assert rel(out, linear_reference(x, w, norm=g)) < 1e-2 and rel(out, linear(x, w, norm=g)) < 1e-2
        outs.append(out)
    assert torch.equal(outs[0][0], outs[1][0])
