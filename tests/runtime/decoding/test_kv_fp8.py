"""The FP8 KV cache (issue 39 item 4) on the torch backend: the target's cache holds e4m3 codes of what a
full-precision cache would hold (past +-448 saturated), and decoding over it keeps every promise of the loops:
speculative greedy equals plain greedy on the same FP8 cache (chains, trees, the draft model), the batch loop
gives each sequence the batch-1 loop's tokens, warm-up leaves nothing behind. Backends whose kernels or graphs
read full-precision caches refuse it in one line."""

from __future__ import annotations

import json

import pytest
import tiny_engines as T
import torch
from click.testing import CliRunner
from fixtures import step_inputs

from xcompile.runtime.api import LLM
from xcompile.runtime.cli.xrun import main
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.batch import BatchGenerator
from xcompile.runtime.decoding.drafters import NoDrafter
from xcompile.runtime.decoding.generator import Generator

FP8 = torch.float8_e4m3fn
MAX_SEQ_LEN = 256
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> T.Tiny:
    return T.build(MAX_SEQ_LEN)


def fp8_target(tiny, batch: int = 1):
    engine = T.qwen3_engine(tiny.target, batch=batch)
    engine.set_kv_dtype(FP8)
    return engine


def test_the_cache_holds_the_e4m3_codes_of_the_full_precision_keys_and_values(tiny):
    full, fp8 = tiny.target_engine(), fp8_target(tiny)
    full.new_kv()
    fp8.new_kv()
    ids = torch.tensor([T.random_prompts((9,), seed=2)[0]])
    full.run(**step_inputs(ids, 0))
    fp8.run(**step_inputs(ids, 0))
    assert all(b.dtype == FP8 for b in fp8.kv)
    # the first layer's keys and values: the same inputs, so the codes are the full values rounded (later layers
    # read rounded keys, so their inputs differ)
    for a, b in zip(full.kv[:2], fp8.kv[:2]):
        assert torch.equal(b[:, :, :9], a[:, :, :9].clamp(-448, 448).to(FP8))
        assert not b[:, :, 9:].float().any()


def test_values_past_the_e4m3_range_saturate():
    from xcompile.compile.models.layers import KV_FP8, Step, write_kv

    cache = torch.zeros(1, 1, 4, 2, dtype=KV_FP8)
    rows = torch.tensor([[1, 2]])[:, None, :, None]
    step = Step(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([1]), None, kv_rows=rows)
    write_kv(cache, torch.tensor([[[[1000.0, -1e6], [0.1, 3.0]]]]), step)
    assert cache.float()[0, 0].tolist() == [[0, 0], [448, -448], [0.1015625, 3], [0, 0]]


@pytest.mark.parametrize("name", ["eagle3", "eagle3-tree", "draft", "mtp"])
def test_speculative_greedy_is_plain_greedy_on_an_fp8_cache(name, tiny):
    prompts = T.random_prompts((5, 30, 100), seed=1)
    plain = Generator(fp8_target(tiny), NoDrafter(), [], MAX_SEQ_LEN)
    spec = Generator(fp8_target(tiny), T.DRAFTERS[name](tiny), [], MAX_SEQ_LEN)
    for p in prompts:
        assert spec.generate(p, 40).tokens == plain.generate(p, 40).tokens


def test_the_batch_loop_on_an_fp8_cache_gives_the_batch_1_tokens(tiny):
    prompts = T.random_prompts((1, 9, 30, 70), seed=3)
    plain = Generator(fp8_target(tiny), NoDrafter(), [], MAX_SEQ_LEN)
    want = [plain.generate(p, 30).tokens for p in prompts]
    loop = BatchGenerator(fp8_target(tiny, batch=4), [], MAX_SEQ_LEN, chunk=8)
    loop.warm_up()
    assert [r.tokens for r in loop.generate([(p, 30) for p in prompts])] == want


def test_llm_and_xrun_generate_take_an_fp8_cache_on_torch_and_refuse_it_elsewhere(tiny_engine_dir):
    with LLM(tiny_engine_dir, backend="torch", device="cpu", drafter="eagle3", kv_cache_dtype="fp8") as llm:
        assert llm.engines.engines["target"].kv[0].dtype == FP8
        assert len(llm.generate([5, 6, 7], max_new_tokens=12)[0].outputs[0].token_ids) == 12
    with pytest.raises(EngineError, match="--kv-cache-dtype fp8: the ort backend holds the KV cache in the engines'"):
        LLM(tiny_engine_dir, backend="ort", device="cpu", kv_cache_dtype="fp8")
    with pytest.raises(EngineError, match="--kv-cache-dtype 'fp4': expected one of auto, fp8"):
        LLM(tiny_engine_dir, backend="torch", device="cpu", kv_cache_dtype="fp4")
    args = ["generate", str(tiny_engine_dir), "--device", "cpu", "--prompt-ids", "5,6,7", "--max-new-tokens", "8"]
    r = CliRunner().invoke(main, [*args, "--json", "--backend", "torch", "--kv-cache-dtype", "fp8"])
    assert r.exit_code == 0 and len(json.loads(r.output.strip().splitlines()[-1])["tokens"]) == 8, r.output
    r = CliRunner().invoke(main, [*args, "--backend", "ort", "--kv-cache-dtype", "fp8"])
    assert r.exit_code == 2 and "--kv-cache-dtype fp8" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(main, [*args, "--kv-cache-dtype", "fp4"])
    assert r.exit_code == 2 and "'fp4' is not one of 'auto', 'fp8'" in r.output, r.output
