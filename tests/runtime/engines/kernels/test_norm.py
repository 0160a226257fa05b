"""The norm launches (runtime/engines/kernels/norm.py) against their plain-torch references.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from kernel_checks import DEV, DTYPES, randn, rel  # noqa: E402

from xcompile.runtime.engines.kernels.norm import embed_norms, embed_norms_reference, rms_norm  # noqa: E402


def test_embed_norms_matches_reference():
    torch.manual_seed(2)
    emb, hidden = randn(50, 48, dtype=torch.bfloat16), randn(3, 48, dtype=torch.bfloat16)
    w1, w2 = randn(48, dtype=torch.bfloat16) + 1, randn(48, dtype=torch.bfloat16) + 1
    ids = torch.tensor([4, 49, 0], device=DEV)
    got = embed_norms(ids, emb, w1, hidden, w2, 1e-6)
    assert rel(got, embed_norms_reference(ids, emb, w1, hidden, w2, 1e-6)) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_gathers_rows_with_the_bits_of_index_select(dtype):
    """rms_norm(x, g, rows=...) (the lm_heads' logit rows, gathered by the norm launch): each output row
    the same bits as normalising x.index_select(0, rows); rows may repeat and come in any order."""
    torch.manual_seed(11)
    k = 320
    x, g = 3 * randn(9, 2 * k, dtype=dtype)[:, :k], randn(k, dtype=dtype) + 1
    rows = torch.tensor([4, 0, 8, 4], device=DEV)
    assert torch.equal(rms_norm(x, g, 1e-6, rows=rows), rms_norm(x.index_select(0, rows), g, 1e-6))
