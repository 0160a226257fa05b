"""qgemv.cu's one-row quantized projections (runtime/engines/kernels/cuda_qgemv.py): which weights and tiles it
takes (any machine), and, marked ``gpu``, its results against the dequantized reference, every code read
exactly, in a CUDA graph, and qlinear() sending one-row calls to it."""

from __future__ import annotations

import json

import pytest
import torch
from kernel_checks import DEV, TOL, randn, rel

from xcompile.runtime.engines.kernels import cuda_gemv
from xcompile.runtime.engines.kernels import cuda_qgemv as C
from xcompile.runtime.engines.kernels.config import KernelConfig, Tiles
from xcompile.runtime.engines.kernels.qlinear import QLinear, qlinear, qlinear_reference
from xcompile.runtime.engines.qweight import FP8, INT4, QWeight, quantize

BF16 = torch.bfloat16


def weights(n: int, k: int, kind: str, block, parts: int = 1, device=DEV):
    w = [quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * k ** -0.5, kind, block).to(device)
         for i in range(parts)]
    return w, QLinear.pack(w)


@pytest.mark.parametrize("kind, block, k, tile, want", [
    (FP8, (128, 128), 4096, (8, 2048, 4), (8, 2048, 4)),
    (FP8, (128, 128), 1536, (8, 2048, 4), None),          # 512 bytes a stage: 64 a warp, under one 128 block
    (FP8, (128, 128), 1536, (4, 2048, 4), (4, 512, 4)),   # halved to divide the row, 128 bytes a warp
    (INT4, (1, 128), 4096, (8, 2048, 3), (8, 2048, 3)),   # a row is 2048 bytes
    (INT4, (1, 128), 1024, (8, 2048, 3), (8, 512, 3)),
    (FP8, (32, 64), 1024, (2, 256, 2, 3), (2, 256, 2, 3)),
])
def test_fit_halves_the_stage_until_it_divides_the_row_into_whole_scale_blocks_a_warp(kind, block, k, tile, want):
    _, w = weights(32, k, kind, block, device="cpu")
    got = C.fit(w, C.QGemv(*tile), gated=False)
    assert got == (C.QGemv(*want) if want else None)


@pytest.mark.parametrize("kind, block, k", [
    (INT4, (1, 64), 1024),          # chunks of 64: a span would hold two
    (FP8, (128, 32), 1024),         # scale blocks narrower than a span
    (FP8, (128, 64), 1088),         # K not a multiple of 128
])
def test_fit_refuses_what_the_kernel_does_not_take(kind, block, k):
    _, w = weights(32, k, kind, block, device="cpu")
    assert C.fit(w, C.QGemv(2, 256, 2), gated=False) is None


def test_fit_refuses_a_stage_that_the_warps_cannot_split_into_whole_spans():
    """257 bytes a stage divides the row (K = 257 x 128) and 4 warps would take 64 bytes each, one left over."""
    _, w = weights(16, 257 * 128, FP8, (128, 64), device="cpu")
    assert C.fit(w, C.QGemv(4, 257, 2), gated=False) is None


def test_a_shape_takes_its_kinds_table_entry_else_the_kinds_default_launch(tmp_path):
    tiles = KernelConfig().tiles.replace(qgemv_fp8={(4096, 12288): (16, 1024, 4, 264)})
    cfg = KernelConfig(tiles=tiles)
    assert C.tile_for(FP8, 4096, 12288, cfg) == C.QGemv(16, 1024, 4, 264)
    assert C.tile_for(INT4, 4096, 12288, cfg) == C.TILE[INT4]          # the other kind's table: not this one's
    assert C.tile_for(FP8, 1024, 2048, cfg) == C.TILE[FP8]              # a shape no table lists
    assert C.tile_for(FP8, 6144, 4096, cfg) == cfg.tiles.qgemv_fp8[(6144, 4096)]   # a shipped entry
    path = tmp_path / "tiles.json"                                      # and the entry survives the file
    path.write_text(json.dumps(tiles.to_json()))
    assert Tiles.load(path).qgemv_fp8[(4096, 12288)] == C.QGemv(16, 1024, 4, 264)


def test_fit_refuses_a_tile_beyond_shared_memory():
    _, w = weights(32, 4096, FP8, (128, 128), device="cpu")
    tile = C.QGemv(8, 4096, 3)
    assert C.smem_bytes(tile, True, 4096) > cuda_gemv.SMEM_LIMIT
    assert C.fit(w, tile, gated=True) is None and C.fit(w, tile, gated=False) is not None


def test_cpu_calls_stay_on_the_triton_gemv():
    _, w = weights(32, 1024, FP8, (128, 128), device="cpu")
    x = torch.randn(1, 1024).to(BF16)
    out = torch.empty(1, 32, dtype=BF16)
    assert C.qgemv(x, w, out, norm=None, eps=1e-6, gated=False, residual=None, extra_out=None) is None


gpu_only = pytest.mark.gpu
needs_lib = pytest.mark.skipif(not torch.cuda.is_available() or cuda_gemv.nvcc() is None
                               or torch.cuda.get_device_capability()[0] < 9,
                               reason="qgemv.cu needs a CUDA GPU of sm_90 or newer and nvcc")
SCHEMES = [(FP8, (128, 128)), (FP8, (32, 64)), (INT4, (1, 128)), (INT4, (64, 128))]


def call(x, w, tile, **kw):
    out = torch.full((1, w.shape[0] // 2 if kw.get("gated") else w.shape[0]), float("nan"), dtype=BF16, device=DEV)
    args = dict(norm=None, eps=1e-6, gated=False, residual=None, extra_out=None) | kw
    got = C.qgemv(x, w, out, tile=tile, **args)
    assert got is not None, "qgemv.cu did not take the call"
    return got


@gpu_only
@needs_lib
@pytest.mark.parametrize("tile", [(4, 512, 3), (2, 256, 2, 3)], ids=str)   # one slice / four, a ring that wraps
@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("kind", ["plain", "norm+residual+extra", "gated", "stacked"])
def test_qgemv_matches_the_dequantized_reference(kind, scheme, tile):
    """200 output rows (the last tile partial), K 1024, every epilogue, against linear_reference on the
    dequantized weights."""
    torch.manual_seed(3)
    gated = kind == "gated"
    n, k = 256 if gated else 200, 1024                  # gated: whole scale rows (qlinear asserts it)
    qw, w = weights(n if kind != "stacked" else 128, k, *scheme, parts=2 if kind in ("gated", "stacked") else 1)
    x = randn(1, k, dtype=BF16)
    norm = randn(k, dtype=BF16) + 1 if kind in ("norm+residual+extra", "gated") else None
    residual = randn(1, n, dtype=BF16) if kind == "norm+residual+extra" else None
    extra = torch.empty(1, n, dtype=BF16, device=DEV) if residual is not None else None
    got = call(x, w, C.QGemv(*tile), norm=norm, gated=gated, residual=residual, extra_out=extra)
    ref = qlinear_reference(x, qw, norm=norm, gated=gated, residual=residual)
    assert not got.isnan().any() and rel(got, ref) < TOL[BF16]
    if extra is not None:
        assert torch.equal(extra, got)


@gpu_only
@needs_lib
@pytest.mark.parametrize("kind", [FP8, INT4])
def test_every_code_reads_exactly(kind):
    """Every e4m3 value but NaN (subnormals included) and every INT4 code against every zero point, at every
    input position of a span: with scale 1 and x one-hot, y holds a column of the weights, bit for bit."""
    n, k = 256, 256
    if kind == FP8:     # row r, column c: byte 16 (r % 16) + c % 16, NaN bytes replaced by zeros
        b = torch.arange(n * k, dtype=torch.int64).reshape(n, k) % 16 + 16 * (torch.arange(n)[:, None] % 16)
        b = torch.where((b & 0x7F) == 0x7F, 0, b).to(torch.uint8)
        qw = QWeight(FP8, b.view(torch.float8_e4m3fn), torch.ones(2, 2), (128, 128))
    else:               # row r: zero point r % 16; codes (c + r) % 16
        b = ((torch.arange(k)[None, :] + torch.arange(n)[:, None]) % 16).to(torch.uint8)
        qw = QWeight(INT4, b, torch.ones(n, 2), (1, 128), (torch.arange(n) % 16).to(torch.uint8)[:, None].repeat(1, 2))
    w = QLinear.pack([qw.to(DEV)])
    dense = qw.dequantize().to(BF16).to(DEV)
    for i in range(k):
        x = torch.zeros(1, k, dtype=BF16, device=DEV)
        x[0, i] = 1
        assert torch.equal(call(x, w, C.QGemv(2, 256, 2))[0], dense[:, i]), f"input {i}"


@gpu_only
@needs_lib
@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_x_spanning_many_binades_within_a_group(scheme):
    """x's two 8-bit terms (qgemv.cu's header) at their edges: inputs 2^-20 to 2^8 apart inside one group of
    scale, a group of zeros, a group of one nonzero input; the results within TOL of the reference, and a
    one-hot x far from 1 (2^-30, 2^20) reads a column of the weights exactly scaled."""
    torch.manual_seed(5)
    qw, w = weights(200, 1024, *scheme)
    x = (randn(1, 1024, dtype=torch.float32) * 2.0 ** torch.randint(-20, 9, (1, 1024), device=DEV)).to(BF16)
    x[0, 128:256] = 0
    x[0, 256:384] = 0
    x[0, 300] = -7.5
    got = call(x, w, C.QGemv(2, 256, 2))
    assert rel(got, qlinear_reference(x, qw)) < TOL[BF16]
    for v in (2.0 ** -30, 2.0 ** 20):
        x = torch.zeros(1, 1024, dtype=BF16, device=DEV)
        x[0, 517] = v
        want = (qw[0].dequantize()[:, 517] * v).to(BF16).to(DEV)
        assert torch.equal(call(x, w, C.QGemv(2, 256, 2))[0], want)


@gpu_only
@needs_lib
@pytest.mark.parametrize("pdl", [False, True])
def test_qgemv_in_a_cuda_graph(pdl):
    """Two calls recorded in one graph, the second reading the first's output: replays give the eager
    results for new inputs."""
    torch.manual_seed(4)
    k = 1024
    _, w1 = weights(k, k, FP8, (128, 128))
    _, w2 = weights(k, k, INT4, (1, 128))
    g = randn(k, dtype=BF16) + 1
    x = randn(1, k, dtype=BF16)
    cfg = KernelConfig(pdl=pdl)
    tile = C.QGemv(4, 512, 3)

    def chain():
        h = torch.empty(1, k, dtype=BF16, device=DEV)
        C.qgemv(x, w1, h, norm=g, eps=1e-6, gated=False, residual=None, extra_out=None, tile=tile, cfg=cfg)
        r = x.clone()
        C.qgemv(h, w2, r, norm=None, eps=1e-6, gated=False, residual=r, extra_out=None, tile=tile, cfg=cfg)
        return r

    want = chain()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
        with torch.cuda.graph(graph, stream=stream):
            out = chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    assert torch.equal(out, want)
    x.copy_(randn(1, k, dtype=BF16))
    want = chain()
    graph.replay()
    assert torch.equal(out, want)


@gpu_only
@needs_lib
@pytest.mark.parametrize("scheme", [(FP8, (128, 128)), (INT4, (1, 128))], ids=str)
@pytest.mark.parametrize("shape, gated", [((6144, 4096), False), ((12288, 4096), True), ((4096, 12288), False)])
def test_qlinear_sends_one_row_at_the_8b_shapes_here(scheme, shape, gated):
    """qlinear() of one row gives qgemv.cu's bits at the shape's launch (tile_for), the Triton GEMV's for a kind
    without one and with cuda_gemv off; all near the reference."""
    n, k = shape
    kind = scheme[0]
    qw, w = weights(n, k, *scheme, parts=2 if gated else 1)
    x = randn(1, k, dtype=BF16)
    got = qlinear(x, w, gated=gated)
    triton = qlinear(x, w, gated=gated, cfg=KernelConfig(cuda_gemv=False))
    tile = C.tile_for(kind, n, k)
    assert torch.equal(got, call(x, w, tile, gated=gated) if tile else triton)
    ref = qlinear_reference(x, qw, gated=gated)
    assert rel(got, ref) < TOL[BF16] and rel(triton, ref) < TOL[BF16]
