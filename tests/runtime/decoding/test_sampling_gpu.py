"""Sampling on a CUDA GPU (``gpu`` marker; skipped elsewhere): the same seed gives the same tokens with
and without CUDA graphs, and the sampler's share of a round (a draft draw, chain and tree acceptance)
records into one CUDA graph with no host synchronisation, at Qwen3's vocabulary.

Run on the H200: python3 -m pytest -q -m gpu tests/runtime/test_sampling_gpu.py
"""

from __future__ import annotations

import pytest
import tiny_engines as T
import torch
from tiny_engines import DRAFTERS

from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.sampling import Sampler, SamplingParams
from xcompile.runtime.decoding.speculative import Block, accept_chain, accept_tree, ancestors, chain_block, for_host
from xcompile.runtime.engines.graphs import CudaGraphCapture

pytestmark = pytest.mark.gpu
QWEN3 = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=7)      # Qwen3's generation_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", DRAFTERS)
def test_sampled_tokens_equal_with_and_without_cuda_graphs(name, dtype):
    """Whole-round graphs: the same seed, the same tokens as eager, also when one generator serves greedy and
    sampled requests of different modes in turn (a round graph per mode)."""
    tiny = T.build(512, device="cuda", dtype=dtype)
    make = DRAFTERS[name]
    eager = Generator(tiny.target_engine(), make(tiny), [], 512)
    graphed = Generator(tiny.target_engine(), make(tiny), [], 512, options=LoopOptions(cuda_graphs=True))
    for p in ([5, 6, 7, 8, 9], [40, 3] * 10):
        for params in (QWEN3, SamplingParams(), SamplingParams(temperature=1.0, seed=8)):
            want = eager.generate(p, 64, sampling=params)
            got = graphed.generate(p, 64, sampling=params)
            assert got.tokens == want.tokens
            assert got.stats.accepted_at == want.stats.accepted_at
    assert graphed.graph_fallback is None, graphed.graph_fallback
    assert len(graphed._executors) >= 3                  # greedy and two sampling modes, each recorded


def sampler_round(vocab: int, k: int, tree_tokens: int, params: SamplingParams):
    """A draft draw, a chain of k+1 (q over the vocabulary) and a tree (point masses) accepted, on CUDA."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(dev)
    sampler.reset(params)
    draft_logits = torch.randn(1, vocab, generator=g).to(dev, torch.bfloat16)
    chain = chain_block(torch.randint(0, vocab, (1, k + 1), generator=g).to(dev))
    chain.q = torch.softmax(torch.randn(1, k + 1, vocab, generator=g), -1).to(dev)
    chain.q_tok = chain.q.gather(2, chain.tokens[:, :, None])[:, :, 0]
    chain_logits = torch.randn(1, k + 1, vocab, generator=g).to(dev, torch.bfloat16)
    parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, tree_tokens)]
    par = torch.tensor([parents], device=dev)
    mask, d = ancestors(par, tree_tokens)
    tree = Block(torch.randint(0, vocab, (1, tree_tokens), generator=g).to(dev), par, mask, d, int(d.max()), False)
    tree_logits = torch.randn(1, tree_tokens, vocab, generator=g).to(dev, torch.bfloat16)

    def step():
        return torch.cat((sampler.sample(draft_logits), for_host(accept_chain(chain, chain_logits, sampler))[0],
                          for_host(accept_tree(tree, tree_logits, sampler))[0]))

    return sampler, step


@pytest.mark.parametrize("params", [QWEN3, SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=4)])
def test_a_sampling_round_records_into_one_graph(params):
    sampler, step = sampler_round(151936, 6, 32, params)
    step()                                           # first calls make cached index tensors
    sampler.counter.zero_()
    torch.cuda.set_sync_debug_mode("error")          # any host sync inside the round raises
    try:
        eager = [step().clone() for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    draws = int(sampler.counter) // 3
    replay, out = CudaGraphCapture()(step, torch.device("cuda"))
    sampler.counter.zero_()
    for want in eager:                               # replays advance the device counter like eager calls
        replay()
        assert torch.equal(out, want)
    assert int(sampler.counter) == 3 * draws
