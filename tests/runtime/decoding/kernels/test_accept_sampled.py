"""Speculative sampling of a chain in two launches (runtime/decoding/kernels/accept_sampled.py) against the torch
rule it replaces (speculative.accept_sampled): from the same stream, the same accepted count, emitted tokens and
stream position, for deterministic drafts (q = None), drafts drawn from q over the target's vocabulary and over a
draft vocabulary (q_ids), with and without top-p / min-p, and with ties at the k-th value (the streamed path).
Exact in Triton's interpreter; compiled, near ties may go the other way (sample.py's note)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from xcompile.runtime.decoding.sampling import Sampler, SamplingParams  # noqa: E402
from xcompile.runtime.decoding.speculative import accept_sampled, chain_block  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def chain(logits: torch.Tensor, q_kind: str, seed: int, vocab_ids: torch.Tensor | None = None):
    """A chain block over ``logits`` [B, S, V]: drafts that the target often accepts (its argmax after the
    previous node, every third one random), with q as ``q_kind`` says (none, full: over the target vocabulary,
    vocab: over the draft vocabulary ``vocab_ids``, every draft inside it)."""
    g = torch.Generator().manual_seed(seed)
    b, s, v = logits.shape
    tokens = torch.zeros(b, s, dtype=torch.int64)
    tokens[:, 1:] = logits[:, :-1].float().argmax(-1).cpu()
    noisy = torch.rand(b, s, generator=g) < 0.34
    tokens = torch.where(noisy, torch.randint(0, v, (b, s), generator=g), tokens)
    block = chain_block(tokens.to(DEV))
    if q_kind == "none":
        return block
    ids = torch.arange(v) if q_kind == "full" else vocab_ids.cpu()
    vq = ids.shape[0]
    q = torch.softmax(torch.randn(b, s, vq, generator=g) * 2, -1)
    cols = torch.multinomial(q.view(-1, vq), 1, generator=g).view(b, s)
    if q_kind == "vocab":                     # the drafts, as target ids, inside the draft vocabulary
        tokens = ids[cols]
        tokens[:, 0] = 0
    else:
        tokens[:, 1:] = cols[:, 1:]
    block = chain_block(tokens.to(DEV))
    block.q, block.q_tok = q.to(DEV), q.gather(2, cols[..., None])[..., 0].to(DEV)
    block.q_ids = vocab_ids if q_kind == "vocab" else None
    return block


def same_draws(blocks, logits, kernel_for, torch_sampler, kernel_sampler) -> list[int]:
    """Each block accepted by the torch rule and by its kernel (``kernel_for(block)``), one after the other from the
    same stream: the same count, path and tokens every time, the counters two draws a block on; the counts."""
    counts = []
    for r, block in enumerate(blocks):
        kernel = kernel_for(block)
        assert kernel.fits(kernel_sampler, block)
        want, got = accept_sampled(block, logits, torch_sampler), kernel(block, logits, kernel_sampler)
        assert torch.equal(got.count, want.count) and torch.equal(got.path, want.path), r
        assert torch.equal(got.tokens, want.tokens), r
        counts += got.count.tolist()
    assert kernel_sampler.counter.tolist() == torch_sampler.counter.tolist() == [2 * len(blocks)] * 2
    return counts


@pytest.mark.parametrize("q_kind", ["none", "full", "vocab"])
@pytest.mark.parametrize("nodes, vocab, k, top_p, min_p, ties", [
    (5, 3000, 20, 0.95, 0.0, False),
    (7, 9000, 5, 1.0, 0.05, False),         # three column blocks
    (3, 300, 32, 0.8, 0.0, False),          # k up to MAX_K
    (5, 2000, 20, 0.9, 0.0, True),          # integer logits: ties at the k-th value, the streamed rows
])
def test_kernel_accepts_as_the_torch_rule(nodes, vocab, k, top_p, min_p, ties, q_kind):
    from xcompile.runtime.decoding.kernels.accept_sampled import SampledChainAccept
    torch.manual_seed(vocab + nodes)
    logits = 2 * torch.randn(2, nodes, vocab, device=DEV)
    logits = (logits.round() if ties else logits).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_k=k, top_p=top_p, min_p=min_p, seed=13)
    torch_sampler, kernel_sampler = Sampler(DEV, 2, fused=False), Sampler(DEV, 2, fused=False)
    torch_sampler.reset(params)
    kernel_sampler.reset(params)
    kernel = SampledChainAccept(2, nodes, torch.device(DEV))
    vocab_ids = torch.randperm(vocab)[: vocab // 2].sort().values.to(DEV)     # the drafter's fixed table
    blocks = [chain(logits, q_kind, r, vocab_ids) for r in range(12)]
    counts = same_draws(blocks, logits, lambda block: kernel, torch_sampler, kernel_sampler)
    assert 0 < sum(counts) < len(counts) * (nodes - 1) or q_kind != "none"   # both outcomes met


def test_the_kernel_takes_chains_with_top_k_only():
    from xcompile.runtime.decoding.kernels.accept_sampled import SampledChainAccept
    block = chain_block(torch.zeros(1, 4, dtype=torch.int64))
    s = Sampler("cpu", 1, fused=False)
    for params, fits in ((SamplingParams(temperature=0.6, top_k=20), True), (SamplingParams(), False),
                         (SamplingParams(temperature=0.6), False), (SamplingParams(temperature=0.6, top_k=64), False)):
        s.reset(params)
        assert SampledChainAccept.fits(s, block) == fits
    s.reset(SamplingParams(temperature=0.6, top_k=20))
    assert not SampledChainAccept.fits(s, chain_block(torch.zeros(1, 1, dtype=torch.int64)))   # plain decoding


@pytest.mark.parametrize("drafter", ["eagle3", "draft", "mtp-vocab", "eagle3-tree"])
def test_a_sampled_round_on_the_kernels_draws_the_torch_rounds_tokens(drafter):
    """The loop with its fused option on verifies sampled chains and trees with top-k on the kernels: the same
    tokens, from the same seed, as the loop on torch's ops; with top-k off, torch's ops. The tiny engines live where
    the kernels run: the GPU where there is one, else the CPU in the interpreter."""
    import tiny_engines as T

    from xcompile.runtime.decoding.generator import Generator, LoopOptions
    from xcompile.runtime.decoding.rounds import FusedSampledVerifier, TorchVerifier
    tiny = T.build(96, device=DEV)
    runs = {}
    for fused in (True, False):
        g = Generator(tiny.target_engine(), T.DRAFTERS[drafter](tiny), [], 96, options=LoopOptions(fused=fused))
        for top_k in (20, 0):
            params = SamplingParams(temperature=0.8, top_k=top_k, top_p=0.95, seed=5)
            runs[fused, top_k] = [g.generate(p, 24, sampling=params).tokens for p in ([3, 4, 5], [9] * 7)]
            kinds = {type(e.round.verifier) for e in g._executors.values() if e.round.drafter is not g.plain}
            want = FusedSampledVerifier if fused and top_k else TorchVerifier
            assert want in kinds
    assert runs[True, 20] == runs[False, 20] and runs[True, 0] == runs[False, 0]


def tree(logits: torch.Tensor, parents: list[int], seed: int):
    """A tree block over ``logits`` [B, S, V] with the given parents: each node's token one of its parent row's
    three largest logits (an EAGLE-2 tree's top-k children: often accepted, siblings sometimes repeating a token),
    or random; q = None (deterministic drafts)."""
    from xcompile.runtime.decoding.speculative import Block, ancestors
    g = torch.Generator().manual_seed(seed)
    b, s, v = logits.shape
    par = torch.tensor(parents)
    top3 = logits.float().topk(3, -1).indices.cpu()                          # [B, S, 3]
    pick = torch.randint(0, 3, (b, s), generator=g)
    tokens = top3[:, par].gather(2, pick[..., None])[..., 0]                   # [B, S]: of the parent's row
    tokens = torch.where(torch.rand(b, s, generator=g) < 0.25, torch.randint(0, v, (b, s), generator=g), tokens)
    tokens[:, 0] = 0
    parents_b = par.expand(b, s).contiguous().to(DEV)
    depth_max = 0
    for i, p in enumerate(parents):
        d, j = 0, i
        while j != 0:
            j, d = parents[j], d + 1
        depth_max = max(depth_max, d)
    mask, depth = ancestors(parents_b, depth_max)
    return Block(tokens.to(DEV), parents_b, mask, depth, depth_max, chain=False)


@pytest.mark.parametrize("parents, vocab, k, top_p, ties", [
    ([0, 0, 0, 1, 1, 2, 3, 3, 6], 3000, 20, 0.95, False),
    ([0, 0, 1, 1, 1, 2, 4, 6, 6, 7, 7, 9], 9000, 5, 1.0, False),
    ([0, 0, 0, 0, 1, 2], 2000, 20, 0.9, True),           # ties at the k-th value: the streamed rows
])
def test_tree_kernel_accepts_as_the_torch_rule(parents, vocab, k, top_p, ties):
    from xcompile.runtime.decoding.kernels.accept_sampled_tree import SampledTreeAccept
    torch.manual_seed(vocab + len(parents))
    logits = 2 * torch.randn(2, len(parents), vocab, device=DEV)
    logits = (logits.round() if ties else logits).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_k=k, top_p=top_p, min_p=0.02, seed=17)
    torch_sampler, kernel_sampler = Sampler(DEV, 2, fused=False), Sampler(DEV, 2, fused=False)
    torch_sampler.reset(params)
    kernel_sampler.reset(params)
    blocks = [tree(logits, parents, r) for r in range(12)]
    counts = same_draws(blocks, logits, lambda block: SampledTreeAccept(2, len(parents), block.max_depth,
                                                                        torch.device(DEV)), torch_sampler, kernel_sampler)
    assert 0 < sum(counts) and min(counts) == 0                # paths accepted and rejected both met
