"""The public Python API (runtime/api.py): an engine dir opened once, generate for one or many prompts, chat,
stream; against what the same engines give through the loop directly, and ``xrun generate``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from serving import generate_json

from xcompile.runtime import LLM, Completion, EngineError, Output, SamplingParams, TreeShape

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_engine_dir):
    with LLM(tiny_engine_dir, backend="ort", device="cpu", gamma=3) as llm:
        yield llm


def xrun_generate(engine_dir, *args) -> dict:
    return generate_json(engine_dir, "--backend", "ort", *args)


def test_the_package_exports_the_api_lazily():
    """``import xcompile.runtime`` loads no torch (``xrun --help`` stays instant); the names resolve on use."""
    code = ("import sys, xcompile.runtime as r; assert 'torch' not in sys.modules; "
            "assert r.LLM.__name__ == 'LLM' and 'torch' in sys.modules; print(sorted(r.__all__))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "LLM" in run.stdout and "SamplingParams" in run.stdout
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        import xcompile.runtime as r
        r.Nope  # noqa: B018


def test_generate_gives_xrun_generate_tokens(llm, tiny_engine_dir):
    """Greedy through the API equals ``xrun generate`` (same engines, same drafter): text, ids, finish."""
    [c] = llm.generate(PROMPT, max_new_tokens=24)
    want = xrun_generate(tiny_engine_dir, "--prompt", PROMPT, "--max-new-tokens", "24", "--gamma", "3")
    assert isinstance(c, Completion) and isinstance(c.outputs[0], Output)
    assert c.outputs[0].token_ids == want["tokens"] and c.text == want["text"]
    assert c.outputs[0].finish_reason == want["stats"]["finish_reason"]
    assert c.prompt_ids == llm.encode(PROMPT) and c.outputs[0].seed is None
    assert c.outputs[0].stats.rounds > 0 and llm.backend == "ort"


def test_generate_takes_many_prompts_text_or_ids(llm):
    """A list of prompts gives one Completion each, in order; token-id prompts and text prompts alike; each
    equals the prompt generated alone."""
    ids = llm.encode("over the lazy dog")
    many = llm.generate([PROMPT, ids], max_new_tokens=12)
    assert [c.prompt_ids for c in many] == [llm.encode(PROMPT), ids]
    assert many[0].outputs[0].token_ids == llm.generate(PROMPT, max_new_tokens=12)[0].outputs[0].token_ids
    assert many[1].outputs[0].token_ids == llm.generate(ids, max_new_tokens=12)[0].outputs[0].token_ids


def test_sampling_params_give_n_reproducible_samples(llm):
    params = SamplingParams(temperature=0.9, top_k=20, seed=5, n=3)
    first = llm.generate(PROMPT, params, max_new_tokens=16)[0]
    again = llm.generate(PROMPT, params, max_new_tokens=16)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2] and all(o.seed == 5 for o in first.outputs)
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1                 # the streams differ


def test_stream_pieces_make_the_generated_text(llm):
    pieces = list(llm.stream(PROMPT, max_new_tokens=20))
    assert len(pieces) > 1 and "".join(pieces) == llm.generate(PROMPT, max_new_tokens=20)[0].text


def test_chat_applies_the_template(llm, tiny_engine_dir):
    c = llm.chat("hello there", max_new_tokens=10)
    assert c.prompt_ids == llm.tokenizer.chat("hello there")
    assert c.outputs[0].token_ids == xrun_generate(tiny_engine_dir, "--chat", "hello there", "--max-new-tokens", "10",
                                                   "--gamma", "3")["tokens"]


def test_stop_strings_end_the_text(llm):
    full = llm.generate(PROMPT, max_new_tokens=30)[0].text
    stop = full[5:8]
    cut = llm.generate(PROMPT, max_new_tokens=30, stop=[stop])[0]
    assert cut.outputs[0].finish_reason == "stop" and stop in cut.text and len(cut.text) < len(full)


def test_a_tree_drafter_gives_the_same_greedy_tokens(tiny_engine_dir, llm):
    with LLM(tiny_engine_dir, backend="ort", device="cpu", tree=TreeShape(2, 3, 6)) as tree:
        assert tree.drafter.name == "eagle3-tree"
        assert tree.generate(PROMPT, max_new_tokens=20)[0].outputs[0].token_ids == \
            llm.generate(PROMPT, max_new_tokens=20)[0].outputs[0].token_ids


@pytest.mark.parametrize("call,match", [
    (lambda llm: llm.generate(PROMPT, max_new_tokens=0), "max_new_tokens must be >= 1"),
    (lambda llm: llm.generate([PROMPT, [10**7]], max_new_tokens=4), r"token ids must lie in \[0, "),
    (lambda llm: llm.generate(PROMPT, {"temperature": 1}), "sampling must be a SamplingParams"),
    (lambda llm: list(llm.stream(PROMPT, SamplingParams(temperature=1.0, n=2))), "stream gives one sample"),
    (lambda llm: llm.generate("x " * 400, max_new_tokens=4), "exceed max_seq_len"),
])
def test_bad_requests_are_one_line_errors_before_any_work(llm, call, match):
    with pytest.raises(EngineError, match=match):
        call(llm)


def test_a_budget_past_the_context_is_refused_and_the_default_fits(llm):
    """The tiny dir holds 256 tokens: 200 prompt ids leave 56; asking 100 is refused naming max_new_tokens, the
    default is cut to the 56 that fit."""
    ids = [5] * 200
    with pytest.raises(EngineError, match="max_new_tokens 100: .* at most 56 fit"):
        llm.generate(ids, max_new_tokens=100)
    out = llm.generate(ids)[0].outputs[0]
    assert len(out.token_ids) == 56 and out.finish_reason == "max_tokens"


def test_bad_options_fail_when_opening(tiny_engine_dir, tmp_path):
    with pytest.raises(EngineError, match="--gamma sets a chain, --tree-\\* a tree"):
        LLM(tiny_engine_dir, backend="ort", device="cpu", gamma=2, tree=TreeShape())
    with pytest.raises(EngineError, match="manifest.json"):
        LLM(tmp_path, backend="ort", device="cpu")


@pytest.mark.parametrize("batched", [False, True])
def test_warm_up_leaves_every_output_as_it_was(tiny_engine_dir, tiny_target, tmp_path_factory, batched):
    """LLM.warm_up runs the dir's prompt passes, rounds or batch steps (greedy, sampling, top-p, the dir's
    generation_config), then every greedy and seeded sampled output is a fresh LLM's."""
    import fixtures

    engine_dir = fixtures.exported_dir(tmp_path_factory, "tiny-batch4", model=str(tiny_target), dtype="fp32",
                                       max_batch=4) if batched else tiny_engine_dir
    # 4, 1 and 70 tokens (past the 64-token short steps; 40 in the batched dir's 64 slots)
    prompts = [PROMPT, [5], list(range(4, 44 if batched else 74))]
    kinds = [SamplingParams(), SamplingParams(temperature=0.9, seed=7, n=2),
             SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=3)]

    def outputs(warm: bool) -> list:
        with LLM(engine_dir, backend="ort", device="cpu", gamma=None if batched else 3,
                 drafter="auto" if batched else "eagle3") as llm:
            parts = llm.warm_up() if warm else []
            if warm:
                first = "batch steps of 1..63 tokens" if batched else "prompt passes of 1..64 tokens"
                assert parts[0].what.startswith(first) and all(p.seconds >= 0 for p in parts)
            return [[o.token_ids for o in c.outputs] for s in kinds
                    for c in llm.generate(prompts, s, max_new_tokens=12)]

    assert outputs(warm=True) == outputs(warm=False)


def test_a_batch_dirs_stream_left_early_or_failing_frees_its_slot(tiny_target, tmp_path_factory, monkeypatch):
    """On a --max-batch dir: a stream the caller stops reading gives its slot back at the next step, and a step
    that raises ends every sequence of the call (none stays seated for the next call)."""
    import fixtures

    engine_dir = fixtures.exported_dir(tmp_path_factory, "tiny-batch4", model=str(tiny_target), dtype="fp32",
                                       max_batch=4)
    with LLM(engine_dir, backend="ort", device="cpu") as llm:
        steps = llm.loop.stats.steps
        want = llm.generate(PROMPT, max_new_tokens=6)[0].outputs[0].token_ids
        alone = llm.loop.stats.steps - steps
        stream = llm.stream(PROMPT, max_new_tokens=40)
        next(stream)
        stream.close()
        steps = llm.loop.stats.steps
        assert llm.generate(PROMPT, max_new_tokens=6)[0].outputs[0].token_ids == want
        assert llm.loop.idle and llm.loop.stats.steps - steps == alone      # the left stream decoded no further

        def broken():
            raise RuntimeError("the device fell off")
        monkeypatch.setattr(llm.loop, "step", broken)
        with pytest.raises(RuntimeError, match="fell off"):
            llm.generate(PROMPT, max_new_tokens=6)
        assert llm.loop.idle
