"""The ``fast`` backend (runtime/engines/fast.py): fused-kernel engines against the torch reference engines.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py), on tiny fp32 models whose
head_dim is 16 (the attention tile's minimum): every step's outputs and KV writes match the reference
modules to fp32 rounding, and generation is token-exact against plain greedy decoding for every
drafter. The interpreter is slow (about a second per target step), so generations here are short.
"""

from __future__ import annotations

import dataclasses

import pytest
import tiny_engines as T
import torch
from fixtures import step_inputs

pytest.importorskip("triton", reason="the fast backend needs triton (pip install triton)")

from xcompile.compile.config import Yarn  # noqa: E402
from xcompile.compile.models.layers import Rotary  # noqa: E402
from xcompile.compile.reference import eagle3_engines, qwen3_engine, torch_engines  # noqa: E402
from xcompile.runtime.common.errors import EngineError  # noqa: E402
from xcompile.runtime.decoding.batch import BatchGenerator  # noqa: E402
from xcompile.runtime.decoding.batch_drafts import BatchDrafts  # noqa: E402
from xcompile.runtime.decoding.drafters import (  # noqa: E402
    DraftModelDrafter,
    Eagle3ChainDrafter,
    Eagle3TreeDrafter,
    MTPChainDrafter,
    MTPTreeDrafter,
    NoDrafter,
)
from xcompile.runtime.decoding.generator import Generator, LoopOptions  # noqa: E402
from xcompile.runtime.enginedir.contract import DRAFT, EAGLE3, EAGLE3_FC, MTP, TARGET  # noqa: E402
from xcompile.runtime.engines import fast  # noqa: E402

MAX_SEQ_LEN = 96
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN, head_dim=16)


def cfg(module) -> dict:
    return dataclasses.asdict(module.cfg)


def fast_target(tiny, shared_head: bool = False):
    return fast.FastQwen3Engine(tiny.target_engine(), cfg(tiny.target), T.TAPS, shared_head=shared_head)


def fast_eagle3(tiny):
    e3, fc = tiny.eagle3_engines()
    return fast.FastEagle3Engine(e3, cfg(tiny.eagle3)), fast.FastFCEngine(fc, cfg(tiny.eagle3))


def tree_inputs(tokens: list[int], parents: list[int], start: int) -> dict[str, torch.Tensor]:
    """Verify inputs of a tree (node i under parents[i]; node 0 the root) written at ``start``."""
    s = len(tokens)
    mask = torch.eye(s, dtype=torch.bool)
    depth = [0] * s
    for i in range(1, s):
        mask[i] |= mask[parents[i]]
        depth[i] = depth[parents[i]] + 1
    return dict(input_ids=torch.tensor([tokens]), position_ids=start + torch.tensor([depth]),
                write_index=torch.tensor([start]), tree_mask=mask[None], logit_rows=torch.arange(s)[None])


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item() < tol


def test_a_prompt_of_two_short_steps_runs_on_the_kernels(tiny, monkeypatch):
    """drafters.prompt_pass (SHORT_STEPS): a 90-token prompt runs as steps of 64 and 26 rows on the kernels, never
    on the reference module, and gives the reference's whole-pass logits and taps; the EAGLE3 fc takes 90 rows of
    taps on the kernel too (two calls), the reference's values."""
    from xcompile.runtime.decoding.drafters import base

    ref, got = tiny.target_engine(), fast_target(tiny)
    ref.new_kv()
    got.new_kv()
    prompt = torch.tensor([T.random_prompts((90,), seed=7)[0]])
    long_calls, steps = [], []
    ref_run, step = got.reference.run, got._step
    monkeypatch.setattr(got.reference, "run", lambda **i: long_calls.append(i) or ref_run(**i))
    monkeypatch.setattr(got, "_step", lambda ids, *a: steps.append(ids.shape[0]) or step(ids, *a))
    out, last, taps = base.prompt_pass(got, prompt, keep="hidden_taps")
    want, want_last, want_taps = base.prompt_pass(ref, prompt, keep="hidden_taps")
    assert not long_calls and steps == [64, 26] and last.tolist() == [25] and want_last.tolist() == [89]
    assert close(out["logits"], want["logits"]) and close(taps, want_taps)
    _, fc = fast_eagle3(tiny)
    fc_run = fc.reference.run
    monkeypatch.setattr(fc.reference, "run", lambda **i: long_calls.append(i) or fc_run(**i))
    got_fc = fc.run(hidden_taps=taps)["hidden_states"]
    assert not long_calls and close(got_fc, fc_run(hidden_taps=taps)["hidden_states"])


def test_target_steps_and_kv_match_the_reference(tiny):
    ref, got = tiny.target_engine(), fast_target(tiny)
    ref.new_kv()
    got.new_kv()
    steps = [step_inputs(torch.tensor([[5, 9, 11, 20, 33]]), 0),                  # prompt (fused: 5 rows)
             step_inputs(torch.tensor([[7]]), 5),                                 # decode
             step_inputs(torch.tensor([[8, 1, 2, 40]]), 6),                       # chain verify
             tree_inputs([3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 3], 10)]             # tree verify
    for inputs in steps:
        want, have = ref.run(**inputs), got.run(**inputs)
        assert close(have["logits"], want["logits"]) and close(have["hidden_taps"], want["hidden_taps"])
    for a, b in zip(got.kv, ref.kv):
        assert close(a[:, :, :16], b[:, :, :16])


def test_norm_weights_are_folded_and_row_sums_replace_the_norm_launches(monkeypatch):
    """The fast engines fold each RMSNorm weight into the weights it feeds (qkv, gate/up, an untied lm_head)
    and make it ones, for the reference module too; the steps match an unfolded copy of the model. In steps
    of several rows the only norm launch left is the lm_head's: the others take the row sums the embedding
    and the o / down projections leave. The EAGLE3 step too (its gate/up and lm_head norms folded)."""
    import copy

    from xcompile.runtime.engines.kernels import linear as L
    tiny = T.build(MAX_SEQ_LEN, head_dim=16)
    unfolded = qwen3_engine(copy.deepcopy(tiny.target))
    got = fast_target(tiny)
    names = dict(tiny.target.named_parameters())
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in names.items()
               if n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) or n == "model.norm.weight")
    assert all(layer.ln1 is got.sums.unit and layer.ln2 is got.sums.unit for layer in got.layers)
    launches = []
    norm = L.rms_norm
    monkeypatch.setattr(L, "rms_norm", lambda *a, **kw: launches.append(1) or norm(*a, **kw))
    unfolded.new_kv()
    got.new_kv()
    inputs = step_inputs(torch.tensor([[8, 1, 2, 40]]), 0)
    have, want = got.run(**inputs), unfolded.run(**inputs)
    assert close(have["logits"], want["logits"]) and close(have["hidden_taps"], want["hidden_taps"])
    assert len(launches) == 1
    ref = eagle3_engines(copy.deepcopy(tiny.eagle3), MAX_SEQ_LEN)[0]
    e3 = fast_eagle3(tiny)[0]
    assert torch.equal(tiny.eagle3.norm.weight, torch.ones_like(tiny.eagle3.norm.weight))
    ref.new_kv()
    e3.new_kv()
    hidden = torch.randn(1, 4, T.EAGLE3_CFG.hidden_size)
    want, have = ref.run(hidden_states=hidden, **inputs), e3.run(hidden_states=hidden, **inputs)
    assert close(have["logits"], want["logits"]) and close(have["hidden_out"], want["hidden_out"])


@pytest.mark.parametrize("which", ["tied draft", "eagle3 norm_before_residual"])
def test_folding_keeps_the_function_of_the_other_models(which):
    """The draft model ties lm_head to its embedding (only its layers' norms fold; the embedding and the final
    norm stay as they were); a speculators-format EAGLE3 head adds hidden_norm(hidden) to the attention
    output (its hidden_norm does not fold). Each fast engine's steps match an unfolded copy of its model."""
    import copy
    tiny = T.build(MAX_SEQ_LEN, head_dim=16)
    inputs = step_inputs(torch.tensor([[8, 1, 2, 40]]), 0)
    if which == "tied draft":
        embed, norm = tiny.draft.model.embed_tokens.weight.clone(), tiny.draft.model.norm.weight.clone()
        ref = qwen3_engine(copy.deepcopy(tiny.draft), DRAFT)
        got = fast.FastQwen3Engine(tiny.draft_engine(), cfg(tiny.draft))
        assert torch.equal(tiny.draft.model.embed_tokens.weight, embed) and torch.equal(tiny.draft.model.norm.weight, norm)
        extra, keys = {}, ("logits",)
    else:
        tiny.eagle3.midlayer.norm_before_residual = True
        ref = eagle3_engines(copy.deepcopy(tiny.eagle3), MAX_SEQ_LEN)[0]
        got = fast.FastEagle3Engine(tiny.eagle3_engines()[0], {**cfg(tiny.eagle3), "norm_before_residual": True})
        extra, keys = {"hidden_states": torch.randn(1, 4, T.EAGLE3_CFG.hidden_size)}, ("logits", "hidden_out")
    ref.new_kv()
    got.new_kv()
    want, have = ref.run(**inputs, **extra), got.run(**inputs, **extra)
    assert all(close(have[k], want[k]) for k in keys)


def test_long_passes_run_the_reference(tiny):
    ref, got = tiny.target_engine(), fast_target(tiny)
    ref.new_kv()
    got.new_kv()
    prompt = step_inputs(torch.arange(70)[None] % T.VOCAB, 0)                    # > MAX_ROWS tokens
    assert torch.equal(got.run(**prompt)["logits"], ref.run(**prompt)["logits"])


def batch_step(wi: list[int], tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """A batch loop's step: len(wi) sequences of ``tokens`` new tokens, sequence b written at wi[b] in cache row b,
    each under its own causal mask, the logits of its last two rows (or its only one)."""
    g = torch.Generator().manual_seed(seed)
    b = len(wi)
    ids = torch.randint(0, T.VOCAB, (b, tokens), generator=g)
    positions = torch.tensor(wi)[:, None] + torch.arange(tokens)
    rows = torch.arange(max(0, tokens - 2), tokens).expand(b, -1)
    inputs = step_inputs(ids, 0, positions=positions, rows=rows)
    return {**inputs, "write_index": torch.tensor(wi)}


def test_batch_steps_of_several_sequences_match_the_reference(tiny, monkeypatch):
    """Steps of the continuous-batching loop (runtime/decoding/batch.py): B sequences each at its own KV length in
    its own cache row, on the kernels while the B*S rows fit MAX_ROWS, and past that as a wide step (cuBLAS
    projections, the step's attention kernels), never on the reference. Logits, taps and every cache row match
    the torch engine's batched step."""
    ref = qwen3_engine(tiny.target, max_seq_len=MAX_SEQ_LEN, batch=4)
    got = fast.FastQwen3Engine(qwen3_engine(tiny.target, max_seq_len=MAX_SEQ_LEN, batch=4), cfg(tiny.target), T.TAPS)
    assert got.wide
    monkeypatch.setattr(got.reference, "run", lambda **_: pytest.fail("a batch step ran on the reference"))
    ref.new_kv()
    got.new_kv()
    steps = [batch_step([0, 0, 0, 0], 20, 1),             # 80 rows: prompt chunks, a wide step
             batch_step([20, 20, 20, 20], 1, 2),          # decode rows of 4 sequences
             batch_step([21, 21, 21, 21], 3, 3),          # a chunk each (12 rows)
             batch_step([24, 24, 24, 24], 1, 4)]
    for inputs in steps:
        want, have = ref.run(**inputs), got.run(**inputs)
        assert close(have["logits"], want["logits"]) and close(have["hidden_taps"], want["hidden_taps"])
    uneven = batch_step([25, 7, 25, 13], 2, 5)          # the loop's sequences stand at different lengths
    want, have = ref.run(**uneven), got.run(**uneven)
    assert have["logits"].shape == want["logits"].shape == (4, 2, T.VOCAB)
    assert close(have["logits"], want["logits"]) and close(have["hidden_taps"], want["hidden_taps"])
    for a, b in zip(got.kv, ref.kv):
        assert close(a[:, :, :27], b[:, :, :27])


def test_batch_loop_on_the_fast_backend_gives_each_sequence_its_tokens_alone(tiny):
    """The continuous-batching loop over a fast target (4 slots, 6 prompts of 1..40 tokens, chunks of 8): every
    sequence gets the greedy tokens the batch-1 Generator gives it alone on the torch reference."""
    prompts = T.random_prompts((1, 7, 19, 40, 3, 9), seed=5)
    alone = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN)
    want = [alone.generate(p, 12).tokens for p in prompts]
    target = fast.FastQwen3Engine(qwen3_engine(tiny.target, max_seq_len=MAX_SEQ_LEN, batch=4), cfg(tiny.target),
                                  T.TAPS)
    batch = BatchGenerator(target, [], MAX_SEQ_LEN, chunk=8)
    assert [r.tokens for r in batch.generate([(p, 12) for p in prompts])] == want
    assert batch.stats.rows_used[3] > 0


@pytest.mark.parametrize("graph", [EAGLE3, MTP])
def test_head_steps_of_several_sequences_match_the_reference(tiny, graph, monkeypatch):
    """The batch loop's drafts (runtime/decoding/batch_drafts.py): the EAGLE3 head with its fc, and the MTP
    module, take B sequences a step on the kernels, each at its own write_index in its own cache row (the EAGLE3
    step past MAX_ROWS rows as a wide step); logits, hidden_out and every cache row match the reference's batched
    step."""
    module = tiny.eagle3 if graph == EAGLE3 else tiny.mtp
    ref = torch_engines(module, graph, MAX_SEQ_LEN, batch=4)
    kind = {EAGLE3: fast.FastEagle3Engine, MTP: fast.FastMTPEngine}[graph]
    got = kind(torch_engines(module, graph, MAX_SEQ_LEN, batch=4)[graph], cfg(module))
    ref[graph].new_kv()
    got.new_kv()
    width = 3 * T.EAGLE3_CFG.target_hidden_size if graph == EAGLE3 else tiny.mtp.cfg.hidden_size
    if graph == EAGLE3:         # its 80-row step below is a wide one (cuBLAS projections), not the reference's
        monkeypatch.setattr(got.reference, "run", lambda **_: pytest.fail("a head step ran on the reference"))
    for wi, n, seed in (([0, 0, 0, 0], 6, 1), ([6, 3, 6, 1], 3, 2), ([9, 6, 9, 4], 1, 3), ([10, 7, 10, 5], 20, 4)):
        inputs = batch_step(wi, n, seed)
        taps = torch.randn(4, n, width, generator=torch.Generator().manual_seed(seed))
        if graph == EAGLE3:
            fc = fast.FastFCEngine(ref[EAGLE3_FC], cfg(module))
            hidden = ref[EAGLE3_FC].run(hidden_taps=taps)["hidden_states"]
            assert close(fc.run(hidden_taps=taps)["hidden_states"], hidden)
        else:
            hidden = taps
        want, have = ref[graph].run(hidden_states=hidden, **inputs), got.run(hidden_states=hidden, **inputs)
        assert have["logits"].shape == want["logits"].shape and close(have["logits"], want["logits"])
        assert close(have["hidden_out"], want["hidden_out"])
    for a, b in zip(got.kv, ref[graph].kv):
        assert close(a[:, :, :30], b[:, :, :30])


def test_batch_loop_verifies_chains_on_the_fast_backend(tiny):
    """The batch loop's steps with drafts on fast engines (4 slots, an EAGLE3 chain of 2 for every greedy row):
    every sequence gets plain greedy's tokens, drafts were verified in the batch steps."""
    prompts = T.random_prompts((1, 7, 19, 3, 9), seed=6)
    alone = Generator(tiny.target_engine(), NoDrafter(), [], MAX_SEQ_LEN)
    want = [alone.generate(p, 8).tokens for p in prompts]
    target = fast.FastQwen3Engine(qwen3_engine(tiny.target, max_seq_len=MAX_SEQ_LEN, batch=4), cfg(tiny.target),
                                  T.TAPS)
    heads = torch_engines(tiny.eagle3, EAGLE3, MAX_SEQ_LEN, batch=4)
    e3, fc = heads[EAGLE3], heads[EAGLE3_FC]
    head = Eagle3ChainDrafter(fast.FastEagle3Engine(e3, cfg(tiny.eagle3)), fast.FastFCEngine(fc, cfg(tiny.eagle3)),
                              tiny.d2t, 2)
    batch = BatchGenerator(target, [], MAX_SEQ_LEN, chunk=8, drafts=BatchDrafts(head, 4, MAX_SEQ_LEN, target.device))
    results = batch.generate([(p, 8) for p in prompts])
    assert [r.tokens for r in results] == want and sum(r.stats.drafted for r in results) > 0

def test_eagle3_steps_match_the_reference(tiny):
    (ref, ref_fc), (got, got_fc) = tiny.eagle3_engines(), fast_eagle3(tiny)
    ref.new_kv()
    got.new_kv()
    taps = torch.randn(1, 5, 3 * T.EAGLE3_CFG.target_hidden_size)
    assert close(got_fc.run(hidden_taps=taps)["hidden_states"], ref_fc.run(hidden_taps=taps)["hidden_states"])
    hidden = ref_fc.run(hidden_taps=taps)["hidden_states"]
    for inputs in (step_inputs(torch.tensor([[5, 9, 11, 20, 33]]), 0), tree_inputs([3, 4, 5, 6], [0, 0, 1, 1], 5)):
        n = inputs["input_ids"].shape[1]
        want = ref.run(hidden_states=hidden[:, :n], **inputs)
        have = got.run(hidden_states=hidden[:, :n], **inputs)
        assert close(have["logits"], want["logits"]) and close(have["hidden_out"], want["hidden_out"])


@pytest.mark.parametrize("vocab", [False, True], ids=["whole-vocab", "draft-vocab"])
def test_mtp_steps_match_the_reference_and_the_shared_head_is_left_alone(vocab):
    """The MTP step (embedding + both norms, eh_proj, a Qwen3 layer, the target's head) against the module, for
    a prompt pass, one row (the GEMV) and a tree; wrapped with it, the target does not fold its final norm into
    the lm_head both share, so neither the head nor the target's norm changes. With a draft vocabulary the
    module's head is its own copy of those rows: the target folds its norm as it does alone, the module its own."""
    tiny = T.build(MAX_SEQ_LEN, head_dim=16)
    head, norm = tiny.target.lm_head.weight.clone(), tiny.target.model.norm.weight.clone()
    engines = fast.wrap({TARGET: tiny.target_engine(), MTP: tiny.mtp_engine(vocab)},
                        {TARGET: cfg(tiny.target), MTP: cfg(tiny.mtp)}, list(T.TAPS))
    kept = torch.equal(tiny.target.lm_head.weight, head) and torch.equal(tiny.target.model.norm.weight, norm)
    assert kept != vocab
    module = tiny.mtp_vocab if vocab else tiny.mtp          # its own rows take its norm folded in
    assert torch.equal(module.shared_head.norm.weight, torch.ones_like(module.shared_head.norm.weight)) == vocab
    ref, got = tiny.mtp_engine(vocab), engines[MTP]
    ref.new_kv()
    got.new_kv()
    hidden = torch.randn(1, 5, T.TARGET_CFG.hidden_size)
    for inputs in (step_inputs(torch.tensor([[5, 9, 11, 20, 33]]), 0), step_inputs(torch.tensor([[8]]), 5),
                   tree_inputs([3, 4, 5, 6], [0, 0, 1, 1], 6)):
        n = inputs["input_ids"].shape[1]
        want = ref.run(hidden_states=hidden[:, :n], **inputs)
        have = got.run(hidden_states=hidden[:, :n], **inputs)
        assert have["logits"].shape[-1] == (T.DRAFT_VOCAB if vocab else T.VOCAB)
        assert close(have["logits"], want["logits"]) and close(have["hidden_out"], want["hidden_out"])
    assert all(close(a, b) for a, b in zip(got.kv, ref.kv))
    prompt = [5, 9, 11, 20, 33, 7]
    r = Generator(engines[TARGET], MTPChainDrafter(got, 3, T.MTP_COLUMNS, d2t=tiny.d2t if vocab else None), [],
                  MAX_SEQ_LEN, options=LoopOptions(debug=True)).generate(prompt, 8)
    assert r.tokens == T.greedy_reference(tiny.target, prompt, 8)


def test_eagle3_norm_before_residual_matches_the_reference():
    """speculators-format heads add hidden_norm(hidden), not the hidden, to the attention output."""
    import copy
    tiny = T.build(MAX_SEQ_LEN, head_dim=16)
    tiny.eagle3.midlayer.norm_before_residual = True
    config = {**cfg(tiny.eagle3), "norm_before_residual": True}
    ref = tiny.eagle3_engines()[0]
    got = fast.FastEagle3Engine(tiny.eagle3_engines()[0], config)
    # the rule ignored, on a copy of the head (a fast engine folds the norms of the module it is given)
    plain = fast.FastEagle3Engine(eagle3_engines(copy.deepcopy(tiny.eagle3), MAX_SEQ_LEN)[0], cfg(tiny.eagle3))
    ref.new_kv()
    got.new_kv()
    hidden = torch.randn(1, 5, T.EAGLE3_CFG.hidden_size)
    inputs = step_inputs(torch.tensor([[5, 9, 11, 20, 33]]), 0)
    plain.new_kv()
    want, have = ref.run(hidden_states=hidden, **inputs), got.run(hidden_states=hidden, **inputs)
    assert close(have["hidden_out"], want["hidden_out"]) and close(have["logits"], want["logits"])
    assert not close(plain.run(hidden_states=hidden, **inputs)["hidden_out"], want["hidden_out"], 1e-2)


def test_yarn_models_run_their_scaled_tables_past_the_trained_window():
    """YaRN reaches the kernels through the reference modules' cos/sin tables: steps past the trained window
    (8 positions here) match the reference, and EAGLE3 chain generation equals plain greedy decoding."""
    tiny = T.build(MAX_SEQ_LEN, head_dim=16, rope_scaling=Yarn(factor=4.0, original_max_position_embeddings=8))
    ref, got = tiny.target_engine(), fast_target(tiny)
    plain = Rotary(16, MAX_SEQ_LEN, T.TARGET_CFG.rope_theta)
    assert torch.equal(got.rope[0], tiny.target.model.rotary.cos) and not torch.allclose(got.rope[0], plain.cos)
    ref.new_kv()
    got.new_kv()
    for inputs in (step_inputs(torch.tensor([[5, 9, 11, 20, 33, 7, 2, 40, 41, 60]]), 0),     # positions 0..9
                   step_inputs(torch.tensor([[7]]), 10), tree_inputs([3, 4, 5, 6], [0, 0, 1, 1], 11)):
        want, have = ref.run(**inputs), got.run(**inputs)
        assert close(have["logits"], want["logits"]) and close(have["hidden_taps"], want["hidden_taps"])
    prompt = [5, 9, 11, 20, 33, 7]
    r = Generator(fast_target(tiny), Eagle3ChainDrafter(*fast_eagle3(tiny), tiny.d2t, 3), [], MAX_SEQ_LEN,
                  options=LoopOptions(debug=True)).generate(prompt, 10)
    assert r.tokens == T.greedy_reference(tiny.target, prompt, 10)                         # positions up to 15


DRAFTERS = {
    "none": lambda t: NoDrafter(),
    "eagle3": lambda t: Eagle3ChainDrafter(*fast_eagle3(t), t.d2t, 3),
    "eagle3-tree": lambda t: Eagle3TreeDrafter(*fast_eagle3(t), t.d2t, 2, 3, 6),
    "eagle3-tree-kernels": lambda t: Eagle3TreeDrafter(*fast_eagle3(t), t.d2t, 2, 3, 6, fused=True),
    "mtp": lambda t: MTPChainDrafter(fast.FastMTPEngine(t.mtp_engine(), cfg(t.mtp)), 3, T.MTP_COLUMNS),
    "mtp-tree": lambda t: MTPTreeDrafter(fast.FastMTPEngine(t.mtp_engine(), cfg(t.mtp)), 2, 3, 6,
                                         columns=T.MTP_COLUMNS),
    "draft-model": lambda t: DraftModelDrafter(fast.FastQwen3Engine(T.Tiny.draft_engine(t), cfg(t.draft)), 3),
    "self-draft": lambda t: DraftModelDrafter(fast.FastQwen3Engine(t.self_draft_engine(), cfg(t.target)), 3),
}


@pytest.mark.parametrize("name", DRAFTERS)
def test_fast_generation_equals_plain_greedy(name, tiny):
    prompt = [5, 9, 11, 20, 33, 7]
    mtp = name.startswith("mtp")
    if mtp:         # a fresh pair: the module's head is the target's lm_head, which no fast target has folded
        tiny = T.build(MAX_SEQ_LEN, head_dim=16)
    want = T.greedy_reference(tiny.target, prompt, 8)
    r = Generator(fast_target(tiny, shared_head=mtp), DRAFTERS[name](tiny), [], MAX_SEQ_LEN,
                  options=LoopOptions(debug=True)).generate(prompt, 8)
    assert r.tokens == want
    if name == "self-draft":                                                     # always right: full acceptance
        assert r.stats.accepted == r.stats.drafted


def test_fast_refuses_what_its_kernels_cannot_run(tiny, monkeypatch):
    with pytest.raises(EngineError, match="head_dim 8"):
        fast.FastQwen3Engine(T.build(MAX_SEQ_LEN).target_engine(), cfg(T.build(MAX_SEQ_LEN).target), T.TAPS)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(EngineError, match="CUDA device"):
        fast_target(tiny)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["none", "eagle3", "eagle3-tree", "draft-model"])
def test_fast_round_graphs_equal_eager_on_the_gpu(name):
    """bf16 on the GPU: whole-round CUDA graphs give the eager fast path's tokens; both equal plain greedy
    on the same fast engines (row-invariant kernels: a verified token is computed as if decoded alone)."""
    tiny = T.build(512, device="cuda", dtype=torch.bfloat16, head_dim=16)
    prompts = [[5, 6, 7, 8, 9], [77], [40, 3] * 10]
    plain = Generator(fast_target(tiny), NoDrafter(), [], 512)
    eager = Generator(fast_target(tiny), DRAFTERS[name](tiny), [], 512)
    graphed = Generator(fast_target(tiny), DRAFTERS[name](tiny), [], 512, options=LoopOptions(cuda_graphs=True))
    for p in prompts:
        want = plain.generate(p, 100).tokens
        assert eager.generate(p, 100).tokens == want
        assert graphed.generate(p, 100).tokens == want
    assert graphed.graph_fallback is None and all(e.replay is not None for e in graphed._executors.values())


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("gamma", [0, 3])
def test_fast_batch_loop_on_the_gpu(graphs, gamma):
    """fp32 on the GPU, compiled kernels: the continuous-batching loop over a fast target (8 slots, 12 prompts), eager
    or with its steps replayed from CUDA graphs, plain or verifying EAGLE3 chains of 3 (batch_drafts.py), gives
    every sequence the tokens it gets alone. (In bf16 a batch step's prompt chunks, 512 rows on cuBLAS (a wide
    step), round otherwise than the kernels' passes alone, and a near tie may part them: on an H100, prompt 3 at
    its 4th token, 2026-12-05; benchmarks/fast_agreement.py counts such partings.)"""
    from xcompile.runtime.engines.graphs import CudaGraphCapture

    tiny = T.build(256, device="cuda", dtype=torch.float32, head_dim=16)
    prompts = T.random_prompts((1, 5, 9, 30, 70, 2, 3, 17, 40, 8, 1, 12), seed=3)
    plain = Generator(fast_target(tiny), NoDrafter(), [], 256)
    want = [plain.generate(p, 48).tokens for p in prompts]
    target = fast.FastQwen3Engine(qwen3_engine(tiny.target, max_seq_len=256, batch=8), cfg(tiny.target), T.TAPS)
    drafts = None
    if gamma:
        heads = torch_engines(tiny.eagle3, EAGLE3, 256, batch=8)
        e3, fc = heads[EAGLE3], heads[EAGLE3_FC]
        head = Eagle3ChainDrafter(fast.FastEagle3Engine(e3, cfg(tiny.eagle3)),
                                  fast.FastFCEngine(fc, cfg(tiny.eagle3)), tiny.d2t, gamma)
        drafts = BatchDrafts(head, 8, 256, target.device)
    batch = BatchGenerator(target, [], 256, capture=CudaGraphCapture() if graphs else None, drafts=drafts)
    results = batch.generate([(p, 48) for p in prompts])
    assert [r.tokens for r in results] == want
    assert (sum(r.stats.drafted for r in results) > 0) == bool(gamma)
    if graphs:          # prompt-carrying steps, padded to the recorded sizes, replayed too (batch.recorded_sizes)
        assert batch.recorded and {key[0][1][1] for key in batch._graphed.graphs} - {1, gamma + 1}


def test_an_fp8_cache_on_the_kernels_is_the_references(tiny):
    """A fast target over an FP8 KV cache (rope_kv's e4m3 codes, the attention's exact reads) steps as the reference
    module over its FP8 cache: logits and taps, and the codes of both caches; greedy decoding on it gives the
    reference's tokens, and an EAGLE3 chain and tree plain greedy's."""
    ref, got = tiny.target_engine(), fast_target(tiny)
    for e in (ref, got):
        e.set_kv_dtype(torch.float8_e4m3fn)
        e.new_kv()
    for inputs in [step_inputs(torch.tensor([[5, 9, 11, 20, 33]]), 0), step_inputs(torch.tensor([[7]]), 5),
                   tree_inputs([3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 3], 6)]:
        want, have = ref.run(**inputs), got.run(**inputs)
        assert close(have["logits"], want["logits"]) and close(have["hidden_taps"], want["hidden_taps"])
    codes = [torch.stack(e.kv).view(torch.uint8) for e in (ref, got)]
    assert got.kv[0].dtype == torch.float8_e4m3fn and (codes[0] != codes[1]).float().mean() < 1e-3
    prompts = T.random_prompts((5, 40), seed=8)

    def loop(engine, drafter):
        engine.set_kv_dtype(torch.float8_e4m3fn)
        return Generator(engine, drafter, [], MAX_SEQ_LEN)
    want = [loop(tiny.target_engine(), NoDrafter()).generate(p, 20).tokens for p in prompts]
    assert [loop(fast_target(tiny), NoDrafter()).generate(p, 20).tokens for p in prompts] == want
    for name in ("eagle3", "eagle3-tree"):
        spec = loop(fast_target(tiny), DRAFTERS[name](tiny))
        assert [spec.generate(p, 20).tokens for p in prompts] == want


@pytest.mark.gpu
def test_an_fp8_cache_on_the_gpu():
    """bf16 on the GPU, an FP8 cache: the fast target's cache holds the reference's values to e4m3's precision
    (their bf16 projections round apart, so about a quarter of the codes sit one step away: 23 % on an H100,
    2026-12-05; test_fp8_cache_kernels.py checks the conversion itself bit for bit), the attention reads them
    (logits close to the reference's), and an EAGLE3 chain on it gives plain greedy's tokens on it."""
    tiny = T.build(512, device="cuda", dtype=torch.bfloat16, head_dim=16)
    ref, got = tiny.target_engine(), fast_target(tiny)
    for e in (ref, got):
        e.set_kv_dtype(torch.float8_e4m3fn)
        e.new_kv()
    inputs = step_inputs(torch.tensor([[5, 9, 11, 20, 33]], device="cuda"), 0)
    want, have = ref.run(**inputs), got.run(**inputs)
    assert close(have["logits"].float(), want["logits"].float(), 0.05)
    values = [torch.stack(e.kv)[:, :, :, :5].float() for e in (ref, got)]
    assert close(values[1], values[0], 0.1)

    def loop(drafter):
        engine = fast_target(tiny)
        engine.set_kv_dtype(torch.float8_e4m3fn)
        return Generator(engine, drafter, [], 512, options=LoopOptions(cuda_graphs=True))
    plain, spec = loop(NoDrafter()), loop(DRAFTERS["eagle3"](tiny))
    for p in T.random_prompts((5, 70), seed=9):
        assert spec.generate(p, 60).tokens == plain.generate(p, 60).tokens


@pytest.mark.gpu
def test_long_prompts_take_flash_attention_in_chunks_on_the_gpu(monkeypatch):
    """bf16 on the GPU: a causal prompt pass over the live keys (layers.causal_attention) runs on the flash kernel
    with the KV heads shared (SDPA refuses otherwise under FLASH_ATTENTION alone), from an empty cache and after
    earlier chunks; a prompt in chunks gives the whole pass's last logits and taps, and the additive-mask path's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from xcompile.compile.models import layers
    from xcompile.runtime.decoding.drafters import base

    q = torch.randn(1, 32, 300, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 1, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for live in (300, 900):
            assert layers.causal_attention(q, kv[0], kv[1], live).shape == q.shape
    tiny = T.build(1024, device="cuda", dtype=torch.bfloat16, head_dim=16)
    prompt = torch.tensor([T.random_prompts((700,), seed=6)[0]], device="cuda")

    def run(chunk: int, causal: bool = True):
        monkeypatch.setattr(base, "PROMPT_CHUNK", chunk)
        monkeypatch.setattr(layers, "causal_prompt", layers.causal_prompt if causal else (lambda mask: False))
        engine = fast_target(tiny)
        engine.new_kv()
        out, _, taps = base.prompt_pass(engine, prompt, keep="hidden_taps")
        return out["logits"][:, -1].float(), taps.float()

    whole = run(8192)
    for got in (run(256), run(8192, causal=False)):
        assert all(close(a, b, 0.05) for a, b in zip(got, whole))


@pytest.mark.gpu
def test_synthetic_weights_drawn_on_the_gpu_are_the_cpus():
    """A synthetic dir's weights are drawn where they live (compile/synthetic.py): on the GPU, in steps of 2^26
    elements, the very bits the CPU export drew, an embedding of more elements than one step included."""
    from xcompile.compile.config import Qwen3Config
    from xcompile.compile.synthetic import synthetic_qwen3

    cfg = Qwen3Config(70000, 1024, 3072, 1, 8, 4, 128)          # embedding and lm_head: 71.7M elements each
    cpu, gpu = (synthetic_qwen3(cfg, 64, seed=5, device=d, norm_std=0.1) for d in ("cpu", "cuda"))
    for (name, a), (_, b) in zip(cpu.state_dict().items(), gpu.state_dict().items()):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()), name


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_pdl_changes_no_bits_of_a_step_on_the_gpu(tokens):
    """Programmatic dependent launch (KernelConfig.pdl) is scheduling only: a bf16 target step and an EAGLE3
    step give the same logits, hidden and KV bits with it on as off."""
    from xcompile.runtime.engines.kernels.config import KernelConfig
    tiny = T.build(512, device="cuda", dtype=torch.bfloat16, head_dim=16)
    target, (e3, _) = fast_target(tiny), fast_eagle3(tiny)
    inputs = step_inputs(torch.arange(3, 3 + tokens, device="cuda")[None], 40)
    hidden = {"hidden_states": torch.ones(1, tokens, tiny.eagle3.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)}
    results = []
    for pdl in (False, True):
        outs = []
        for engine, extra in ((target, {}), (e3, hidden)):
            engine.kernels = KernelConfig(pdl=pdl)
            kv = engine.reference.new_kv()
            engine.bind_kv(kv)
            outs += list(engine.run(**inputs, **extra).values()) + list(kv)
        results.append(outs)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("kind, block", [("fp8", (32, 32)), ("int4", (1, 32))])
def test_quantized_target_steps_match_the_reference_and_greedy_speculation_is_plain_greedy(kind, block):
    """A target whose decoder linears are quantized runs them on the quantized kernels (runtime/engines/kernels/
    qlinear.py), their norms unfolded, and matches the reference module on the dequantized weights; the
    weights it reads are the codes' bytes; an EAGLE3 chain and tree give plain greedy's tokens on it."""
    from xcompile.compile.reference import quantize_linears
    from xcompile.runtime.engines.kernels.qlinear import QLinear

    tiny = T.build(MAX_SEQ_LEN, head_dim=16)
    quantize_linears(tiny.target, kind, block)
    ref, got = tiny.target_engine(), fast_target(tiny)
    assert all(isinstance(w, QLinear) for layer in got.layers for w in layer.projections())
    assert not got.wide                 # its batch steps past MAX_ROWS rows stay on the reference
    assert all(layer.ln1 is not got.sums.unit for layer in got.layers)
    dense = sum(p.numel() for n, p in tiny.target.named_parameters() if "layers" in n and "proj" in n)
    assert got.weight_bytes() < fast_target(T.build(MAX_SEQ_LEN, head_dim=16)).weight_bytes() - dense * 4 * 0.6
    ref.new_kv()
    got.new_kv()
    for inputs in [step_inputs(torch.tensor([[5, 9, 11, 20, 33]]), 0), step_inputs(torch.tensor([[7]]), 5),
                   tree_inputs([3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 3], 6)]:
        want, have = ref.run(**inputs), got.run(**inputs)
        assert close(have["logits"], want["logits"]) and close(have["hidden_taps"], want["hidden_taps"])
    prompt = [5, 9, 11, 20, 33, 7]
    want = T.greedy_reference(tiny.target, prompt, 8)
    for name in ("eagle3", "eagle3-tree"):
        r = Generator(fast_target(tiny), DRAFTERS[name](tiny), [], MAX_SEQ_LEN,
                      options=LoopOptions(debug=True)).generate(prompt, 8)
        assert r.tokens == want, name
