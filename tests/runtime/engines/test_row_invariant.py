"""Row-invariant decoding (KernelConfig.row_invariant, issue 38): with it, a token's logits are the same bits
whether the fast target computes it alone (a decode step) or as any row of a verify block, so every drafter's
greedy output is plain greedy's bit for bit. On the CPU the kernels run in Triton's interpreter (fp32); on the
GPU in bf16 with the tiny shapes put in the one-row GEMV tables, so that without the option their one-row calls
would take the GEMVs, whose reduction order differs from the tile kernel's."""

from __future__ import annotations

import dataclasses

import pytest
import tiny_engines as T
import torch
from fixtures import step_inputs
from kernel_checks import ROWS_ALIKE

pytest.importorskip("triton", reason="the fast backend needs triton (pip install triton)")

from xcompile.runtime.decoding.drafters import Eagle3TreeDrafter, NoDrafter  # noqa: E402
from xcompile.runtime.decoding.generator import Generator  # noqa: E402
from xcompile.runtime.enginedir.contract import EAGLE3, EAGLE3_FC, TARGET  # noqa: E402
from xcompile.runtime.engines import fast  # noqa: E402
from xcompile.runtime.engines.kernels.config import Gemv, KernelConfig  # noqa: E402

MAX_SEQ_LEN = 96
PROMPT = [5, 9, 11, 20, 33, 7, 2, 40]
CHAIN = [12, 3, 3, 50, 8, 19, 4]            # a root and six drafts, verified as one block
pytestmark = pytest.mark.usefixtures("one_thread")


def cfg(module) -> dict:
    return dataclasses.asdict(module.cfg)


def with_gemvs(module, cfg: KernelConfig) -> KernelConfig:
    """cfg with every projection shape of ``module``'s layers (and its lm_head) in the one-row GEMV table."""
    c = module.cfg
    shapes = [(c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim, c.hidden_size),
              (c.hidden_size, c.num_attention_heads * c.head_dim), (c.intermediate_size, c.hidden_size),
              (c.hidden_size, c.intermediate_size), (c.vocab_size, c.hidden_size)]
    return dataclasses.replace(cfg, tiles=cfg.tiles.replace(gemv={s: Gemv(64, 64, 4) for s in shapes}))


def one_by_one_and_block(tiny, kernels: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of CHAIN's tokens after PROMPT: decoded one at a time, and as one verify block."""
    dev = tiny.target.lm_head.weight.device
    target = fast.FastQwen3Engine(tiny.target_engine(), cfg(tiny.target), T.TAPS, kernels)
    n = len(PROMPT)
    target.new_kv()
    target.run(**step_inputs(torch.tensor([PROMPT], device=dev), 0))
    alone = torch.cat([target.run(**step_inputs(torch.tensor([[t]], device=dev), n + i))["logits"][0]
                       for i, t in enumerate(CHAIN)])
    target.new_kv()
    target.run(**step_inputs(torch.tensor([PROMPT], device=dev), 0))
    block = target.run(**step_inputs(torch.tensor([CHAIN], device=dev), n))["logits"][0]
    return alone, block


@ROWS_ALIKE
def test_a_token_alone_is_the_same_bits_as_in_a_verify_block():
    tiny = T.build(MAX_SEQ_LEN, head_dim=16)
    alone, block = one_by_one_and_block(tiny, with_gemvs(tiny.target, KernelConfig(row_invariant=True)))
    assert torch.equal(alone, block)
    # the setup's check: without the option the one-row calls take the GEMVs, whose sums round otherwise
    alone, block = one_by_one_and_block(tiny, with_gemvs(tiny.target, KernelConfig()))
    assert not torch.equal(alone, block) and torch.allclose(alone, block, atol=1e-4)


def test_only_the_target_takes_it():
    """The drafters' engines keep the one-row GEMVs: their proposals are verified, never emitted as they are."""
    tiny = T.build(MAX_SEQ_LEN, head_dim=16)
    e3, fc = tiny.eagle3_engines()
    configs = {TARGET: cfg(tiny.target), EAGLE3: cfg(tiny.eagle3), EAGLE3_FC: cfg(tiny.eagle3)}
    engines = fast.wrap({TARGET: tiny.target_engine(), EAGLE3: e3, EAGLE3_FC: fc}, configs, T.TAPS,
                        KernelConfig(row_invariant=True))
    assert engines[TARGET].kernels.row_invariant
    assert not engines[EAGLE3].kernels.row_invariant and not engines[EAGLE3_FC].kernels.row_invariant


@pytest.mark.gpu
def test_row_invariant_bf16_on_the_gpu_and_a_tree_is_plain_greedy():
    """bf16, compiled kernels, the tiny shapes on the GEMVs: a token alone and in a block agree bit for bit with
    the option, and an EAGLE3 tree's greedy output is plain greedy's on the same engine."""
    tiny = T.build(MAX_SEQ_LEN, device="cuda", dtype=torch.bfloat16, head_dim=16)
    kernels = with_gemvs(tiny.target, KernelConfig(row_invariant=True))
    alone, block = one_by_one_and_block(tiny, kernels)
    assert torch.equal(alone, block)
    target = fast.FastQwen3Engine(tiny.target_engine(), cfg(tiny.target), T.TAPS, kernels)
    e3, fc = tiny.eagle3_engines()
    tree = Eagle3TreeDrafter(fast.FastEagle3Engine(e3, cfg(tiny.eagle3)),
                             fast.FastFCEngine(fc, cfg(tiny.eagle3)), tiny.d2t, 4, 4, 16)
    for prompt in T.random_prompts((3, 9, 17, 30), seed=11):
        want = Generator(target, NoDrafter(), [], MAX_SEQ_LEN).generate(prompt, 40).tokens
        assert Generator(target, tree, [], MAX_SEQ_LEN).generate(prompt, 40).tokens == want
