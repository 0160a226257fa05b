"""Split-KV attention (runtime/engines/kernels/attention.py) against its plain-torch reference: in Triton's
interpreter on the CPU at small caches that still cover short and long chunks, several splits, ragged live
lengths and tree masks; compiled at the Qwen3-8B shapes on a GPU (``gpu``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from kernel_checks import DEV, DTYPES, ROWS_ALIKE, TOL, randn, rel  # noqa: E402

from xcompile.runtime.engines.kernels import attention as A  # noqa: E402
from xcompile.runtime.engines.kernels.attention import attention, attention_reference  # noqa: E402
from xcompile.runtime.engines.kernels.config import KernelConfig  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,write_index,rows", [(4, 2, 0, 5), (8, 2, 517, 1), (8, 4, 100, 7),
                                                              (4, 1, 200, 33), (4, 4, 63, 64)])
@pytest.mark.parametrize("chunk", [None, 64])
def test_attention_matches_reference(heads, kv_heads, write_index, rows, dtype, chunk):
    """chunk None: the default (128 keys). Most splits are past the live length; at write_index 63 and
    517 a split's first block mixes cached keys (read before the wait for rope_kv) and this step's new
    ones (read after it)."""
    torch.manual_seed(write_index + rows)
    d, s_max = 64, 640
    kc, vc = randn(1, kv_heads, s_max, d, dtype=dtype), randn(1, kv_heads, s_max, d, dtype=dtype)
    q = randn(rows, heads * d, dtype=dtype)
    tm = ((torch.rand(rows, rows, device=DEV) < 0.5) | torch.eye(rows, dtype=torch.bool, device=DEV)).tril()
    wi = torch.tensor([write_index], device=DEV)
    got = attention(q, kc, vc, wi, tm, heads, chunk=chunk)
    assert rel(got, attention_reference(q, kc, vc, wi, tm, heads)) < TOL[dtype]



@pytest.mark.parametrize("row_tile", [32, 64])
@pytest.mark.parametrize("heads,kv_heads,write_index,rows", [(8, 2, 517, 1), (8, 2, 100, 7), (4, 1, 200, 33)])
def test_attention_row_tiles(row_tile, heads, kv_heads, write_index, rows):
    """Wider row tiles (benchmarks/attention_splits.py sweeps them): a program takes more token x head rows of a
    group over each KV tile, some rows past the block's tokens (masked), the same attention."""
    torch.manual_seed(write_index + rows)
    d = 64
    kc, vc = randn(1, kv_heads, 640, d, dtype=torch.float32), randn(1, kv_heads, 640, d, dtype=torch.float32)
    q = randn(rows, heads * d, dtype=torch.float32)
    tm = ((torch.rand(rows, rows, device=DEV) < 0.5) | torch.eye(rows, dtype=torch.bool, device=DEV)).tril()
    wi = torch.tensor([write_index], device=DEV)
    got = attention(q, kc, vc, wi, tm, heads, row_tile=row_tile)
    assert rel(got, attention_reference(q, kc, vc, wi, tm, heads)) < 1e-5

@pytest.mark.parametrize("even,row_tile", [(3, 16), (5, 32), (64, 16)])
@pytest.mark.parametrize("write_index,rows", [(0, 7), (100, 1), (300, 7), (517, 33), (560, 64)])
def test_attention_even_splits(even, row_tile, write_index, rows):
    """``even``: the launch's splits share the live keys, each sequence's chunk from its own write_index (here
    3 / 5 / 10 splits of a 640-slot cache: 64 splits are capped at its ten 64-key steps): accurate at short and
    long live lengths and in a batch of two sequences at other write_indexes, and a row's bits are the same
    from 2 rows a call on (the chunk does not depend on the row count)."""
    torch.manual_seed(write_index + rows + even)
    d, heads = 64, 8
    kc, vc = randn(2, 2, 640, d, dtype=torch.float32), randn(2, 2, 640, d, dtype=torch.float32)
    q = randn(2 * rows, heads * d, dtype=torch.float32)
    tm = ((torch.rand(2, rows, rows, device=DEV) < 0.5) | torch.eye(rows, dtype=torch.bool, device=DEV)).tril()
    wi = torch.tensor([write_index, 640 - rows - write_index // 2], device=DEV)
    got = attention(q, kc, vc, wi, tm, heads, row_tile=row_tile, even=even)
    assert rel(got, attention_reference(q, kc, vc, wi, tm, heads)) < 1e-5
    if rows > 2:
        two = attention(q[:2], kc[:1], vc[:1], wi[:1], tm[0, :2, :2], heads, row_tile=row_tile, even=even)
        assert torch.equal(two, got[:2])


def attention_640(write_index: int, rows: int):
    """Attention of ``rows`` tokens at ``write_index`` over a 640-slot fp32 cache (8 heads on 2, d 64, 128-key
    chunks), checked accurate and a row alone checked to keep its block row's bits; its inputs and result."""
    torch.manual_seed(write_index + rows)
    d, heads = 64, 8
    kc, vc = randn(1, 2, 640, d, dtype=torch.float32), randn(1, 2, 640, d, dtype=torch.float32)
    q = randn(rows, heads * d, dtype=torch.float32)
    tm = ((torch.rand(rows, rows, device=DEV) < 0.5) | torch.eye(rows, dtype=torch.bool, device=DEV)).tril()
    wi = torch.tensor([write_index], device=DEV)
    got = attention(q, kc, vc, wi, tm, heads, chunk=128)
    assert rel(got, attention_reference(q, kc, vc, wi, tm, heads)) < 1e-5
    assert torch.equal(attention(q[:1], kc, vc, wi, tm[:1, :1], heads, chunk=128)[0], got[0])
    return (q, kc, vc, wi, tm, heads), got


def test_chunk_for_takes_fewer_splits_for_several_rows():
    """One row: at most MAX_SPLITS splits over the cache; several rows: at most VERIFY_SPLITS."""
    assert [A.chunk_for(4352, r) for r in (1, 2, 64)] == [128, 256, 256]         # 34 splits, then 17
    assert A.chunk_for(512, 7) == A.chunk_for(512) == 128                        # no chunk shorter than CHUNK
    assert A.chunk_for(40960) == 320 and A.chunk_for(40960, 7) == 2432


def test_layout_takes_even_splits_for_several_rows():
    """One row: the cache's fixed chunks at 16-row tiles; several rows: EVEN_SPLITS even splits at 32-row tiles;
    under row_invariant every call, one row's included, the several rows' fixed chunks at 16-row tiles."""
    ri = KernelConfig(row_invariant=True)
    assert A.layout(4352, 1) == dict(chunk=128, row_tile=16)
    assert A.layout(4352, 7) == A.layout(4352, 64) == dict(even=32, row_tile=32)
    assert A.layout(4352, 1, ri) == A.layout(4352, 7, ri) == dict(chunk=256, row_tile=16)


def test_stages_deepen_only_for_an_even_call_on_a_small_grid():
    """3 KV tiles in flight for the even layout on a grid of at most four programs a SM (a 7-token verify's 256
    on the H100), else 2: a 32-token call's 1,024 capped programs run slower with 3 (attention.stages_for; the
    interpreter counts 2 SMs)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert A.stages_for(32, 4 * A.sms(dev), dev) == A.VERIFY_STAGES == 3
    assert A.stages_for(32, 4 * A.sms(dev) + 1, dev) == A.stages_for(0, 1, dev) == 2


@pytest.mark.parametrize("write_index", [40, 300, 570])
def test_attention_verify_layouts(write_index, monkeypatch):
    """Calls of several rows take the even layout (its bits from 2 rows on); under row_invariant the cache's
    fewer, longer fixed chunks (here 2 of 320 keys on a 640-slot cache, SHORT_CHUNK's 64 keys only below
    write_index 65), one row's call included; one-row calls otherwise keep the cache's 128. Accurate each way."""
    monkeypatch.setattr(A, "VERIFY_SPLITS", 2)                               # the 4352-slot cache's split, small
    torch.manual_seed(write_index)
    d, heads = 64, 8
    kc, vc = randn(1, 2, 640, d, dtype=torch.float32), randn(1, 2, 640, d, dtype=torch.float32)
    q = randn(7, heads * d, dtype=torch.float32)
    tm = ((torch.rand(7, 7, device=DEV) < 0.5) | torch.eye(7, dtype=torch.bool, device=DEV)).tril()
    wi = torch.tensor([write_index], device=DEV)
    want = attention_reference(q, kc, vc, wi, tm, heads)
    got = attention(q, kc, vc, wi, tm, heads)
    assert rel(got, want) < 1e-5
    assert torch.equal(attention(q, kc, vc, wi, tm, heads, even=A.EVEN_SPLITS, row_tile=A.VERIFY_TILE), got)
    assert torch.equal(attention(q[:2], kc, vc, wi, tm[:2, :2], heads)[0], got[0])
    ri = KernelConfig(row_invariant=True)
    fixed = attention(q, kc, vc, wi, tm, heads, cfg=ri)
    assert rel(fixed, want) < 1e-5 and torch.equal(attention(q, kc, vc, wi, tm, heads, chunk=320, cfg=ri), fixed)
    assert torch.equal(attention(q[:1], kc, vc, wi, tm[:1, :1], heads, cfg=ri),
                       attention(q[:1], kc, vc, wi, tm[:1, :1], heads, chunk=320, cfg=ri))
    one = attention(q[:1], kc, vc, wi, tm[:1, :1], heads)
    assert torch.equal(one, attention(q[:1], kc, vc, wi, tm[:1, :1], heads, chunk=128))
    assert rel(one, attention_reference(q[:1], kc, vc, wi, tm[:1, :1], heads)) < 1e-5


@pytest.mark.parametrize("write_index,rows", [(100, 1), (100, 7), (256, 64), (256, 1), (257, 7), (500, 33),
                                             (300, 33), (290, 64)])
def test_attention_short_chunk(write_index, rows, monkeypatch):
    """SHORT_CHUNK (64 keys per split while write_index + MAX_ROWS keys fit the launch's splits at
    that size; here five splits of the 640-slot cache, so up to write_index 256, which with 64 rows fills
    all five): accurate on both sides of the switch, and a row alone gets a block row's bits (the choice
    does not depend on the row count)."""
    args, got = attention_640(write_index, rows)
    # the switch itself: short splits up to write_index 256 (fp32 sums in another order: other bits), the
    # cache's chunk past it (the same bits as without short chunks)
    monkeypatch.setattr(A, "SHORT_CHUNK", 0)
    assert torch.equal(attention(*args, chunk=128), got) == (write_index > 256)


def test_attention_register_cap_takes_grids_of_more_than_four_programs_a_sm(monkeypatch):
    monkeypatch.setattr(A, "sms", lambda device: 132)
    assert not A.many(8 * 34 * 1, torch.device("cuda"))     # the 8B decode step on a 4352-slot cache
    assert A.many(8 * 34 * 2, torch.device("cuda"))         # 7 rows on 34 splits (a verify without VERIFY_SPLITS)
    assert not A.many(8 * 4 * 8, torch.device("cuda"))      # 32 rows on a 512-slot cache


def test_attention_reads_nothing_past_the_live_length():
    """Stale rows past write_index + rows (NaN here) change nothing: the loop stops at the live length."""
    d, heads = 32, 4
    kc, vc = randn(1, 2, 300, d, dtype=torch.float32), randn(1, 2, 300, d, dtype=torch.float32)
    kc[:, :, 150:], vc[:, :, 150:] = float("nan"), float("nan")
    q, tm, wi = randn(3, heads * d, dtype=torch.float32), torch.ones(3, 3, dtype=torch.bool, device=DEV).tril(), \
        torch.tensor([147], device=DEV)
    got = attention(q, kc, vc, wi, tm, heads, chunk=64)
    assert not got.isnan().any() and rel(got, attention_reference(q, kc, vc, wi, tm, heads)) < 1e-5


def test_attention_tree_mask_rows_may_be_strided():
    d, heads, rows = 32, 4, 6
    kc, vc = randn(1, 2, 256, d, dtype=torch.float32), randn(1, 2, 256, d, dtype=torch.float32)
    q = randn(rows, heads * d, dtype=torch.float32)
    big = torch.eye(10, dtype=torch.bool, device=DEV)
    big[:, 0] = True
    tm = big[:rows, :rows]                                                       # row stride 10
    wi = torch.tensor([40], device=DEV)
    assert rel(attention(q, kc, vc, wi, tm, heads), attention_reference(q, kc, vc, wi, tm.contiguous(), heads)) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,keys,write_index", [(4, 12, 30), (8, 40, 70), (1, 5, 4), (16, 64, 200)])
@pytest.mark.parametrize("chunk", [64, None])
def test_attention_mask_columns_may_reach_before_write_index(rows, keys, write_index, dtype, chunk):
    """tree_mask [M, W > M] (the eagle3 contract's mask_keys): its columns start at write_index + M - W,
    so keys of earlier temporary entries are visible only where the mask says (a tree level appended
    after the levels before it). chunk None: the 384-slot cache's 128 keys, and SHORT_CHUNK's 64 at
    write_index <= 128 (all but 200)."""
    torch.manual_seed(rows + keys)
    d, heads = 64, 4
    kc, vc = randn(1, 2, 384, d, dtype=dtype), randn(1, 2, 384, d, dtype=dtype)
    q = randn(rows, heads * d, dtype=dtype)
    big = torch.rand(rows + 3, keys, device=DEV) < 0.4
    big[torch.arange(rows), keys - rows + torch.arange(rows)] = True             # each new token sees itself
    tm = big[:rows]                                                              # strided rows
    wi = torch.tensor([write_index], device=DEV)
    got = attention(q, kc, vc, wi, tm, heads, chunk=chunk)
    assert rel(got, attention_reference(q, kc, vc, wi, tm.contiguous(), heads)) < TOL[dtype]
    # hidden earlier keys are as good as absent: the same as a cache where they carry no weight
    ones = torch.ones(rows, keys, dtype=torch.bool, device=DEV)
    ones[:, keys - rows:] = tm[:, keys - rows:]
    square = attention(q, kc, vc, wi, tm[:, keys - rows:].contiguous(), heads, chunk=chunk)
    assert torch.equal(attention(q, kc, vc, wi, ones, heads, chunk=chunk), square)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 128, 4095])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_attention_at_qwen3_8b_shapes(ctx, rows):
    """Accurate; every row count from 2 gives a row the same bits (the short chunk is picked from
    write_index alone, the several rows' split count from the cache alone)."""
    torch.manual_seed(ctx + rows)
    kc, vc = randn(1, 8, 4352, 128, dtype=torch.bfloat16), randn(1, 8, 4352, 128, dtype=torch.bfloat16)
    q = randn(rows, 32 * 128, dtype=torch.bfloat16)
    tm = ((torch.rand(rows, rows, device=DEV) < 0.3) | torch.eye(rows, dtype=torch.bool, device=DEV)).tril()
    wi = torch.tensor([ctx], device=DEV)
    got = attention(q, kc, vc, wi, tm, 32)
    assert rel(got, attention_reference(q, kc, vc, wi, tm, 32)) < 1e-2
    if rows > 2:
        assert torch.equal(attention(q[:2], kc, vc, wi, tm[:2, :2], 32)[0], got[0])


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [100, 16000, 32000])
@pytest.mark.parametrize("rows,row_tile", [(7, 32), (32, 32)])
def test_attention_even_splits_at_qwen3_8b_shapes(ctx, rows, row_tile):
    """``even`` compiled at the 8B shapes on a 32,256-slot cache (what attention_splits.py --cache times)."""
    torch.manual_seed(ctx + rows)
    kc, vc = randn(1, 8, 32256, 128, dtype=torch.bfloat16), randn(1, 8, 32256, 128, dtype=torch.bfloat16)
    q = randn(rows, 32 * 128, dtype=torch.bfloat16)
    tm = ((torch.rand(rows, rows, device=DEV) < 0.3) | torch.eye(rows, dtype=torch.bool, device=DEV)).tril()
    wi = torch.tensor([ctx], device=DEV)
    got = attention(q, kc, vc, wi, tm, 32, row_tile=row_tile, even=32)
    assert rel(got, attention_reference(q, kc, vc, wi, tm, 32)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 4000])
def test_attention_tree_level_mask_at_qwen3_8b_head_shape(ctx):
    """An EAGLE3 tree level (10 new nodes after 40 earlier ones) at the 8B head's shapes."""
    torch.manual_seed(ctx)
    kc, vc = randn(1, 8, 4352, 128, dtype=torch.bfloat16), randn(1, 8, 4352, 128, dtype=torch.bfloat16)
    q = randn(10, 32 * 128, dtype=torch.bfloat16)
    tm = torch.rand(10, 50, device=DEV) < 0.2
    tm[torch.arange(10), 40 + torch.arange(10)] = True
    wi = torch.tensor([ctx + 40], device=DEV)
    assert rel(attention(q, kc, vc, wi, tm, 32), attention_reference(q, kc, vc, wi, tm, 32)) < 1e-2


@pytest.mark.parametrize("rows", [1, 4])
def test_attention_batch_of_sequences(rows):
    """B sequences of ``rows`` tokens, each at its own write_index over its own cache row and under its own mask
    (the batch loop's step): accurate, and each sequence's rows bit for bit those of a call of it alone."""
    torch.manual_seed(rows)
    d, heads, batch = 64, 8, 3
    kc, vc = randn(batch, 2, 640, d, dtype=torch.float32), randn(batch, 2, 640, d, dtype=torch.float32)
    q = randn(batch * rows, heads * d, dtype=torch.float32)
    tm = ((torch.rand(batch, rows, rows, device=DEV) < 0.5) | torch.eye(rows, dtype=torch.bool, device=DEV)).tril()
    wi = torch.tensor([517, 0, 63], device=DEV)
    got = attention(q, kc, vc, wi, tm, heads)
    assert rel(got, attention_reference(q, kc, vc, wi, tm, heads)) < 1e-5
    for b in range(batch):
        alone = attention(q[b * rows:(b + 1) * rows], kc[b:b + 1], vc[b:b + 1], wi[b:b + 1], tm[b], heads)
        assert torch.equal(got[b * rows:(b + 1) * rows], alone)


TREE = [-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 6, 8]         # a 12-node tree's parents, breadth first


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Each node sees its ancestors and itself."""
    tm = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            tm[i] |= tm[p]
    return tm.to(DEV)


def tree_rows_alone(q, kc, vc, write_index: int, tm, heads: int, cfg: KernelConfig) -> list[torch.Tensor]:
    """Each node's row as plain decoding computes it: alone, at write_index + its depth, its ancestors' keys
    and values copied in depth order to write_index, write_index + 1, ... (where an accepted path goes)."""
    rows = []
    for r in range(tm.shape[0]):
        ancestors = tm[r].nonzero().flatten()
        k2, v2 = kc.clone(), vc.clone()
        k2[:, :, write_index:write_index + len(ancestors)] = kc[:, :, write_index + ancestors]
        v2[:, :, write_index:write_index + len(ancestors)] = vc[:, :, write_index + ancestors]
        wi = torch.tensor([write_index + len(ancestors) - 1], device=DEV)
        rows.append(attention(q[r:r + 1], k2, v2, wi, tm[:1, :1], heads, cfg=cfg)[0])
    return rows


@ROWS_ALIKE
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,write_index", [(8, 2, 60), (6, 2, 100)])
def test_row_invariant_tree_node_is_its_token_decoded_alone(heads, kv_heads, write_index, dtype):
    """KernelConfig.row_invariant: a tree node's row is the bits of its token decoded alone after its
    ancestors, though they sit at scattered slots of the block (each token's keys packed in column order
    onto consecutive positions); without the option the key steps group them otherwise. At write_index 60 the
    ancestors straddle a 64-key step; 6 heads on 2 put a token's heads across two row tiles."""
    torch.manual_seed(write_index)
    d, tm = 64, tree_mask(TREE)
    kc, vc = randn(1, kv_heads, 640, d, dtype=dtype), randn(1, kv_heads, 640, d, dtype=dtype)
    q = randn(len(TREE), heads * d, dtype=dtype)
    wi = torch.tensor([write_index], device=DEV)
    exact = KernelConfig(row_invariant=True)
    got = attention(q, kc, vc, wi, tm, heads, cfg=exact)
    assert rel(got, attention_reference(q, kc, vc, wi, tm, heads)) < TOL[dtype]
    assert all(torch.equal(row, got[r]) for r, row in enumerate(tree_rows_alone(q, kc, vc, write_index, tm, heads,
                                                                                exact)))
    if dtype == torch.float32 and write_index == 60:      # the setup's check: the block's own layout parts
        loose = attention(q, kc, vc, wi, tm, heads)
        assert not all(torch.equal(row, loose[r]) for r, row in enumerate(tree_rows_alone(
            q, kc, vc, write_index, tm, heads, KernelConfig())))


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [60, 3000])
def test_row_invariant_tree_at_qwen3_8b_head_shape(ctx):
    """The same in bf16 on the GPU at the 8B head's shapes (32 heads on 8, d 128, a 4352-slot cache)."""
    torch.manual_seed(ctx)
    tm = tree_mask(TREE)
    kc, vc = randn(1, 8, 4352, 128, dtype=torch.bfloat16), randn(1, 8, 4352, 128, dtype=torch.bfloat16)
    q = randn(len(TREE), 32 * 128, dtype=torch.bfloat16)
    exact = KernelConfig(row_invariant=True)
    got = attention(q, kc, vc, torch.tensor([ctx], device=DEV), tm, 32, cfg=exact)
    assert rel(got, attention_reference(q, kc, vc, torch.tensor([ctx], device=DEV), tm, 32)) < 1e-2
    assert all(torch.equal(row, got[r]) for r, row in enumerate(tree_rows_alone(q, kc, vc, ctx, tm, 32, exact)))
