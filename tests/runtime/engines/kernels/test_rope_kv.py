"""q/k RMSNorm + RoPE + KV write (runtime/engines/kernels/rope_kv.py) against its plain-torch reference.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from kernel_checks import DEV, DTYPES, TOL, randn, rel  # noqa: E402

from xcompile.compile.models.layers import rope_tables  # noqa: E402
from xcompile.runtime.engines.kernels.rope_kv import rope_kv, rope_kv_reference  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_rope_kv_matches_reference(qk_norm, dtype):
    torch.manual_seed(1)
    heads, kv_heads, d, rows = 4, 2, 64, 5
    qkv = randn(rows, (heads + 2 * kv_heads) * d, dtype=dtype)
    cos, sin = (t.to(DEV) for t in rope_tables(d, 128, 1e6))
    pos = torch.tensor([30, 31, 31, 32, 33], device=DEV)                        # tree nodes share positions
    wi = torch.tensor([30], device=DEV)
    qn, kn = (randn(d, dtype=dtype) + 1, randn(d, dtype=dtype) + 1) if qk_norm else (None, None)
    caches = [randn(1, kv_heads, 128, d, dtype=dtype) for _ in range(2)]
    got_k, got_v = caches[0].clone(), caches[1].clone()
    want_k, want_v = caches[0].clone(), caches[1].clone()
    q = rope_kv(qkv, pos, wi, cos, sin, got_k, got_v, heads, kv_heads, d, qn, kn)
    want = rope_kv_reference(qkv, pos, wi, cos, sin, want_k, want_v, heads, kv_heads, d, qn, kn)
    assert rel(q, want) < TOL[dtype] and rel(got_k, want_k) < TOL[dtype] and torch.equal(got_v, want_v)
    assert torch.equal(got_k[:, :, :30], caches[0][:, :, :30])                   # nothing before write_index


@pytest.mark.parametrize("per", [1, 3])
def test_rope_kv_batch_writes_each_sequence_into_its_own_cache_row(per):
    """B sequences of ``per`` tokens (the batch loop's step): sequence b's keys and values land in cache row b
    at its own write_index, each row exactly as a call of that sequence alone writes it."""
    torch.manual_seed(2)
    heads, kv_heads, d, batch = 4, 2, 64, 3
    dtype = torch.float32
    qkv = randn(batch * per, (heads + 2 * kv_heads) * d, dtype=dtype)
    cos, sin = (t.to(DEV) for t in rope_tables(d, 128, 1e6))
    wi = torch.tensor([7, 40, 0], device=DEV)
    pos = torch.cat([w + torch.arange(per, device=DEV) for w in wi])
    qn, kn = randn(d, dtype=dtype) + 1, randn(d, dtype=dtype) + 1
    caches = [randn(batch, kv_heads, 128, d, dtype=dtype) for _ in range(2)]
    got_k, got_v = caches[0].clone(), caches[1].clone()
    q = rope_kv(qkv, pos, wi, cos, sin, got_k, got_v, heads, kv_heads, d, qn, kn)
    want_k, want_v = caches[0].clone(), caches[1].clone()
    want = rope_kv_reference(qkv, pos, wi, cos, sin, want_k, want_v, heads, kv_heads, d, qn, kn)
    assert rel(q, want) < TOL[dtype] and rel(got_k, want_k) < TOL[dtype] and torch.equal(got_v, want_v)
    for b in range(batch):
        rows = slice(b * per, (b + 1) * per)
        alone_k, alone_v = caches[0][b:b + 1].clone(), caches[1][b:b + 1].clone()
        alone = rope_kv(qkv[rows], pos[rows], wi[b:b + 1], cos, sin, alone_k, alone_v, heads, kv_heads, d, qn, kn)
        assert torch.equal(q[rows], alone) and torch.equal(got_k[b], alone_k[0]) and torch.equal(got_v[b], alone_v[0])
