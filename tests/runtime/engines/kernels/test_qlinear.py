"""The quantized projections (runtime/engines/kernels/qlinear.py) against linear_reference on the dequantized
weights, in Triton's interpreter on the CPU (``gpu`` tests: compiled, at the Qwen3-8B shapes).

Tolerances are the tile kernel's (tests/kernel_checks.py): the kernel scales fp32 block sums where the
reference multiplies by the dequantized weights, a reordering of float rounding, not a change of weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from kernel_checks import DEV, DTYPES, TOL, randn, rel  # noqa: E402

from xcompile.runtime.engines.kernels.qlinear import QLinear, qlinear, qlinear_reference  # noqa: E402
from xcompile.runtime.engines.kernels.tile_finish import RowSums  # noqa: E402
from xcompile.runtime.engines.qweight import FP8, INT4, QWeight, quantize  # noqa: E402

SCHEMES = [(FP8, (32, 64)), (INT4, (1, 64)), (INT4, (1, 128))]


def weights(n: int, k: int, kind: str, block, parts: int = 1):
    w = [quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * k ** -0.5, kind, block).to(DEV)
         for i in range(parts)]
    return w, QLinear.pack(w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 17, 64])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s}")
@pytest.mark.parametrize("kind", ["plain", "norm+residual", "gated", "stacked"])
def test_qlinear_matches_the_dequantized_reference(kind, scheme, rows, dtype):
    torch.manual_seed(rows)
    n, k = 96, 256
    gated = kind == "gated"
    qw, packed = weights(n, k, *scheme, parts=2 if kind in ("gated", "stacked") else 1)
    x = randn(rows, k, dtype=dtype)
    norm = randn(k, dtype=dtype) + 1 if kind in ("norm+residual", "gated") else None
    residual = randn(rows, n, dtype=dtype) if kind == "norm+residual" else None
    n_out = n if gated or kind == "plain" or kind == "norm+residual" else 2 * n
    out = torch.full((rows, n_out), float("nan"), dtype=dtype, device=DEV)
    qlinear(x, packed, norm=norm, gated=gated, residual=residual, out=out)
    ref = qlinear_reference(x, qw, norm=norm, gated=gated, residual=residual)
    assert not out.isnan().any()
    assert rel(out, ref) < TOL[dtype]


def test_norm_from_row_sums_equals_a_norm_launch():
    """x's 1/rms from the sums the call that wrote x left, with the norm's weight applied to x as it loads."""
    dtype = torch.float32
    qw, packed = weights(64, 128, INT4, (1, 64))
    _, first = weights(128, 64, FP8, (32, 32))
    sums = RowSums(128, dtype, torch.device(DEV))
    a, res = randn(6, 64, dtype=dtype), randn(6, 128, dtype=dtype)
    x = qlinear(a, first, residual=res, sums_out=sums)
    assert sums.source == RowSums.key(x)
    norm = randn(128, dtype=dtype) + 1
    got = qlinear(x, packed, norm=norm, sums=sums)
    want = qlinear_reference(x, qw, norm=norm)
    assert rel(got, want) < TOL[dtype]


@pytest.mark.parametrize("tile", [(4, 512, 2, 0), (8, 256, 1, 1), (4, 1024, 4, 2)], ids=str)
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s}")
def test_gemv_tiles_stream_k_in_steps_with_tiles_loaded_ahead(scheme, tile, monkeypatch):
    """The GEMV (qgemv.py) at several steps of K, a step spanning several scale columns (FP8) or chunks (INT4),
    tiles loaded 0-2 steps ahead (the last ones past K masked), the norm's 1/rms from x and its up rows."""
    import xcompile.runtime.engines.kernels.qlinear as Q

    kind, block = scheme
    monkeypatch.setitem(Q.GEMV_TILE, kind, tile)
    dtype = torch.float32
    qw, packed = weights(64, 1024, kind, block, parts=2)
    x = randn(1, 1024, dtype=dtype)
    norm = randn(1024, dtype=dtype) + 1
    got = qlinear(x, packed, norm=norm, gated=True)
    assert rel(got, qlinear_reference(x, qw, norm=norm, gated=True)) < TOL[dtype]


@pytest.mark.parametrize("programs", [18, 10**6], ids=["uneven-split", "a-chunk-each"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s}")
def test_tile_kernel_splits_k_into_whole_chunks(scheme, programs, monkeypatch):
    """The tile kernel with K split across programs (tile_finish._finish adds the partials in split order): pieces
    of unequal length, down to one chunk each, gated with the norm and a residual, two row tiles."""
    import xcompile.runtime.engines.kernels.qlinear as Q

    kind, block = scheme
    monkeypatch.setitem(Q.TILE, kind, (16, 1, 2, programs))
    dtype = torch.float32
    qw, packed = weights(96, 1024, kind, block, parts=2)
    x, norm, res = randn(20, 1024, dtype=dtype), randn(1024, dtype=dtype) + 1, randn(20, 96, dtype=dtype)
    for _ in range(2):                                      # the arrival counters are left at zero
        got = qlinear(x, packed, norm=norm, gated=True, residual=res)
        assert rel(got, qlinear_reference(x, qw, norm=norm, gated=True, residual=res)) < TOL[dtype]


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("kind", [FP8, INT4])
def test_every_code_reads_exactly(kind, rows):
    """Every e4m3 value but NaN (subnormals included) and every INT4 code against every zero point, read by the
    GEMV (one row) and the tile kernel (16: on a GPU, the PTX conversions of qcodes.py): with scale 1 and x
    one-hot, y holds the weights themselves, bit for bit in bf16."""
    n, k = 256, 256
    if kind == FP8:     # row r, column c < 16: byte 16 r + c (NaN bytes 0x7F and 0xFF replaced by zeros)
        b = torch.arange(n * k, dtype=torch.int64).reshape(n, k) % 16 + 16 * (torch.arange(n)[:, None] % 16)
        b = torch.where((b & 0x7F) == 0x7F, 0, b).to(torch.uint8)
        qw = QWeight(FP8, b.view(torch.float8_e4m3fn), torch.ones(2, 2), (128, 128))
    else:               # row r: zero point r % 16, codes c % 16
        b = (torch.arange(k) % 16).repeat(n, 1).to(torch.uint8)
        qw = QWeight(INT4, b, torch.ones(n, 2), (1, 128), (torch.arange(n) % 16).to(torch.uint8)[:, None].repeat(1, 2))
    packed = QLinear.pack([qw.to(DEV)])
    x = torch.zeros(rows, k, dtype=torch.bfloat16, device=DEV)
    x[torch.arange(rows), torch.arange(rows)] = 1
    want = qw.dequantize()[:, :rows].T.to(torch.bfloat16)
    assert torch.equal(qlinear(x, packed).cpu(), want)


def test_groups_that_do_not_fit_the_kernels_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        QLinear.pack([quantize(torch.randn(16, 96), INT4, (1, 48))])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels at the 8B shapes need a CUDA GPU")
@pytest.mark.parametrize("scheme", [(FP8, (128, 128)), (INT4, (1, 128))], ids=lambda s: f"{s}")
@pytest.mark.parametrize("shape, gated", [((6144, 4096), False), ((12288, 4096), True), ((4096, 12288), False)])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_qlinear_at_the_8b_shapes(scheme, shape, gated, rows):
    n, k = shape
    qw, packed = weights(n, k, *scheme, parts=2 if gated else 1)
    x = randn(rows, k, dtype=torch.bfloat16)
    got = qlinear(x, packed, gated=gated)
    assert rel(got, qlinear_reference(x, qw, gated=gated)) < TOL[torch.bfloat16]

