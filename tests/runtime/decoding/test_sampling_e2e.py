"""Sampling end to end: ``Generator.generate_n`` on an exported engine dir with an 8-token vocabulary,
torch and ORT backends on the CPU, every drafter (draft model, EAGLE3 and MTP chains, EAGLE3 and MTP trees).

The law of the first 3 generated tokens (temperature 1, top-k 2: at most 8 outcomes) must equal the
target's exact law, computed by teacher forcing over every kept prefix, within the total-variation
bound of test_sampling.py for the sample count; plain sampling is held to the same bound, so every
drafter matches plain sampling. With 8 tokens even random drafts overlap the target, so rounds accept
some drafts and reject others (checked). ORT draws the same numbers as torch from the same seed and
its engines agree to ~1e-6, so its samples must equal torch's token for token.

What these bounds can see: at 400 samples a configuration fails beyond TV ~0.19, the pooled check
beyond ~0.08. Subtle wiring bugs move less (measured at 1500 samples: a draft model recording its
unwarped q, TV 0.06; q rows off by one, 0.11), so ``test_drafters_record_the_q_they_draw_from``
checks the recorded q exactly, and test_speculative_sampling.py holds the rules to ~0.02.
"""

from __future__ import annotations

from pathlib import Path

import fixtures
import pytest
import torch
from test_sampling import tv, tv_bound

from xcompile.runtime.decoding.drafters import prompt_inputs
from xcompile.runtime.decoding.generator import Generator
from xcompile.runtime.decoding.registry import DrafterSpec, TreeShape, make_drafter
from xcompile.runtime.decoding.sampling import GREEDY, Sampler, SamplingParams
from xcompile.runtime.engines.load import open_engine_dir

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"vocab_size": 8, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
PROMPT, M, MAX_SEQ_LEN = [2, 4], 3, 32
PARAMS = SamplingParams(temperature=1.0, top_k=2, seed=2024)
N = {"torch": 400, "ort": 100}                  # samples per configuration (ORT's are checked against torch's)
DRAFTERS = {"none": DrafterSpec("none"), "draft-model": DrafterSpec("draft-model", 2),
            "eagle3": DrafterSpec("eagle3", 2), "eagle3-tree": DrafterSpec("eagle3", tree=TreeShape(2, 3, 6)),
            "mtp": DrafterSpec("mtp", 2), "mtp-tree": DrafterSpec("mtp", tree=TreeShape(2, 3, 6))}


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    """target, EAGLE3 head (draft vocab 6 of 8), MTP module and a draft model, all random, exported fp32."""
    from xcompile.compile.pipeline import ExportRequest, export_engine_dir

    root = tmp_path_factory.mktemp("small_vocab")
    # both with the same 8-token tokenizer: export checks that a draft model maps tokens to the target's ids
    target = fixtures.write_qwen3_checkpoint(root / "target", SMALL)
    draft = fixtures.write_qwen3_checkpoint(root / "draft", SMALL, seed=5)
    head = fixtures.write_eagle3_checkpoint(root / "head", SMALL, {"draft_vocab_size": 6, "intermediate_size": 48})
    mtp = fixtures.write_mtp_checkpoint(root / "mtp", target, seed=3)
    out = root / "dir"
    export_engine_dir(ExportRequest(model=str(target), out=out, eagle3=str(head), draft_model=str(draft),
                                    mtp=str(mtp), dtype="fp32", max_seq_len=MAX_SEQ_LEN))
    return out


@pytest.fixture(scope="module")
def engine_sets(small_dir):
    sets = {b: open_engine_dir(small_dir, b, "cpu") for b in N}
    yield sets
    for es in sets.values():
        es.close()


@pytest.fixture(scope="module")
def exact(engine_sets) -> torch.Tensor:
    return exact_law(engine_sets["torch"].engines["target"])


def exact_law(target) -> torch.Tensor:
    """[8**M] the target's law of its first M tokens after PROMPT, by teacher forcing."""
    if not target.kv:
        target.new_kv()
    s = Sampler("cpu")
    s.reset(PARAMS)
    v = SMALL["vocab_size"]
    law = torch.zeros(v ** M, dtype=torch.float64)

    def walk(prefix: list[int], prob: float):
        if len(prefix) == M:
            law[sum(t * v ** (M - 1 - j) for j, t in enumerate(prefix))] = prob
            return
        with torch.inference_mode():
            logits = target.run(**prompt_inputs(torch.tensor([PROMPT + prefix])))["logits"][:, -1]
        p = s.warp(logits).probs()[0].double()
        for t in torch.nonzero(p).flatten().tolist():
            walk(prefix + [t], prob * float(p[t]))

    walk([], 1.0)
    assert abs(float(law.sum()) - 1) < 1e-5                # float32 warps
    return law / law.sum()


def outcomes(results) -> torch.Tensor:
    v = SMALL["vocab_size"]
    return torch.tensor([sum(t * v ** (M - 1 - j) for j, t in enumerate(r.tokens[:M])) for r in results])


def generator(es, name: str) -> Generator:
    return Generator(es.engines["target"], make_drafter(es, DRAFTERS[name]), [], MAX_SEQ_LEN)


_SAMPLES: dict[tuple[str, str], list] = {}


def samples(engine_sets, backend: str, name: str) -> list:
    """The first N[backend] samples of PARAMS's seed (cached: ORT's are compared with torch's)."""
    key = (backend, name)
    if key not in _SAMPLES:
        _SAMPLES[key] = generator(engine_sets[backend], name).generate_n(PROMPT, M, sampling=SamplingParams(
            temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=PARAMS.seed, n=N[backend]))
    return _SAMPLES[key]


@pytest.mark.parametrize("backend, name", [("torch", n) for n in DRAFTERS] + [("ort", n) for n in DRAFTERS if n != "none"])
def test_first_tokens_follow_the_target_law(backend, name, engine_sets, exact):
    results = samples(engine_sets, backend, name)
    n = len(results)
    assert [r.index for r in results] == list(range(n)) and {r.seed for r in results} == {PARAMS.seed}
    assert tv(outcomes(results), exact) < tv_bound(exact, n), name
    if name != "none":
        drafted, accepted = sum(r.stats.drafted for r in results), sum(r.stats.accepted for r in results)
        assert 0 < accepted < drafted           # both acceptance and rejection happened
    if backend == "ort":
        assert [r.tokens for r in results] == [r.tokens for r in samples(engine_sets, "torch", name)[:n]]


def test_pooled_over_every_drafter(engine_sets, exact):
    """Every speculative drafter emits the same law, so their samples pool (a tighter bound)."""
    ids = torch.cat([outcomes(samples(engine_sets, "torch", name)) for name in DRAFTERS if name != "none"])
    assert tv(ids, exact) < tv_bound(exact, ids.numel())


@pytest.mark.parametrize("name", ["draft-model", "eagle3", "mtp"])
def test_drafters_record_the_q_they_draw_from(name, engine_sets):
    """After a sampled propose, block.q[:, i] is the warped softmax of the logits draft i was drawn from
    (recorded from the draft engine's own outputs), q_tok the probability of the drafted token, and
    q_ids the target ids of q's columns."""
    es = engine_sets["torch"]
    gen = generator(es, name)
    drafter = gen.drafter
    seen = []
    engine = drafter.engine if name == "draft-model" else drafter.eagle3
    run = engine.run

    def recording(**inputs):
        out = run(**inputs)
        seen.append(out["logits"][:, -1].clone())
        return out

    engine.run = recording
    params = SamplingParams(temperature=0.8, top_k=3, seed=5)
    gen.generate(PROMPT, 6, sampling=params)                      # a few rounds: start + commits recorded
    s = Sampler("cpu")
    s.reset(params)
    seen.clear()
    root, length = torch.tensor([PROMPT[-1]]), torch.tensor([len(PROMPT) + 4])
    logits_1 = drafter.logits[:, 0].clone() if name != "draft-model" else None
    with torch.inference_mode():
        block = drafter.propose(root, length)
    # the logits each draft was drawn from: the EAGLE3 (and MTP) chain's first comes from the last commit
    rows = ([logits_1] + seen[:drafter.k - 1]) if name != "draft-model" else seen[:drafter.k]
    ids = torch.arange(block.q.shape[-1]) if block.q_ids is None else block.q_ids
    for i, logits in enumerate(rows, start=1):
        q = s.warp(logits).probs()
        assert torch.allclose(block.q[:, i], q, atol=1e-6), i
        col = int((ids == block.tokens[0, i]).nonzero())
        assert abs(float(block.q_tok[0, i]) - float(q[0, col])) < 1e-6 and float(q[0, col]) > 0
    if name == "eagle3":
        assert torch.equal(block.q_ids, torch.arange(6) + es.d2t)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_seeded_runs_repeat_and_temperature_zero_is_greedy(name, engine_sets):
    es = engine_sets["torch"]
    gen = generator(es, name)
    a = gen.generate_n(PROMPT, 12, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=7, n=3))
    b = gen.generate_n(PROMPT, 12, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=7, n=3))
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert len({tuple(r.tokens) for r in a}) > 1               # the samples are not copies of each other
    # the ORT backend draws the same numbers: the same text when the engines agree to the bit
    ort = generator(engine_sets["ort"], name).generate_n(PROMPT, 12, sampling=SamplingParams(
        temperature=1.0, top_p=0.9, seed=7, n=3))
    assert [r.tokens for r in ort] == [r.tokens for r in a]
    greedy = gen.generate(PROMPT, 12)
    assert gen.generate(PROMPT, 12, sampling=SamplingParams(temperature=0.0, top_k=2, seed=3)).tokens == greedy.tokens
    assert generator(es, "none").generate(PROMPT, 12, sampling=GREEDY).tokens == greedy.tokens
