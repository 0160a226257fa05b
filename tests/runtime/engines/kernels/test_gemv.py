"""The one-row Triton GEMV (runtime/engines/kernels/gemv.py) against its plain-torch reference: in Triton's
interpreter on the CPU, compiled at the Qwen3-8B shapes on a GPU (``gpu``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from kernel_checks import DEV, DTYPES, TOL, randn, rel, with_tiles  # noqa: E402

from xcompile.runtime.engines.kernels import gemv as G  # noqa: E402
from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig, Tiles  # noqa: E402
from xcompile.runtime.engines.kernels.linear import linear, linear_reference  # noqa: E402

GEMVS = {"ahead 1": G.Gemv(8, 256, 4), "ahead 3": G.Gemv(8, 256, 4, ahead=3), "wide": G.Gemv(16, 512, 8, ahead=2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", list(GEMVS))
@pytest.mark.parametrize("kind", ["plain", "norm+residual+extra", "gated", "residual in place"])
def test_one_row_gemv_matches_reference(kind, tile, dtype):
    """The one-row GEMV against the reference: plain, with its RMSNorm (1/rms applied to the sums), gated,
    a residual in place, the second output; twice (nothing left behind)."""
    n, k = 40, 1024
    cfg = with_tiles(gemv={(n, k): GEMVS[tile]})
    gated = kind == "gated"
    w = randn(2 * n if gated else n, k, dtype=dtype, scale=k ** -0.5)
    x, g = randn(1, k, dtype=dtype), randn(k, dtype=dtype) + 1
    r = randn(1, n, dtype=dtype) if kind != "gated" else None
    taps = torch.zeros(1, 3 * n, dtype=dtype, device=DEV)
    norm = g if kind in ("norm+residual+extra", "gated") else None
    want = linear_reference(x, w, norm=norm, gated=gated, residual=r)
    for _ in range(2):
        if kind == "residual in place":
            got = r.clone()
            linear(x, w, residual=got, out=got, cfg=cfg)
        else:
            got = linear(x, w, norm=norm, gated=gated, residual=r, extra_out=taps[:, n:2 * n], cfg=cfg)
        assert rel(got, want) < TOL[dtype]
    if kind == "norm+residual+extra":
        assert torch.equal(taps[:, n:2 * n], got)



@pytest.mark.parametrize("ahead", [2, 3, 4])
def test_gemv_tiles_ahead_change_no_bits(ahead):
    """The GEMV with its weight tiles 2-4 steps ahead (past the end of K: 4 steps of 128 columns) uses them in
    the same order as 1 ahead: the same bits, gated with the RMSNorm."""
    n, k = 40, 512
    w, x, g = randn(2 * n, k, dtype=torch.bfloat16, scale=k ** -0.5), randn(1, k, dtype=torch.bfloat16), \
        randn(k, dtype=torch.bfloat16) + 1
    want = linear(x, w, norm=g, gated=True, cfg=with_tiles(gemv={(n, k): G.Gemv(8, 128, 4)}))
    assert torch.equal(linear(x, w, norm=g, gated=True, cfg=with_tiles(gemv={(n, k): G.Gemv(8, 128, 4, ahead)})), want)


def test_gemv_tile_falls_back_to_the_tile_kernel():
    """A shape the table lacks, or whose BLOCK_K does not divide K, runs on the tile kernel."""
    tiles = Tiles(gemv={(7, 96): (4, 64, 4), (8, 192): (4, 64, 4, 2)})
    assert G.gemv_tile(7, 96, tiles) is None
    assert G.gemv_tile(8, 192, tiles) == G.Gemv(4, 64, 4, 2)
    assert G.gemv_tile(10, 256, tiles) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gemv_norm_matches_reference(dtype):
    """The GEMV's RMSNorm prologue (x * g rounded, the 1/rms applied to the fp32 sums at the end) matches
    the reference, plain and gated, and so does the tile kernel's (a norm launch) for one row."""
    torch.manual_seed(4)
    n, k = 96, 256
    g = randn(k, dtype=dtype) + 1
    for gated in (False, True):
        w = randn(2 * n if gated else n, k, dtype=dtype, scale=k ** -0.5)
        x = 3 * randn(1, k, dtype=dtype)
        ref = linear_reference(x, w, norm=g, gated=gated)
        for cfg in (with_tiles(gemv={(n, k): G.Gemv(4, 64, 4)}), KernelConfig(tiles=Tiles())):
            assert rel(linear(x, w, norm=g, gated=gated, cfg=cfg), ref) < TOL[dtype]



@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["o", "gate/up", "down"])
@pytest.mark.parametrize("ahead", [2, 4])
def test_gemv_ahead_gives_the_same_bits_at_qwen3_8b(shape, ahead):
    """The compiled one-row GEMV with its weight tiles 2 / 4 steps ahead against 1 ahead, at the 8B o and
    down (residual) and gate/up (RMSNorm, SiLU*mul) shapes: the same bits."""
    gated = shape == "gate/up"
    n, k, bk = {"o": (4096, 4096, 512), "gate/up": (12288, 4096, 256), "down": (4096, 12288, 512)}[shape]
    torch.manual_seed(ahead)
    w = randn(2 * n if gated else n, k, dtype=torch.bfloat16, scale=k ** -0.5)
    x, g, r = randn(1, k, dtype=torch.bfloat16), randn(k, dtype=torch.bfloat16) + 1, randn(1, n, dtype=torch.bfloat16)
    args = dict(norm=g, gated=True) if gated else dict(residual=r)
    def triton_gemv(tile):
        return KernelConfig(cuda_gemv=False, tiles=DEFAULT.tiles.replace(gemv={(n, k): tile}))
    want = linear(x, w, **args, cfg=triton_gemv(G.Gemv(4, bk, 4)))
    assert torch.equal(linear(x, w, **args, cfg=triton_gemv(G.Gemv(4, bk, 4, ahead=ahead))), want)
