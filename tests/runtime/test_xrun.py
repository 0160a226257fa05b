"""``xrun generate`` and ``xrun bench`` end to end on the tiny engine dir (CPU: ort and torch backends)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from xcompile.runtime.cli import main

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
    for r in report["generation"]:
        assert r["ms_per_token"] > 0 and r["tau"] >= 1.0
        if r["drafter"] != "plain":
            assert set(r["speedup_at_tau"]) == {"2.0", "3.0", "3.7"}
    steps = {(r["graph"], r["tokens"]) for r in report["steps"]}
    assert {("target", 1), ("target", 2), ("target", 3), ("eagle3", 1), ("draft", 1)} <= steps
    assert "speedup_e2e" in out


def test_drafter_the_dir_does_not_hold(tiny_engine_dir):
    from xcompile.runtime.errors import EngineError
    from xcompile.runtime.load import DrafterSpec, make_drafter, open_engine_dir

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
