"""``xrun generate`` and ``xrun bench`` end to end on the tiny engine dir (CPU: ort and torch backends)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import fixtures
import pytest
import torch
from click.testing import CliRunner
from fixtures import refused

from xcompile.runtime.cli.xrun import main

PROMPT_IDS = "5,17,42,9,100,7"


def xrun(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def generate_json(engine_dir, *args) -> dict:
    code, out = xrun("generate", engine_dir, "--device", "cpu", "--json", *args)
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain(tiny_engine_dir) -> list[int]:
    out = generate_json(tiny_engine_dir, "--prompt-ids", PROMPT_IDS, "--max-new-tokens", 40, "--drafter", "none",
                        "--backend", "torch")
    assert len(out["tokens"]) >= 1
    return out["tokens"]


@pytest.mark.parametrize("backend", ["torch", "ort"])
@pytest.mark.parametrize("drafter", [
    ["--drafter", "none"],
    ["--drafter", "eagle3", "--gamma", "3"],
    ["--drafter", "eagle3", "--tree-topk", "3", "--tree-depth", "3", "--tree-tokens", "8"],
    ["--drafter", "draft-model", "--gamma", "2"],
])
def test_generate_equals_plain_greedy(tiny_engine_dir, plain, backend, drafter):
    out = generate_json(tiny_engine_dir, "--prompt-ids", PROMPT_IDS, "--max-new-tokens", 40, "--backend", backend,
                        *drafter)
    assert out["tokens"] == plain
    s = out["stats"]
    assert s["backend"] == backend and s["new_tokens"] == len(plain)
    assert s["target_forwards"] == s["rounds"] + 1
    assert s["load_s"] > 0 and s["prefill_s"] > 0 and s["decode_s"] > 0         # each phase timed apart
    if drafter[1] != "none":
        assert s["drafted"] > 0 and s["acceptance_length"] >= 1.0


def test_generate_text_prompt_chat_and_stop(tiny_engine_dir):
    out = generate_json(tiny_engine_dir, "--prompt", "the cat", "--max-new-tokens", 8, "--backend", "ort")
    assert isinstance(out["text"], str) and len(out["tokens"]) >= 1
    chat = generate_json(tiny_engine_dir, "--chat", "hello", "--max-new-tokens", 8, "--backend", "ort")
    assert len(chat["tokens"]) >= 1
    # a stop string taken from the unstopped output ends generation right there
    full = generate_json(tiny_engine_dir, "--prompt", "the cat", "--max-new-tokens", 12, "--backend", "ort",
                         "--drafter", "none")
    words = full["text"].split()
    if len(words) >= 3:
        stopped = generate_json(tiny_engine_dir, "--prompt", "the cat", "--max-new-tokens", 12, "--backend", "ort",
                                "--stop", words[2])
        assert stopped["stats"]["finish_reason"] in ("stop", "eos")
        assert len(stopped["tokens"]) <= len(full["tokens"])


def test_streamed_text_output(tiny_engine_dir):
    code, out = xrun("generate", tiny_engine_dir, "--device", "cpu", "--prompt", "the cat", "--max-new-tokens", 6,
                     "--backend", "ort")
    assert code == 0, out
    assert "tok/s" in out and "tau" in out


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", ",".join(["1"] * 300)], "exceed max_seq_len"),
    (["--prompt-ids", "1,2", "--backend", "trt"], "engine"),
    (["--prompt-ids", "1,99999"], "ids must lie in"),
    (["--prompt-ids", "1,2", "--prompt", "x"], "exactly one of"),
])
def test_bad_requests_are_one_line_errors(tiny_engine_dir, args, message):
    code, out = xrun("generate", tiny_engine_dir, "--device", "cpu", *args)
    assert code != 0
    assert message in out
    assert "Traceback" not in out


def test_a_prompt_that_leaves_no_room_is_a_bad_option_with_or_without_max_new_tokens(tiny_engine_dir):
    """The prompt and the drafter's round must fit the dir's max_seq_len: exit 2 naming the prompt's option, whether
    or not --max-new-tokens was given (without it the default budget shrinks to the room left)."""
    n = json.loads((tiny_engine_dir / "manifest.json").read_text())["max_seq_len"]
    for args, option in ((["--prompt-ids", ",".join(["1"] * (n - 1))], "--prompt-ids"),
                         (["--prompt", "the cat " * n], "--prompt")):
        for budget in ([], ["--max-new-tokens", "1"]):
            r = run("generate", tiny_engine_dir, "--device", "cpu", "--backend", "ort", *args, *budget)
            refused(r, option, f"exceed max_seq_len {n}") if not budget else refused(r, f"max_seq_len {n}")


def test_missing_engine_dir(tmp_path):
    code, out = xrun("generate", tmp_path / "nope", "--prompt-ids", "1")
    assert code == 1 and "no such engine dir" in out and "Traceback" not in out


def test_bench_runs_on_cpu(tiny_engine_dir, tmp_path):
    report_path = tmp_path / "bench.json"
    code, out = xrun("bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", "--contexts", "16",
                     "--gammas", "1,2", "--tree", "3,3,8", "--new-tokens", 8, "--repeats", 2, "--json", report_path)
    assert code == 0, out
    report = json.loads(report_path.read_text())
    drafters = {r["drafter"] for r in report["generation"]}
    assert {"plain", "eagle3 chain g=1", "eagle3 chain g=2", "eagle3 tree 3/3/8", "draft-model g=1"} <= drafters
    assert report["copy_bandwidth_gbs"] > 0 and report["floor_ms_per_token"] > 0
    # the floor at context 16 counts the KV of 16 tokens: 2 (k, v) x layers x kv heads x head_dim x 4 bytes each
    from xcompile.runtime.enginedir.manifest import Manifest
    c = Manifest.load(tiny_engine_dir).models["target"].config
    kv = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 16 * 4
    assert report["kv_bytes_per_token"] == {"16": kv}
    assert report["floor_ms_by_context"]["16"] == pytest.approx(
        report["floor_ms_per_token"] * (report["weight_bytes_per_token"] + kv) / report["weight_bytes_per_token"])
    plain = next(r for r in report["generation"] if r["drafter"] == "plain")
    assert plain["fraction_of_floor"] == pytest.approx(report["floor_ms_by_context"]["16"] / plain["ms_per_token"])
    assert "floor counting the KV bytes read" in out
    for r in report["generation"]:
        assert r["ms_per_token"] > 0 and r["tau"] >= 1.0
        if r["drafter"] != "plain":
            assert set(r["speedup_at_tau"]) == {"2.0", "3.0", "3.7"}
    steps = {(r["graph"], r["tokens"]) for r in report["steps"]}
    assert {("target", 1), ("target", 2), ("target", 3), ("eagle3", 1), ("draft", 1)} <= steps
    assert "speedup_e2e" in out
    # the longest context's prompt pass against the matmul rate of the same run
    prefill = report["prefill"]
    assert prefill["tokens"] == 16 and prefill["ttft_ms"] > 0 and prefill["matmul_tflops"] > 0
    assert prefill["fraction_of_matmul"] == pytest.approx(prefill["tflops"] / prefill["matmul_tflops"])
    assert "prefill 16 tokens: TTFT" in out


def test_bench_with_an_fp8_cache_counts_one_byte_a_kv_value(tiny_engine_dir, tmp_path):
    report_path = tmp_path / "bench.json"
    code, out = xrun("bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", "--contexts", "16",
                     "--gammas", "2", "--tree", "", "--new-tokens", 8, "--repeats", 1, "--kv-cache-dtype", "fp8",
                     "--json", report_path)
    assert code == 0, out
    report = json.loads(report_path.read_text())
    from xcompile.runtime.enginedir.manifest import Manifest
    c = Manifest.load(tiny_engine_dir).models["target"].config
    assert report["kv_cache_dtype"] == "float8_e4m3fn"
    kv = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 16        # one byte a value
    assert report["kv_bytes_per_token"] == {"16": kv}
    code, out = xrun("bench", tiny_engine_dir, "--device", "cpu", "--backend", "ort", "--contexts", "16",
                     "--kv-cache-dtype", "fp8")
    assert code == 2 and "--kv-cache-dtype fp8: the ort backend" in out and "Traceback" not in out, out


def test_bench_says_what_its_prompts_were_and_where_it_measured_speculation(tiny_engine_dir, tmp_path):
    """Random prompt ids give a meaningless tau, and drafters run at the first context only: the report
    and its JSON say both, and with --prompts name the text instead."""
    args = ("bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", "--gammas", 1, "--tree", "",
            "--new-tokens", 4, "--repeats", 1, "--num-prompts", 1, "--json", tmp_path / "bench.json")
    code, out = xrun(*args, "--contexts", "16,32")
    assert code == 0, out
    report = json.loads((tmp_path / "bench.json").read_text())
    random_ids = "random token ids (tau on random ids says nothing about real acceptance; give --prompts FILE)"
    where = "speculative decoding and step costs measured at context 16 only; context 32 ran plain decoding only"
    assert f"prompts: {random_ids}" in out.splitlines() and f"note: {where}" in out.splitlines()
    assert (report["prompts"], report["notes"], report["speculation_context"]) == (random_ids, [where], 16)
    assert {r["drafter"] for r in report["generation"] if r["context"] == 32} == {"plain"}
    text = tmp_path / "held_out.txt"
    text.write_text(" ".join(fixtures.WORDS))
    code, out = xrun(*args, "--contexts", "16", "--prompts", text)
    assert code == 0, out
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["prompts"].startswith(f"windows of {text} (") and report["notes"] == []
    assert f"prompts: {report['prompts']}" in out and "random token ids" not in out and "note:" not in out


def test_drafter_the_dir_does_not_hold(tiny_engine_dir):
    from xcompile.runtime.common.errors import EngineError
    from xcompile.runtime.decoding.registry import DrafterSpec, make_drafter
    from xcompile.runtime.engines.load import open_engine_dir

    with open_engine_dir(tiny_engine_dir, "torch", "cpu") as es:
        es.engines.pop("draft").close()
        with pytest.raises(EngineError, match="holds no draft model; rebuild with --draft-model, or use --drafter "
                                              "eagle3"):
            make_drafter(es, DrafterSpec("draft-model", 2))
        for graph in ("eagle3", "eagle3_fc"):
            es.engines.pop(graph).close()
        with pytest.raises(EngineError, match="holds no EAGLE3 head; rebuild with --eagle3, or use --drafter none"):
            make_drafter(es, DrafterSpec("eagle3", 2))
        with pytest.raises(EngineError, match="--tree-\\* needs an EAGLE3 head"):
            make_drafter(es, DrafterSpec.from_options("auto", tree_topk=2))
        assert make_drafter(es, "auto").name == "none"


# option checks: each bad or inert option fails at parse time (exit 2) or, when it depends on what the
# dir holds, before any engine loads (exit 1), with one line naming it ---------------------------------


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


@pytest.mark.parametrize("args, needles", [
    (["--drafter", "none", "--gamma", 4], ["--drafter none", "--gamma"]),
    (["--drafter", "none", "--tree-topk", 2], ["--drafter none"]),
    (["--gamma", 4, "--tree-depth", 3], ["--gamma", "--tree-", "one or the other"]),
    (["--drafter", "draft-model", "--tree-tokens", 8], ["--tree-", "draft model"]),
    (["--tree-tokens", 4], ["--tree-tokens 4", "--tree-depth 6 (the default)", "at least 7"]),
    (["--tree-topk", 2, "--tree-depth", 2, "--tree-tokens", 8], ["exceeds the 7 nodes"]),
    (["--tree-tokens", 1], ["--tree-tokens"]),
    (["--gamma", 0], ["--gamma"]),
    (["--max-new-tokens", 0], ["--max-new-tokens"]),
    (["--stop", ""], ["--stop", "empty stop string"]),
    (["--stop", "\udcfe"], ["--stop", "not valid UTF-8", "0xfe"]),
])
def test_generate_option_checks(tiny_engine_dir, args, needles):
    refused(run("generate", tiny_engine_dir, "--prompt-ids", PROMPT_IDS, *args), *needles)


@pytest.mark.parametrize("prompt", [["--prompt", "the cat"], ["--prompt-ids", PROMPT_IDS]])
def test_a_deleted_tokenizer_is_a_damaged_dir_whatever_the_prompt(tiny_engine_dir, tmp_path, prompt):
    import shutil

    damaged = shutil.copytree(tiny_engine_dir, tmp_path / "damaged")
    (damaged / "tokenizer.json").unlink()
    refused(run("generate", damaged, *prompt), f"{damaged / 'tokenizer.json'}: missing, though the dir's manifest "
            "lists it; re-export", code=1)


@pytest.mark.parametrize("args, said", [(["--log-level", "loud"], "'--log-level': 'loud' is not one of"),
                                        (["-v", "-q"], "give -v or -q, not both")])
def test_the_groups_own_options_are_refused_in_one_line(args, said):
    refused(run(*args, "generate", "x"), said, "--help')")      # was click's four-line usage block


def test_a_round_longer_than_the_dir_holds_names_its_option(tiny_engine_dir):
    # checked against the dir, before it loads (the prompt check would blame the prompt): a bad option, exit 2
    refused(run("generate", tiny_engine_dir, "--prompt-ids", PROMPT_IDS, "--gamma", 5000),
            "--gamma 5000: a round verifies 5001 tokens", "leaves no room for a prompt", code=2)


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-3"])
def test_serve_refuses_a_request_timeout_that_is_not_a_positive_number(tmp_path, value):
    # refused at parse time: no dir is opened, no port bound
    refused(run("serve", tmp_path / "nope", "--request-timeout", value), "'--request-timeout'")


@pytest.mark.parametrize("args, needles", [
    (["--prompt-ids", ""], ["no token ids"]),
    (["--prompt-ids", " , "], ["no token ids"]),
    (["--prompt", "caf\udce9"], ["--prompt", "not valid UTF-8", "0xe9"]),
    (["--chat", "\udcff"], ["--chat", "not valid UTF-8"]),
])
def test_prompt_checks(tiny_engine_dir, args, needles):
    refused(run("generate", tiny_engine_dir, *args), *needles)


def test_prompt_from_stdin(tiny_engine_dir):
    want = generate_json(tiny_engine_dir, "--prompt", "the cat sat", "--max-new-tokens", 5, "--backend", "ort")
    r = run("generate", tiny_engine_dir, "--device", "cpu", "--json", "--prompt", "-", "--max-new-tokens", 5,
            "--backend", "ort", input="the cat sat")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == want["tokens"]
    refused(run("generate", tiny_engine_dir, "--prompt", "-", input=b"the \xff cat"), "stdin is not valid UTF-8",
            "0xff")


def test_drafter_auto_options_checked_against_the_dir(tiny_engine_dir):
    """--drafter auto picks from what the dir holds; options that drafter ignores are refused before loading."""
    from types import SimpleNamespace

    from xcompile.runtime.cli.generate import GenerateRequest, check_drafter_options
    from xcompile.runtime.common.errors import EngineError
    from xcompile.runtime.decoding.registry import DrafterSpec

    only_draft = SimpleNamespace(graphs={"target": None, "draft": None}, max_seq_len=64)
    plain = SimpleNamespace(graphs={"target": None}, max_seq_len=64)
    tree = DrafterSpec.from_options(tree_depth=3)
    with pytest.raises(EngineError, match="--tree-.*draft model.*auto picks draft-model"):
        check_drafter_options(GenerateRequest("d", drafter=tree), only_draft)
    with pytest.raises(EngineError, match="would do nothing: no drafter runs.*auto picks none"):
        check_drafter_options(GenerateRequest("d", drafter=tree), plain)
    check_drafter_options(GenerateRequest("d", drafter=DrafterSpec(gamma=3)), only_draft)   # the draft model: --gamma


def test_help_shows_the_drafter_defaults():
    from xcompile.runtime.decoding.registry import DEFAULT_GAMMA, TreeShape

    text = " ".join(run("generate", "--help").output.split())
    assert f"(EAGLE3, MTP, the draft model) [default: {DEFAULT_GAMMA}]" in text
    for option, key in (("--tree-topk", "topk"), ("--tree-depth", "depth"), ("--tree-tokens", "total_tokens")):
        help_of = text.split(f"{option} INTEGER RANGE ", 1)[1].split(" --", 1)[0]
        assert f"[default: {getattr(TreeShape(), key)}]" in help_of, (option, help_of)


@pytest.mark.parametrize("args, needles", [
    (["--contexts", ""], ["--contexts", "nothing would be measured"]),
    (["--contexts", "16,0"], ["--contexts", "at least 1"]),
    (["--gammas", "1,x"], ["--gammas"]),
    (["--gammas", "1,,2"], ["--gammas", "an empty item"]),
    (["--contexts", "128,"], ["--contexts", "an empty item"]),
    (["--tree", "3,3"], ["--tree", "3 comma-separated"]),
    (["--tree", "3,5,4"], ["TOKENS 4", "at least 6"]),
    (["--draft-model", "qwen3-0.6b"], ["--draft-model", "--synthetic"]),
    (["--dtype", "fp32"], ["--dtype", "--synthetic"]),
    (["--quantize", "fp8"], ["--quantize", "--synthetic"]),
    (["--quantize", "int8"], ["--quantize", "int8"]),
    (["--yarn", "4"], ["--yarn", "--synthetic"]),
    (["--yarn", "1"], ["--yarn", "1<x<=32"]),
    (["--yarn", "inf"], ["--yarn", "1<x<=32"]),
    (["--yarn", "nan"], ["--yarn", "not a finite number"]),
    (["--peer", "--backend", "ort"], ["--peer", "--backend torch or fast"]),
    (["--new-tokens", 1], ["--new-tokens"]),
    (["--top-p", "0.9", "--seed", 2], ["--top-p, --seed: greedy runs", "--temperature T"]),
])
def test_bench_option_checks(tiny_engine_dir, args, needles):
    refused(run("bench", tiny_engine_dir, "--device", "cpu", *args), *needles)


def test_bench_outputs_checked_before_measuring(tiny_engine_dir, tmp_path):
    r = run("bench", tiny_engine_dir, "--device", "cpu", "--json", tmp_path / "missing" / "b.json")
    refused(r, "--json", "does not exist")
    refused(run("bench", tiny_engine_dir, "--device", "cpu", "--plot", tmp_path), "--plot", "is a directory")
    refused(run("bench", "--synthetic", "qwen3-0.6b", "--prompts", __file__), "--prompts", "tokenizer")
    refused(run("bench", "--synthetic", "qwen3-0.6b", "--backend", "ort"), "--synthetic runs the torch or fast")


def test_bench_synthetic_contexts_past_the_models_positions_are_refused_before_any_weights():
    """Qwen3-8B covers 40,960 positions; --yarn 4 stretches them to 131,072 as its model card does."""
    r = run("bench", "--synthetic", "qwen3-8b", "--device", "cpu", "--contexts", "128,50000")
    refused(r, "--contexts 50000", "50176 KV slots", "qwen3-8b's max_position_embeddings 40960", "--yarn 4")
    r = run("bench", "--synthetic", "qwen3-8b", "--device", "cpu", "--yarn", "4", "--contexts", "131000")
    assert "--yarn" not in refused(r, "--contexts 131000", "131072 positions (YaRN factor 4")


def test_bench_synthetic_names_without_a_shape_are_a_bad_option():
    refused(run("bench", "--synthetic", "nosuchmodel", "--device", "cpu"), "--synthetic nosuchmodel", "qwen3-8b")
    refused(run("bench", "--synthetic", "qwen3-0.6b", "--draft-model", "qwen3-99b", "--device", "cpu", "--contexts", 8),
            "--draft-model qwen3-99b", "qwen3-0.6b")


def test_bench_prompts_that_are_not_utf8_are_a_bad_option(tiny_engine_dir, tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"the cat \xff\xfe sat")
    refused(run("bench", tiny_engine_dir, "--device", "cpu", "--prompts", binary), "--prompts:",
            f"{binary} is not valid UTF-8 (byte 0xff at offset 8)")
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    refused(run("bench", tiny_engine_dir, "--device", "cpu", "--prompts", empty), "--prompts:", "holds no text")


def test_bench_plot_is_a_png(tiny_engine_dir, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (pip install -e '.[plot]')")
    png = tmp_path / "bench.png"
    r = run("bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", "--contexts", 16, "--gammas", "",
            "--tree", "", "--new-tokens", 4, "--repeats", 1, "--plot", png)
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_puts_the_paradigms_side_by_side(tiny_engine_dir, tmp_path):
    """Every speculative row of the speculation context in the design's columns (runtime/bench/paradigms.py), in
    the text report, the JSON and (with matplotlib) the plot's second panel; --mtp is for synthetic weights."""
    js, png = tmp_path / "bench.json", tmp_path / "bench.png"
    plot = ["--plot", png] if importlib.util.find_spec("matplotlib") else []
    r = run("bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", "--contexts", 16, "--gammas", 2,
            "--tree", "", "--new-tokens", 4, "--repeats", 1, "--json", js, *plot)
    assert r.exit_code == 0, r.output
    assert "three paradigms" in r.stdout
    rows = json.loads(js.read_text())["paradigms"]
    assert [(p["paradigm"], p["drafter"], p["gamma"]) for p in rows] == [("EAGLE3", "eagle3 chain g=2", 2),
                                                                         ("draft model", "draft-model g=2", 2)]
    assert all(len(p["alpha"]) == 2 and p["draft_over_verify"] is not None and p["tau"] >= 1 for p in rows)
    assert not plot or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused(run("bench", tiny_engine_dir, "--device", "cpu", "--mtp"), "--mtp", "--synthetic")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", [("generate", "--prompt-ids", "1,2"), ("bench",), ("serve",)])
def test_device_cuda_without_one_is_a_bad_option(tiny_engine_dir, command):
    """One check (run_checks.resolve_device) for every command, before anything loads or listens."""
    r = run(command[0], tiny_engine_dir, *command[1:], "--device", "cuda")
    refused(r, "--device cuda: no CUDA device is visible", "--device cpu", code=2)


def test_bench_contexts_that_do_not_fit(tiny_engine_dir):
    r = run("bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", "--contexts", "4096")
    refused(r, "--contexts 4096", "none fits", "256 tokens", code=2)
    assert "loaded" not in r.stderr

    # a round or --new-tokens that leaves no context room is named, not blamed on --contexts
    for args, named in ((("--gammas", 300), "--gammas 300"), (("--tree", "100,4,32"), "--tree 100,4,32"),
                        (("--new-tokens", 200), "--new-tokens 200")):
        r = run("bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", *args)
        refused(r, named, "max_seq_len 256", code=2)
        assert "loaded" not in r.stderr


# sampling ----------------------------------------------------------------------------------------

SAMPLED = ("--prompt-ids", PROMPT_IDS, "--max-new-tokens", 12, "--backend", "torch", "--drafter", "eagle3", "--gamma", 2)


def test_generate_samples_reproducibly(tiny_engine_dir, plain):
    a = generate_json(tiny_engine_dir, *SAMPLED, "--temperature", "0.8", "--top-p", "0.9", "--seed", 3)
    again = generate_json(tiny_engine_dir, *SAMPLED, "--temperature", "0.8", "--top-p", "0.9", "--seed", 3)
    assert again["tokens"] == a["tokens"] and again["stats"]["accepted"] == a["stats"]["accepted"]
    assert a["stats"]["seed"] == 3 and a["stats"]["sampling"] == dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0)
    many = generate_json(tiny_engine_dir, *SAMPLED, "--temperature", "0.8", "--top-p", "0.9", "--seed", 3,
                         "--num-samples", 3)["samples"]
    assert [s["stats"]["sample"] for s in many] == [0, 1, 2]
    assert many[0]["tokens"] == a["tokens"]                      # sample 0 is the single run's stream
    assert len({tuple(s["tokens"]) for s in many}) > 1
    # --sample: the dir's generation_config.json (this one sets no sampling field: transformers' defaults)
    hf = generate_json(tiny_engine_dir, *SAMPLED, "--sample", "--seed", 1)
    assert hf["stats"]["sampling"] == dict(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0)
    greedy = generate_json(tiny_engine_dir, *SAMPLED[:-4], "--max-new-tokens", 40, "--temperature", 0)
    assert greedy["tokens"] == plain and greedy["stats"]["seed"] is None


@pytest.mark.parametrize("prompt", [("--prompt", "the cat"), ("--prompt-ids", PROMPT_IDS)])
def test_samples_print_one_after_another_each_under_its_header(tiny_engine_dir, prompt):
    """stdout holds each sample's text (or ids) on lines of its own under '--- sample i ---', nothing else."""
    args = (*prompt, "--max-new-tokens", 6, "--backend", "torch", "--temperature", "0.9", "--seed", 5,
            "--num-samples", 3)
    samples = generate_json(tiny_engine_dir, *args)["samples"]
    r = run("generate", tiny_engine_dir, "--device", "cpu", *args)
    assert r.exit_code == 0, r.output
    body = [s["text"] if prompt[0] == "--prompt" else " ".join(map(str, s["tokens"])) for s in samples]
    assert r.stdout == "".join(f"--- sample {i} ---\n{b}\n" for i, b in enumerate(body))


@pytest.mark.parametrize("args, needles", [
    (["--top-p", "0.9"], ["--top-p: greedy decoding (temperature 0, the default)", "--temperature T", "--sample"]),
    (["--top-k", 5, "--min-p", "0.1", "--seed", 3], ["--top-k, --min-p, --seed: greedy decoding", "change nothing"]),
    (["--num-samples", 3], ["--num-samples: greedy decoding", "identical copies"]),
    (["--temperature", 0, "--top-p", "0.9"], ["--top-p: greedy decoding (--temperature 0)", "above 0"]),
    (["--sample", "--temperature", 0], ["--sample: greedy decoding (--temperature 0)"]),
])
def test_sampling_options_are_refused_when_decoding_is_greedy(tiny_engine_dir, args, needles):
    refused(run("generate", tiny_engine_dir, "--prompt-ids", PROMPT_IDS, *args), *needles)


def test_greedy_is_the_resolved_temperature_so_sample_takes_it_from_the_dir(tmp_path):
    """--sample's temperature comes from generation_config.json (do_sample is not consulted: --sample asks to
    sample); one of 0 makes the run greedy, and the options that would then change nothing are refused."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.0}))
    refused(run("generate", tmp_path, "--prompt-ids", "1", "--sample", "--top-p", "0.9"), "--sample, --top-p:",
            f"(temperature 0 in {tmp_path}/generation_config.json)", "--temperature above 0")


BAD_SAMPLING = [
    ("--temperature", "-1", "-1.0 is not in the range 0<=x<=100.0"),
    ("--temperature", "1e39", "1e+39 is not in the range 0<=x<=100.0"),
    ("--temperature", "1e-44", "is neither 0 (greedy) nor at least 1e-05"),
    ("--temperature", "nan", "nan is not a finite number"),
    ("--temperature", "inf", "inf is not in the range 0<=x<=100.0"),
    ("--top-p", "0", "0.0 is not in the range 0<x<=1"),
    ("--top-p", "2", "2.0 is not in the range 0<x<=1"),
    ("--top-k", "-3", "-3 is not in the range x>=0"),
    ("--min-p", "2", "2.0 is not in the range 0<=x<=1"),
    ("--seed", "-5", "-5 is not in the range 0<=x"),
]


@pytest.mark.parametrize("option, value, message", BAD_SAMPLING + [("--num-samples", "0", "0 is not in the range x>=1")])
def test_bad_sampling_values_are_bad_options(tmp_path, option, value, message):
    # the engine dir does not even exist: the value is refused at parse time, before anything is opened
    refused(run("generate", tmp_path / "nope", "--prompt-ids", "1", "--temperature", "0.5", option, value),
            f"'{option}'", message)


@pytest.mark.parametrize("option, value, message", BAD_SAMPLING)
def test_bad_bench_sampling_values_are_bad_options(tmp_path, option, value, message):
    refused(run("bench", "--synthetic", "qwen3-8b", "--temperature", "0.5", option, value), f"'{option}'", message)


def test_bench_times_a_sampling_round(tiny_engine_dir, tmp_path):
    report_path = tmp_path / "bench.json"
    code, out = xrun("bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", "--contexts", "16",
                     "--gammas", "2", "--tree", "3,3,8", "--new-tokens", 8, "--repeats", 1, "--json", report_path,
                     "--temperature", "0.7", "--top-k", "20", "--seed", "1")
    assert code == 0, out
    report = json.loads(report_path.read_text())
    assert report["sampling"].startswith("temperature 0.7 top_k 20")
    assert {("sample", 1), ("accept chain", 3), ("accept tree", 8)} <= {(r["graph"], r["tokens"]) for r in report["steps"]}
    assert all(r["tau"] >= 1.0 for r in report["generation"])


def test_prefill_flops_of_the_qwen3_8b_shape():
    """2 x non-embedding projection parameters x tokens, lm_head for one row, causal QK^T and PV: for
    Qwen3-8B's config at 4096 tokens, the projections are 6.95e9 parameters (36 layers of 4096x6144 qkv,
    4096x4096 o, 3 x 4096x12288 MLP), lm_head 151936 x 4096, attention 2 x 36 x 4096 x 4096^2."""
    from xcompile.compile.config import KNOWN_MODELS
    from xcompile.runtime.bench.costs import prefill_flops

    config = dataclasses.asdict(KNOWN_MODELS["qwen3-8b"].config)
    projections = 36 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 12288)
    want = 2 * projections * 4096 + 2 * 151936 * 4096 + 2 * 36 * 4096 * 4096 ** 2
    assert prefill_flops(config, 4096) == want


def test_a_max_new_tokens_past_the_context_is_refused_and_the_default_fits(tiny_engine_dir, tmp_path):
    """--max-new-tokens that cannot fit after the prompt is refused in one line naming it and what fits (the tiny
    dir holds 256 tokens); without it, the default 128 is cut to the room left and finishes at max_tokens there."""
    long = ",".join(["5"] * 200)
    code, out = xrun("generate", tiny_engine_dir, "--device", "cpu", "--backend", "ort", "--drafter", "none",
                     "--prompt-ids", long, "--max-new-tokens", 100)
    assert code == 2 and "--max-new-tokens 100" in out and "at most 56 fit" in out and "Traceback" not in out
    got = generate_json(tiny_engine_dir, "--prompt-ids", long, "--backend", "ort", "--drafter", "none")
    assert got["stats"]["new_tokens"] == 56 and got["stats"]["finish_reason"] == "max_tokens"


def test_a_text_prompt_on_a_dir_without_tokenizer_fails_before_loading(tiny_engine_dir, tmp_path):
    """A --prompt, --chat or --stop needs tokenizer.json: one line naming it, before any engine loads (the dir's
    graphs are broken here, so loading would fail otherwise). The dir is made as a --synthetic export is, its
    manifest listing no tokenizer."""
    import shutil

    from xcompile.runtime.enginedir.manifest import Manifest
    bare = shutil.copytree(tiny_engine_dir, tmp_path / "bare")
    m = Manifest.load(bare)
    for name in m.tokenizer_files:
        (bare / name).unlink()
        m.files.pop(name, None)
    m.tokenizer_files = []
    m.save(bare)
    (bare / "target.onnx").write_bytes(b"not loaded")
    for args in (["--prompt", "hi"], ["--chat", "hi"], ["--prompt-ids", "1,2", "--stop", "x"]):
        code, out = xrun("generate", bare, "--device", "cpu", "--backend", "ort", *args)
        assert code == 1 and "no tokenizer.json" in out and "target.onnx" not in out, out


def test_generate_row_invariant_on_the_fast_backend_and_refused_elsewhere(tiny_engine_dir):
    """--row-invariant (KernelConfig.row_invariant): on the fast backend (Triton's interpreter here) an EAGLE3
    tree gives plain greedy's tokens; on another backend it is refused in one line, before any weight loads."""
    common = ("--prompt-ids", "5,9,11,20", "--max-new-tokens", 12, "--backend", "fast", "--row-invariant")
    plain = generate_json(tiny_engine_dir, *common, "--drafter", "none")
    tree = generate_json(tiny_engine_dir, *common, "--drafter", "eagle3", "--tree-topk", 2, "--tree-depth", 3,
                         "--tree-tokens", 6)
    assert tree["tokens"] == plain["tokens"] and tree["stats"]["drafted"] > 0
    for backend in ("torch", "ort"):
        code, out = xrun("generate", tiny_engine_dir, "--device", "cpu", "--prompt-ids", "5,9", "--backend", backend,
                         "--row-invariant")
        assert code == 2 and f"--row-invariant chooses the fast backend's kernels, and this run takes the {backend}" \
            in out and "Traceback" not in out, out


def test_no_cuda_graphs_on_the_cpu_is_refused_as_inert(tiny_engine_dir):
    refused(run("generate", tiny_engine_dir, "--device", "cpu", "--prompt-ids", PROMPT_IDS, "--no-cuda-graphs"),
            "--no-cuda-graphs: steps on the CPU always run eagerly", "drop it", code=2)


@pytest.mark.parametrize("args, needles", [
    (["--prompt", ""], ["--prompt is empty"]),
    (["--prompt-ids", "1,,2"], ["--prompt-ids", "an empty id between commas"]),
    (["--prompt-ids", "5,9", "--tree-depth", 100, "--tree-tokens", 200], ["--tree-depth 100", "writes", "KV slots"]),
])
def test_generate_refuses_an_empty_prompt_a_lost_id_and_a_tree_the_dir_cannot_hold(tiny_engine_dir, args, needles):
    refused(run("generate", tiny_engine_dir, "--device", "cpu", *args), *needles, code=2)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, tiny_target) -> Path:
    """The tiny target alone: no drafter."""
    from xcompile.compile.pipeline import ExportRequest, export_engine_dir

    out = tmp_path_factory.mktemp("engines") / "plain"
    export_engine_dir(ExportRequest(model=str(tiny_target), out=out, dtype="fp32", max_seq_len=64))
    return out


@pytest.mark.parametrize("command,args,needles", [
    ("generate", ["--prompt-ids", PROMPT_IDS, "--gamma", 3], ["--gamma 3 would do nothing", "auto picks none"]),
    ("bench", ["--gammas", "2", "--tree", ""], ["--gammas", "holds no drafter"]),
    ("bench", ["--gammas", "", "--tree", "2,2,4"], ["--tree", "no EAGLE3 head or MTP module"]),
])
def test_drafting_options_on_a_dir_with_no_drafter_are_refused(plain_dir, command, args, needles):
    """Accepted, they would change nothing: --drafter auto decodes plainly and the bench times plain decoding."""
    refused(run(command, plain_dir, "--device", "cpu", *args), *needles)


@pytest.mark.parametrize("args,needles", [
    (["--plot", "{tmp}/p.txt"], ["--plot", "no '.txt' files", ".png"]),
    (["--json", "{tmp}/same", "--plot", "{tmp}/same"], ["--json and --plot both name"]),
    (["--peer"], ["--peer", "runs ort here", "--backend torch or fast"]),
])
def test_bench_output_and_peer_options_are_refused_before_anything_loads(tiny_engine_dir, tmp_path, args, needles):
    """A --plot matplotlib cannot write failed after the whole run, with its traceback; --peer on the backend
    auto picks (ort here) after the engines loaded."""
    args = [a.format(tmp=tmp_path) for a in args]
    line = refused(run("bench", tiny_engine_dir, "--device", "cpu", "--contexts", "16", "--gammas", "1", "--tree", "",
                       *args), *needles, code=2)
    assert "loaded" not in line and not list(tmp_path.iterdir())


def test_bench_of_an_engine_dir_and_synthetic_weights_says_not_both(tiny_engine_dir):
    refused(run("bench", tiny_engine_dir, "--synthetic", "qwen3-0.6b"), "--synthetic NAME, not both")
