"""The canonical quantized weight (runtime/engines/qweight.py): round-to-nearest quantization within each
kind's error, partial edge blocks, and the checkpoint formats' codes read into it."""

from __future__ import annotations

import pytest
import torch

from xcompile.runtime.engines.qweight import FP8, INT4, QWeight, quantize


@pytest.mark.parametrize("kind, block", [(FP8, (128, 128)), (FP8, (1, 50)), (INT4, (1, 32)), (INT4, (1, 50))])
@pytest.mark.parametrize("shape", [(96, 100), (200, 300)])
def test_round_to_nearest_stays_within_half_a_step(kind, block, shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q = quantize(w, kind, block)
    assert q.shape == shape and q.scale.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    err = (q.dequantize() - w).abs()
    step = q.expand(q.scale)
    if kind == FP8:
        # e4m3 has 3 mantissa bits: half an ulp is at most 2^-4 of the value, plus subnormals' absolute step
        assert bool((err <= w.abs() * 2 ** -4 + step * 2 ** -9 + 1e-7).all())
    else:
        assert bool((err <= step / 2 + 1e-6).all())
        assert int(q.codes.max()) <= 15 and int(q.zero.max()) <= 15


def test_int4_zero_points_shift_the_codes():
    codes = torch.tensor([[0, 15, 8, 3]], dtype=torch.uint8)
    q = QWeight(INT4, codes, torch.tensor([[0.5, 2.0]]), (1, 2), torch.tensor([[8, 3]], dtype=torch.uint8))
    assert q.dequantize().tolist() == [[-4.0, 3.5, 10.0, 0.0]]
    assert q.nbytes() == 4 // 2 + 2 * 4 + 2


def test_an_fp8_weight_is_its_codes_times_its_block_scales():
    codes = torch.tensor([[1.0, -2.0, 0.5], [4.0, 448.0, -0.25]]).to(torch.float8_e4m3fn)
    q = QWeight(FP8, codes, torch.tensor([[2.0, 0.5]]), (2, 2))
    assert q.dequantize().tolist() == [[2.0, -4.0, 0.25], [8.0, 896.0, -0.125]]
