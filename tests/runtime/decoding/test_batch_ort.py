"""The continuous-batching loop on ONNX Runtime (CPU, fp32): a tiny target exported with ``--max-batch 4``
gives every sequence the tokens the batch-1 Generator gives it on the ``--max-batch 1`` export of the same
checkpoint, and the torch backend opens the batch dir with one KV slot per sequence too."""

from __future__ import annotations

import logging

import fixtures
import pytest
import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.batch import BatchGenerator
from xcompile.runtime.decoding.drafters import NoDrafter
from xcompile.runtime.decoding.generator import Generator
from xcompile.runtime.decoding.sampling import SamplingParams
from xcompile.runtime.engines.load import open_engine_dir

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 12


@pytest.fixture(scope="module")
def batch_dir(tiny_target, tmp_path_factory):
    return fixtures.exported_dir(tmp_path_factory, "tiny-batch4", model=str(tiny_target), dtype="fp32", max_batch=4)


@pytest.fixture(scope="module")
def single_dir(tiny_target, tmp_path_factory):
    return fixtures.exported_dir(tmp_path_factory, "tiny-batch1", model=str(tiny_target), dtype="fp32")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, 100, (n,), generator=g).tolist() for n in (2, 9, 30, 5, 17)]


def refs(single_dir, prompts, sampling=SamplingParams()):
    with open_engine_dir(single_dir, "ort", "cpu") as es:
        g = Generator(es.engines["target"], NoDrafter(), [], es.manifest.max_seq_len)
        return [g.generate(p, NEW, sampling=sampling).tokens for p in prompts]


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_batch_of_four_on_the_export_matches_batch_one(batch_dir, single_dir, prompts, backend):
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, seed=4)]
    want = [refs(single_dir, prompts, s) for s in sampling]
    with open_engine_dir(batch_dir, backend, "cpu") as es:
        assert es.manifest.max_batch == 4 and es.engines["target"].kv_shape.batch == 4
        batch = BatchGenerator(es.engines["target"], [], es.manifest.max_seq_len, chunk=8)
        for s, w in zip(sampling, want):
            assert [r.tokens for r in batch.generate([(p, NEW, (), s) for p in prompts])] == w
        assert batch.stats.rows_used[3] > 0


def test_the_batch_1_generator_refuses_a_batch_dir_with_the_fix(batch_dir):
    with open_engine_dir(batch_dir, "ort", "cpu") as es:
        with pytest.raises(EngineError, match=r"fix the batch at 4 sequences .* use --backend torch or fast"):
            Generator(es.engines["target"], NoDrafter(), [], es.manifest.max_seq_len)


def test_llm_and_xrun_generate_batch_on_a_batch_dir(batch_dir, single_dir, prompts):
    """LLM.generate decodes its prompts together on a --max-batch 4 dir; xrun generate's n samples too, each
    what the batch-1 dir gives; an explicit drafter is refused there with the fix."""
    import serving

    from xcompile.runtime.api import LLM

    with LLM(batch_dir, backend="ort", device="cpu") as llm:
        got = [c.outputs[0].token_ids for c in llm.generate(prompts, max_new_tokens=NEW)]
        assert llm.batch.stats.rows_used[3] > 0
    with LLM(single_dir, backend="ort", device="cpu", drafter="none") as llm:
        assert got == [c.outputs[0].token_ids for c in llm.generate(prompts, max_new_tokens=NEW)]
    args = ("--prompt", "the cat", "--max-new-tokens", 8, "--temperature", 0.8, "--seed", 5, "--num-samples", 2,
            "--backend", "ort")
    def samples(d, *more):
        return [x["tokens"] for x in serving.generate_json(d, *args, *more)["samples"]]

    batched = samples(batch_dir)
    assert batched == samples(single_dir, "--drafter", "none") and batched[0] != batched[1]
    with pytest.raises(EngineError, match="--drafter eagle3.*--max-batch 4.*--drafter none"):
        LLM(batch_dir, backend="ort", device="cpu", drafter="eagle3")


def test_llm_on_a_batch_dir_speculates_for_a_lone_request_on_the_torch_backend(tiny_target, tiny_eagle3, single_dir,
                                                                                tmp_path_factory, prompts, caplog):
    """A --max-batch 4 dir with an EAGLE3 head, on the torch backend (whose engines run one sequence in the first
    slot): a request alone speculates (runtime/decoding/solo.py) and several batch, verifying chains in the batch
    steps (batch_drafts.py); every answer is plain greedy's. On ORT, whose graphs fix the batch, auto drafts
    nothing there, and says why."""
    from xcompile.runtime.api import LLM

    head_dir = fixtures.exported_dir(tmp_path_factory, "tiny-batch4-eagle3", model=str(tiny_target),
                                     eagle3=str(tiny_eagle3), dtype="fp32", max_batch=4)
    with LLM(head_dir, backend="torch", device="cpu", gamma=3) as llm:
        assert llm.spec.name == "eagle3" and llm.batch_spec.label == "eagle3 chain g=3"
        # the head's KV and the target's hold every slot: the batch steps draft for each
        assert [b.shape[0] for e in llm.drafter.engines for b in e.kv] == [4, 4]
        assert llm.engines.engines["target"].kv[0].shape[0] == 4
        one = llm.generate([prompts[0]], max_new_tokens=NEW)[0].outputs[0]
        assert llm.batch.stats.steps == 0 and llm.batch.stats.solo_rounds > 0
        outs = [c.outputs[0] for c in llm.generate(prompts, max_new_tokens=NEW)]
        many = [o.token_ids for o in outs]
        assert llm.batch.stats.steps > 0 and sum(o.stats.drafted for o in outs) > 0
    assert [one.token_ids] + many == refs(single_dir, [prompts[0]] + prompts)
    with caplog.at_level(logging.WARNING, logger="xcompile"):
        with LLM(head_dir, backend="ort", device="cpu") as llm:
            assert llm.spec.name == "none" and llm.batch.solo is None
    assert "--drafter auto: none" in caplog.text and "fix the batch at 4 sequences" in caplog.text
    with pytest.raises(EngineError, match=r"--gamma / --tree-\*: .*fix the batch, so it cannot speculate"):
        LLM(head_dir, backend="ort", device="cpu", gamma=3)            # asked for, so refused, not warned of


def test_xrun_bench_refuses_a_fixed_batch_dir_on_ort_before_it_loads(batch_dir):
    from click.testing import CliRunner

    from xcompile.runtime.cli.xrun import main

    r = CliRunner().invoke(main, ["bench", str(batch_dir), "--device", "cpu", "--backend", "ort", "--contexts", "8",
                                  "--new-tokens", "4", "--gammas", "1", "--tree", ""])
    assert r.exit_code == 2 and "fix the batch at 4 sequences" in r.output and "loaded" not in r.output, r.output
