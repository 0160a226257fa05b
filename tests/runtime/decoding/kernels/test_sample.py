"""The two-launch warped draw (runtime/decoding/kernels/sample.py) against the torch sampler it replaces
(runtime/decoding/sampling.py): from the same stream it draws the same tokens. Exact in Triton's interpreter;
compiled, the GPU's exp and log and the sums' order may turn a near tie the other way, which these seeds do
not meet."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from xcompile.runtime.decoding.sampling import Sampler, SamplingParams  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, k, top_p, min_p, ties", [
    (None, 5000, 20, 0.95, 0.0, False),      # plain decoding's [B, V]
    (3, 9000, 5, 1.0, 0.05, False),         # verify rows [B, R, V], three column blocks
    (2, 300, 32, 0.8, 0.0, False),          # k up to MAX_K
    (None, 5000, 20, 0.9, 0.0, True),       # integer logits: ties at the k-th value, the streamed path
    (2, 4500, 1, 1.0, 0.0, True),
])
def test_kernel_draws_the_torch_samplers_tokens(rows, vocab, k, top_p, min_p, ties, dtype):
    """20 draws of batch 2 from the same seed: every token equal, and each row's counter advanced once a draw."""
    from xcompile.runtime.decoding.kernels import sample as S
    torch.manual_seed(vocab + k)
    shape = (2, vocab) if rows is None else (2, rows, vocab)
    logits = (3 * torch.randn(*shape, device=DEV))
    logits = (logits.round() if ties else logits).to(dtype)
    params = SamplingParams(temperature=0.7, top_k=k, top_p=top_p, min_p=min_p, seed=11)
    torch_sampler, kernel_sampler = Sampler(DEV, 2), Sampler(DEV, 2)
    torch_sampler.reset(params)
    kernel_sampler.reset(params)
    for _ in range(20):
        want = torch_sampler.draw(torch_sampler.warp(logits))
        assert torch.equal(S.sample(logits, kernel_sampler), want)
    assert kernel_sampler.counter.tolist() == torch_sampler.counter.tolist() == [20, 20]


@pytest.mark.parametrize("vocab, targets, ties, top_p", [
    (5000, False, False, 0.9),     # a draft model's pick over the target's vocabulary
    (3000, True, False, 1.0),      # an EAGLE3 head's over its draft vocabulary, written as target ids
    (3000, True, True, 0.9),       # integer logits: ties at the k-th value, q's row streamed
])
def test_a_sampled_draft_pick_writes_the_torch_picks_token_and_q(vocab, targets, ties, top_p):
    """Drafter._pick of a sampled chain by the kernels: into column i of a block's buffers (strided), the token
    (mapped to target ids), q's row over the vocabulary and q at the token, as the torch warp, draw and probs make
    them, from the same stream."""
    from xcompile.runtime.decoding.drafters import NoDrafter
    from xcompile.runtime.decoding.speculative import chain_block
    torch.manual_seed(vocab)
    table = (torch.arange(vocab) + torch.randint(0, 40, (vocab,))).to(DEV) if targets else None
    params = SamplingParams(temperature=0.7, top_k=12, top_p=top_p, seed=5)
    picks = {}
    for fused in (True, False):
        d = NoDrafter()
        d.bind(64, torch.device(DEV), batch=2, sampler=Sampler(DEV, 2, fused=fused))
        d.sampler.reset(params)
        block = chain_block(torch.zeros(2, 4, dtype=torch.long, device=DEV))
        gen = torch.Generator().manual_seed(1)
        for i in (1, 2, 3):
            logits = 3 * torch.randn(2, vocab, generator=gen)
            d._pick(block, i, (logits.round() if ties else logits).to(DEV, torch.bfloat16), table)
        picks[fused] = block, d.sampler.counter.tolist()
    (got, got_count), (want, want_count) = picks[True], picks[False]
    assert torch.equal(got.tokens, want.tokens) and got_count == want_count == [3, 3]
    torch.testing.assert_close(got.q, want.q, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.q_tok, want.q_tok, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.q[:, 1:].sum(-1), torch.ones(2, 3, device=DEV))       # each a distribution
    assert got.q_ids is table


@pytest.mark.parametrize("top_k", [20, 0, 50])
def test_a_fused_sampler_samples_by_the_kernels_up_to_max_k(top_k, monkeypatch):
    """Sampler.sample takes the kernels for top-k 1..MAX_K (the torch ops otherwise), the same tokens."""
    from xcompile.runtime.decoding.kernels import sample as S
    calls = []
    kernel = S.sample
    monkeypatch.setattr(S, "sample", lambda *a: calls.append(1) or kernel(*a))
    logits = (3 * torch.randn(2, 3000, device=DEV)).to(torch.bfloat16)
    fused, plain = Sampler(DEV, 2, fused=True), Sampler(DEV, 2, fused=False)
    params = SamplingParams(temperature=0.6, top_k=top_k, top_p=0.95, seed=3)
    fused.reset(params)
    plain.reset(params)
    for _ in range(5):
        assert torch.equal(fused.sample(logits), plain.sample(logits))
    assert len(calls) == (5 if 0 < top_k <= S.MAX_K else 0)


def test_a_plain_sampled_round_draws_the_torch_rounds_tokens():
    """accept_sampled over a root-only block (plain decoding) with a fused sampler: the kernels' draw, the same
    tokens and stream position as the torch rule's (a coin, then the bonus from p)."""
    from xcompile.runtime.decoding.speculative import accept_sampled, chain_block
    logits = (3 * torch.randn(2, 1, 3000, device=DEV)).to(torch.bfloat16)
    block = chain_block(torch.zeros(2, 1, dtype=torch.long, device=DEV))
    fused, plain = Sampler(DEV, 2, fused=True), Sampler(DEV, 2, fused=False)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    fused.reset(params)
    plain.reset(params)
    for _ in range(5):
        got, want = accept_sampled(block, logits, fused), accept_sampled(block, logits, plain)
        assert torch.equal(got.count, want.count) and torch.equal(got.path, want.path)
        assert torch.equal(got.tokens, want.tokens)
    assert fused.counter.tolist() == plain.counter.tolist() == [10, 10]


@pytest.mark.parametrize("fused", [False, True])
def test_the_loops_fused_option_reaches_its_sampler(fused):
    """LoopOptions.fused decides the sampler's kernels too (True: also in the interpreter, False: never). The tiny
    engines live on the CPU, where compiled Triton cannot run: there True means the kernels only in the
    interpreter."""
    import tiny_engines as T

    from xcompile.runtime.common.gpu import interpreted
    from xcompile.runtime.decoding.generator import Generator, LoopOptions
    tiny = T.build(64)
    g = Generator(tiny.target_engine(), T.DRAFTERS["none"](tiny), [], 64, options=LoopOptions(fused=fused))
    assert g.device.type == "cpu"
    assert g.sampler.fused is (fused and interpreted())


@pytest.mark.parametrize("name", ["eagle3", "mtp-vocab", "draft"])
def test_sampled_chains_with_kernel_picks_get_the_torch_loops_tokens(name, monkeypatch):
    """A sampled generation (top-k 8) whose chain drafts are picked by the kernels (over a draft vocabulary mapped
    to target ids, or the target's) and verified by the fused acceptance, against the loop on torch's ops: the same
    tokens from the same seed, and the drafts accepted as often. The tiny engines live where the kernels run: the
    GPU where there is one (compiled Triton takes no CPU tensors), else the CPU in the interpreter."""
    import tiny_engines as T

    from xcompile.runtime.decoding.generator import Generator, LoopOptions
    from xcompile.runtime.decoding.kernels import sample as S
    picks = []
    kernel = S.sample
    monkeypatch.setattr(S, "sample", lambda *a, **kw: picks.append(kw.get("q") is not None) or kernel(*a, **kw))
    tiny = T.build(64, device=DEV)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=4)
    runs = {}
    for fused in (True, False):
        g = Generator(tiny.target_engine(), T.DRAFTERS[name](tiny), [], 64, options=LoopOptions(fused=fused))
        runs[fused] = [g.generate(p, 16, sampling=params) for p in T.random_prompts((5, 11), seed=6)]
    assert [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]]
    assert [r.stats.accepted for r in runs[True]] == [r.stats.accepted for r in runs[False]]
    assert sum(picks) >= 2 * 3      # the fused run's drafts went through the kernel pick (3 a round)
