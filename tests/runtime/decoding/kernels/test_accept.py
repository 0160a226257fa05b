"""Greedy chain verification, the round's state update and a drafter's greedy pick in one launch each
(runtime/decoding/kernels/accept.py) against speculative.accept_chain / bonus / argmax, exactly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")


DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,vocab", [(1, 1000), (1, 9000), (7, 8192), (5, 4097), (64, 300)])
def test_chain_accept_kernel_equals_accept_chain(s, vocab, dtype):
    """One launch gives accept_chain's count, path and tokens and for_host's row
    exactly, over several column blocks, for every accepted count 0..s-1 (the drafts are the target's
    argmax up to a chosen node), with ties (bf16 logits of few values: the lower column wins, as in
    torch.argmax); the state update then gives bonus() and the advanced length. Twice per count: the
    arrival counter resets itself."""
    from xcompile.runtime.decoding.kernels.accept import ChainAccept
    from xcompile.runtime.decoding.speculative import accept_chain, bonus, chain_block, for_host
    torch.manual_seed(s * vocab)
    logits = (torch.randn(1, s, vocab, device=DEV) * 2).round().to(dtype)     # few values: many ties
    pred = logits.argmax(-1)
    fused = ChainAccept(s, vocab, DEV)
    for a in range(s):
        tokens = torch.cat((torch.tensor([[3]], device=DEV), pred[:, :s - 1]), dim=1)
        if a < s - 1:
            tokens[0, a + 1] = (pred[0, a] + 1) % vocab                         # draft a+1 misses
        block = chain_block(tokens)
        want = accept_chain(block, logits)
        for _ in range(2):
            root, length = torch.tensor([5], device=DEV), torch.tensor([40], device=DEV)
            got = fused(tokens, logits)
            assert got.count.tolist() == want.count.tolist() == [a]
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.path, want.path)
            assert torch.equal(fused.host, for_host(want))
            fused.advance(root, length)
            assert root.tolist() == bonus(want).tolist() and length.tolist() == [40 + a + 1]


def test_chain_accept_kernel_with_special_logits():
    """-inf everywhere gives column 0 (torch.argmax's pick); a whole column block of -inf, a +inf and a lone
    NaN are each found in whichever block holds them, as torch.argmax finds them; a NaN counts as +inf, so
    a +inf before it wins (torch would pick the NaN)."""
    from xcompile.runtime.decoding.kernels.accept import ChainAccept
    from xcompile.runtime.decoding.speculative import accept_chain, chain_block
    x = torch.randn(1, 5, 9000, device=DEV)
    x[0, 0] = float("-inf")
    x[0, 1, :4096] = float("-inf")
    x[0, 2, 7000] = float("inf")
    x[0, 3, 5000] = float("nan")
    x[0, 4, 8999], x[0, 4, 8000] = float("nan"), float("inf")
    tokens = torch.zeros(1, 5, dtype=torch.int64, device=DEV)
    got = ChainAccept(5, 9000, DEV)(tokens, x).tokens[0].tolist()
    assert got[:4] == accept_chain(chain_block(tokens), x).tokens[0, :4].tolist() == \
        [0, x[0, 1].argmax().item(), 7000, 5000]
    assert got[4] == 8000


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [300, 4096, 9000, 32000])
@pytest.mark.parametrize("mapped", [False, True])
def test_greedy_pick_kernel_equals_argmax_then_lookup(vocab, mapped, dtype):
    """The pick kernel: to_target(logits.argmax(-1), targets) written into a column of a block's
    tokens (the others untouched), with ties (the lower column), several times in a row (the counter
    resets itself)."""
    from xcompile.runtime.decoding.draft_tree import target_table, to_target
    from xcompile.runtime.decoding.kernels.accept import GreedyPick
    torch.manual_seed(vocab)
    targets = target_table(torch.randperm(3 * vocab, device=DEV)[:vocab].sort().values - torch.arange(vocab, device=DEV)) \
        if mapped else None
    pick = GreedyPick(vocab, DEV)
    tokens = torch.full((1, 5), -7, dtype=torch.int64, device=DEV)
    for i in range(1, 5):
        logits = (torch.randn(1, vocab, device=DEV) * 2).round().to(dtype)          # few values: ties
        if i == 4 and vocab > 4096:
            logits[0, [vocab - 1, 4096, 4100]] = 20.0                                # tied across column blocks
        pick(logits, targets, tokens[:, i])
        want = to_target(logits.argmax(-1), targets)
        assert tokens[0, i].item() == want.item()
        assert tokens[0, 0].item() == -7 and (tokens[0, i + 1:] == -7).all()        # only column i written
    if vocab > 4096:
        assert tokens[0, 4].item() == to_target(torch.tensor([4096], device=DEV), targets).item()


@pytest.mark.gpu
def test_chain_accept_kernel_at_the_qwen3_8b_vocab_on_the_gpu():
    """The fused chain verification at Qwen3's 151936-token vocabulary in bf16: plain decode (1 node), a
    gamma-6 chain (7) and a 32-node chain, every accepted count; the greedy pick at the EAGLE3 head's 32000
    and Qwen3's vocabulary."""
    for s in (1, 7, 32):
        test_chain_accept_kernel_equals_accept_chain(s, 151936, torch.bfloat16)
    for vocab in (32000, 151936):
        test_greedy_pick_kernel_equals_argmax_then_lookup(vocab, vocab == 32000, torch.bfloat16)
    # rounds back to back (programmatic dependent launch between them, no sync): each verifies a chain whose
    # first drafts match the argmax, the state update chained through root and length
    from xcompile.runtime.decoding.kernels.accept import ChainAccept
    logits = torch.randn(1, 7, 151936, device=DEV).to(torch.bfloat16)
    pred = logits.argmax(-1)
    fused = ChainAccept(7, 151936, DEV)
    chains = [torch.cat((torch.tensor([[3]], device=DEV), pred[:, :6]), dim=1) for _ in range(6)]
    for a, t in enumerate(chains[:-1]):
        t[0, a + 1] += 1                                                         # accept a drafts (0..4)
    root, length, hosts = torch.tensor([5], device=DEV), torch.tensor([40], device=DEV), []
    for t in chains * 5:
        fused(t, logits)
        fused.advance(root, length)
        hosts.append(fused.host.clone())
    counts = [0, 1, 2, 3, 4, 6]                                                  # the last chain: every draft
    assert [h[0, 0].item() for h in hosts] == counts * 5
    assert length.item() == 40 + 5 * sum(a + 1 for a in counts) and root.item() == pred[0, 6].item()
