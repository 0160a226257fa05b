"""The fast kernels over an FP8 KV cache: rope_kv writes e4m3 codes (kernels/qcodes.py ``_to_e4m3``, the bytes
torch's conversion gives, on every device) and the split-KV attention reads them back exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kernel_checks import DEV, DTYPES, TOL, randn, rel  # noqa: E402

from xcompile.compile.models.layers import rope_tables  # noqa: E402
from xcompile.runtime.engines.kernels.attention import attention, attention_reference  # noqa: E402
from xcompile.runtime.engines.kernels.config import KernelConfig  # noqa: E402
from xcompile.runtime.engines.kernels.qcodes import _to_e4m3  # noqa: E402
from xcompile.runtime.engines.kernels.rope_kv import rope_kv, rope_kv_reference  # noqa: E402

FP8 = torch.float8_e4m3fn


@triton.jit
def _encode(X, OUT, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + i, _to_e4m3(tl.load(X + i, mask=i < N, other=0.0)), mask=i < N)


def encode(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _encode[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def test_e4m3_codes_are_torchs_for_every_bf16_value_and_fp32_ties():
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = every[every.isfinite()]
    # fp32 values halfway between neighbouring e4m3 values (ties to even), and just either side of them
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    ties = torch.cat([mid, mid.nextafter(mid + 1), mid.nextafter(mid - 1), -mid, torch.tensor([500.0, -1e30])])
    for x in (every, ties):
        x = x.to(DEV).contiguous()
        assert torch.equal(encode(x).cpu(), x.clamp(-448, 448).to(FP8).view(torch.uint8).cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_writes_the_references_codes(dtype):
    torch.manual_seed(3)
    heads, kv_heads, d, rows = 4, 2, 64, 5
    qkv = randn(rows, (heads + 2 * kv_heads) * d, dtype=dtype, scale=4.0)
    cos, sin = (t.to(DEV) for t in rope_tables(d, 128, 1e6))
    pos, wi = torch.tensor([30, 31, 31, 32, 33], device=DEV), torch.tensor([30], device=DEV)
    qn, kn = randn(d, dtype=dtype) + 1, randn(d, dtype=dtype) + 1
    got = [torch.zeros(1, kv_heads, 128, d, dtype=FP8, device=DEV) for _ in range(2)]
    want = [c.clone() for c in got]
    q = rope_kv(qkv, pos, wi, cos, sin, *got, heads, kv_heads, d, qn, kn)
    q_want = rope_kv_reference(qkv, pos, wi, cos, sin, *want, heads, kv_heads, d, qn, kn)
    assert rel(q, q_want) < TOL[dtype]
    got_k, got_v, want_k, want_v = (c.view(torch.uint8) for c in (*got, *want))
    assert torch.equal(got_v, want_v) and got_v[:, :, 30:35].any()
    # k is computed in the reference's rounding steps up to a reduction order: a code may land one step over
    assert (got_k != want_k).float().mean() < 0.01
    assert not got_k[:, :, :30].any() and not got_k[:, :, 35:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7])
def test_attention_reads_an_fp8_cache_exactly(m, dtype):
    torch.manual_seed(4)
    heads, kv_heads, d, wi = 4, 2, 64, 300
    caches = [randn(1, kv_heads, 512, d, dtype=torch.float32, scale=3.0).to(FP8) for _ in range(2)]
    q = randn(m, heads * d, dtype=dtype)
    mask = torch.ones(m, m, dtype=torch.bool, device=DEV).tril()
    index = torch.tensor([wi], device=DEV)
    got = attention(q, *caches, index, mask, heads)
    want = attention_reference(q, *caches, index, mask, heads)
    # the same as over the caches' values in q's dtype (e4m3 values are exact in bf16)
    full = attention(q, *(c.to(dtype) for c in caches), index, mask, heads)
    assert rel(got, want) < TOL[dtype] and torch.equal(got, full)


def test_row_invariant_tree_reads_an_fp8_cache_exactly():
    """A tree block under KernelConfig.row_invariant (each token's keys gathered, attention.py's packed path)
    over an FP8 cache: the bits of the same call over the cache's values in bf16."""
    torch.manual_seed(5)
    heads, kv_heads, d, wi = 4, 2, 64, 60
    caches = [randn(1, kv_heads, 256, d, dtype=torch.float32, scale=3.0).to(FP8) for _ in range(2)]
    mask = torch.eye(6, dtype=torch.bool, device=DEV)
    for i, p in enumerate([-1, 0, 0, 1, 2, 2]):           # each node sees its ancestors
        if p >= 0:
            mask[i] |= mask[p]
    q = randn(6, heads * d, dtype=torch.bfloat16)
    index, exact = torch.tensor([wi], device=DEV), KernelConfig(row_invariant=True)
    got = attention(q, *caches, index, mask, heads, cfg=exact)
    assert rel(got, attention_reference(q, *caches, index, mask, heads)) < TOL[torch.bfloat16]
    assert torch.equal(got, attention(q, *(c.to(torch.bfloat16) for c in caches), index, mask, heads, cfg=exact))
