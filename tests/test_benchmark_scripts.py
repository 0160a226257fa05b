"""The benchmark scripts on the CPU: each parses ``--help``, and refuses a bad option (or what it cannot do here)
before it touches a GPU: one line naming what is wrong, a non-zero exit, no traceback. dump_logits.py runs the
tests' tiny model in Triton's interpreter and compares dumps; kernels.py's tables load back as tiles.json;
serve_load.py drives a real ``xrun serve`` of a tiny --max-batch 4 dir and stops it."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))
ENV = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def run(script: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=BENCHMARKS, env=ENV,
                          timeout=timeout)


def refused(done: subprocess.CompletedProcess, said: str) -> bool:
    """A non-zero exit with ``said`` in a one-line error and no traceback."""
    lines = done.stderr.strip().splitlines()
    return done.returncode != 0 and len(lines) == 1 and said in lines[0] and "Traceback" not in done.stderr


def test_every_script_is_checked_here():
    assert SCRIPTS == ["attention_splits.py", "batch_decode.py", "dump_logits.py", "export_8b.py",
                       "fast_agreement.py", "fast_decode.py", "first_request.py", "gil_handoff.py",
                       "graph_equivalence.py", "kernels.py", "kv_cache_quality.py", "open_dir.py", "ort_layers.py",
                       "qgemv_stalls.py", "qlinear_tiles.py", "quant_quality.py", "sample_kernels.py", "serve_load.py", "step_timeline.py",
                       "step_tune.py", "trace_server.py", "verify_speed.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_parses_help_and_refuses_an_unknown_option(script):
    done = run(script, "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr
    done = run(script, "--no-such-option")         # argparse: usage, then one error line (this or a missing one)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and f"{script}: error: " in last and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("script,args,said", [
    ("fast_decode.py", ["--contexts", "128,4096", "--max-seq-len", "512"],
     "--max-seq-len 512 holds no 32-token step at context 4096"),
    ("step_timeline.py", ["--contexts", "128", "--tokens", "1,32", "--max-seq-len", "150"],
     "--max-seq-len 150 is shorter than the longest step's end (160)"),
])
def test_a_cache_too_small_for_the_contexts_is_refused(script, args, said):
    assert refused(run(script, *args), said)


@pytest.mark.parametrize("script,args,said", [
    ("fast_decode.py", ["--tiles", "no-such-tiles.json"], "--tiles: no-such-tiles.json: not a tile tables file"),
    ("step_timeline.py", ["--tiles", "no-such-tiles.json"], "--tiles: no-such-tiles.json: not a tile tables file"),
    ("fast_decode.py", [], "no CUDA device is visible here"),
    ("batch_decode.py", [], "no CUDA device is visible here"),
    ("open_dir.py", [], "no CUDA device is visible here"),
    ("attention_splits.py", [], "no CUDA device is visible here"),
    ("sample_kernels.py", [], "no CUDA device is visible here"),
    ("step_timeline.py", ["--pdl", "0"], "no CUDA device is visible here"),
    ("kernels.py", [], "no CUDA device is visible here"),
    ("qlinear_tiles.py", [], "no CUDA device is visible here"),
    ("step_tune.py", [], "no CUDA device is visible here"),
    ("step_tune.py", ["--quantize", "int8"], "--quantize 'int8': expected fp8 and/or int4"),
    ("step_tune.py", ["--passes", "0"], "--passes, --layers and --context must be positive"),
    ("qlinear_tiles.py", ["--kinds", "fp8,int8"], "--kinds 'fp8,int8': expected fp8 and/or int4"),
    ("qgemv_stalls.py", ["--kinds", "fp8,int8"], "--kinds 'fp8,int8': expected fp8 and/or int4"),
    ("qgemv_stalls.py", ["--ncu", "no-such-ncu"], "no ncu at no-such-ncu"),
    ("qgemv_stalls.py", ["--ncu", sys.executable], "no CUDA device is visible here"),
    ("step_timeline.py", ["--quantize", "fp8"], "no CUDA device is visible here"),
    ("kernels.py", ["--calls", "8b,70b"], "--calls: '70b' names none of 8b.qkv, 8b.o"),
    ("fast_agreement.py", ["no-such-dir", "--gemv-all", "4,x,4"], "--gemv-all '4,x,4': expected BLOCK_N,BLOCK_K"),
    ("fast_agreement.py", ["no-such-dir", "--gemv-all", "4,64,4,5"], "AHEAD 1-4"),
    ("fast_agreement.py", ["no-such-dir", "--cuda-all", "2,4,2", "--against", "ort"], "use them with --against fast"),
    ("fast_agreement.py", ["no-such-dir", "--row-invariant", "--against", "ort"], "use them with --against fast"),
    ("fast_agreement.py", ["no-such-dir", "--device", "cpu"], "no-such-dir"),
    ("fast_agreement.py", ["--synthetic", "qwen3-8b", "--against", "ort"], "--synthetic has no ONNX graphs"),
    ("fast_agreement.py", ["no-such-dir", "--gammas", "4,0"], "--gammas '4,0': expected chain lengths >= 1"),
    ("fast_agreement.py", ["no-such-dir", "--tree", "10,6"], "--tree '10,6': expected TOPK,DEPTH,TOKENS"),
    ("dump_logits.py", ["--out", "never-written.pt"], "no CUDA device here"),
    ("dump_logits.py", ["--compare", "no-such-a.pt", "no-such-b.pt"], "no-such-a.pt: not readable as a dump"),
    ("serve_load.py", [], "give an ENGINE_DIR (a server is started) or --url of a running server, not both"),
    ("serve_load.py", ["no-such-dir", "--url", "http://127.0.0.1:9"], "give an ENGINE_DIR"),
    ("serve_load.py", ["no-such-dir"], "no-such-dir: not an engine dir (no manifest.json)"),
    ("serve_load.py", ["--url", "http://127.0.0.1:9", "--serve-args", "--device cpu"],
     "--serve-args needs an ENGINE_DIR"),
    ("serve_load.py", ["--url", "http://127.0.0.1:9", "--prompts", "no-such.txt"], "--prompts no-such.txt: no such file"),
    ("serve_load.py", ["--url", "http://127.0.0.1:9", "--json", "no-such-dir/r.json"],
     "--json no-such-dir/r.json: its folder does not exist"),
])
def test_what_a_script_cannot_do_here_is_refused_in_one_line(script, args, said):
    assert refused(run(script, *args), said)
    assert not (BENCHMARKS / "never-written.pt").exists()


def test_qgemv_stalls_reads_ncus_report(monkeypatch):
    """qgemv_stalls.py's table from Nsight Compute's text report (its layout as ncu 2025 prints it, two kernels)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))            # its imports of the other scripts, as when it runs there
    spec = importlib.util.spec_from_file_location("qgemv_stalls", BENCHMARKS / "qgemv_stalls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def kernel(us: float, barrier: float, load: float) -> str:
        rows = [("dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", 64.3), ("gpu__time_duration.sum", "us", us),
                ("smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "inst", barrier),
                ("smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio", "inst", 0),
                ("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio", "inst", load),
                ("smsp__average_warps_issue_stalled_selected_per_issue_active.ratio", "inst", 1),
                ("sm__warps_active.avg.pct_of_peak_sustained_active", "%", 12.4),
                ("smsp__issue_active.avg.pct_of_peak_sustained_active", "%", 31.08)]
        return ("  void <unnamed>::qgemv_kernel<0, 1, 1>(<unnamed>::Args) (132, 1, 1)x(288, 1, 1), Context 1, Stream 7\n"
                "    Section: Command line profiler metrics\n" + "".join(f"    {n:76} {u:>11} {v:>12}\n" for n, u, v in rows))

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.report("==PROF== Connected\n" + kernel(47.9, 2.3, 0.28) + "\n" + kernel(1234.5, 0.5, 1.5),
                      ["fp8 gate_up", "int4 down"])
    first, second = out.getvalue().splitlines()
    assert first.startswith("fp8 gate_up    ncu   47.9 us, DRAM 64.3 %, warps active 12.4 %, issuing 31.1 %")
    assert "waits 3.58 cycles an instruction: barrier 2.30, selected 1.00, long_scoreboard 0.28, gmma 0.00" in first
    assert second.startswith("int4 down      ncu 1234.5 us") and "long_scoreboard 1.50, selected 1.00, barrier 0.50" in second


def test_batch_decode_runs_the_tiny_shape_in_the_interpreter(tmp_path):
    report = tmp_path / "batch.json"
    done = run("batch_decode.py", "--tiny", "--batches", "2", "--gammas", "0,2", "--new-tokens", "3",
               "--prompt-tokens", "4", "--json", str(report), timeout=400)
    assert done.returncode == 0, done.stderr
    got = json.loads(report.read_text())
    assert [(lv["batch"], lv["gamma"]) for lv in got["levels"]] == [(2, 0), (2, 2)]
    for level in got["levels"]:             # plain steps, then steps verifying chains of 2
        assert level["one"]["tokens"] == 3 and level["all"]["tokens"] == 6
        assert level["all"]["step_ms"] > 0 and level["all"]["projected_tok_s"] > 0
    assert got["batch1"]["tok_s"] > 0


def test_dump_logits_runs_the_tiny_model_in_the_interpreter_and_compares_dumps(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    done = run("dump_logits.py", "--tiny", "--layers", "1", "--out", str(a), timeout=300)
    assert done.returncode == 0, done.stderr
    dump = torch.load(a, weights_only=True)
    assert dump["meta"]["tiny"] and dump["meta"]["layers"] == 1
    assert {"prefill.logits", "decode3.fc", "eagle3.10.hidden_out", "verify7.logits", "verify32.hidden_taps"} \
        <= set(dump)
    assert dump["verify32.logits"].shape == (1, 32, 256)
    done = run("dump_logits.py", "--compare", str(a), str(a))
    assert done.returncode == 0 and "bit-identical" in done.stdout, done.stdout + done.stderr
    dump["decode2.logits"][0, 0, 7] = dump["decode2.logits"][0, 0, 7].nextafter(torch.tensor(1.0))   # one ulp
    torch.save(dump, b)
    done = run("dump_logits.py", "--compare", str(a), str(b))
    assert done.returncode == 1 and "first difference: decode2.logits (1, 1, 256)" in done.stdout, done.stdout
    assert "1 of 256 values differ, the first at (0, 0, 7)" in done.stdout and "1 of 26 tensors differ" in done.stdout


def test_the_tuners_tables_load_back_as_tile_tables(tmp_path, monkeypatch):
    tuner = script(BENCHMARKS / "kernels.py", monkeypatch)
    shipped = tuner.shipped_tiles()
    qkv, gate_up = (6144, 4096), (12288, 4096)
    results = [{"n": 6144, "k": 4096, "chosen": {"tile": tuner.Tile(32, 256, 4, 3, 1), "gemv": None, "cuda": None}},
               {"n": 12288, "k": 4096, "chosen": {"tile": tuner.Tile(64, 256, 4, 3, 2), "gemv": tuner.Gemv(4, 512, 4, 3),
                                                  "cuda": tuner.CudaGemv(1, 8, 4)}}]
    tiles = tuner.tuned(shipped, results, "H200, 2026-12-04: python benchmarks/kernels.py --calls 8b.qkv,8b.gate_up")
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(tiles.to_json()))
    back = tuner.Tiles.load(path)
    assert back == tiles and back.provenance.startswith("H200")
    assert back.tile[qkv] == (32, 256, 4, 3, 1) and qkv not in back.gemv            # the GEMV lost: dropped
    assert back.gemv[gate_up] == (4, 512, 4, 3) and back.cuda[gate_up] == (1, 8, 4, 0)
    assert {s: t for s, t in back.tile.items() if s not in (qkv, gate_up)} == \
        {s: t for s, t in shipped.tile.items() if s not in (qkv, gate_up)}            # the others as shipped
    # --one-row: its table only, beside the shipped tile of the same split
    one_row = [{"n": 6144, "k": 4096, "chosen": {"one_row": tuner.Tile(128, 512, 8, 5, 2)}},
               {"n": 4096, "k": 4096, "chosen": {"one_row": None}}]
    back = tuner.tuned(shipped, one_row, "H100, 2026-12-07: python benchmarks/kernels.py --one-row")
    assert back.one_row[qkv] == (128, 512, 8, 5, 2) and (4096, 4096) not in back.one_row
    assert back.tile == shipped.tile and back.gemv == shipped.gemv and back.cuda == shipped.cuda
    assert gate_up in shipped.one_row and gate_up not in tiles.one_row     # retuned verify tile: its one_row gone


def test_the_step_tuners_candidates_select_their_kernel_by_table_entries(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))                         # it imports fast_decode.py and kernels.py
    tuner = script(BENCHMARKS / "step_tune.py", monkeypatch)
    shipped = tuner.shipped_tiles()
    gate_up, o = (12288, 4096), (4096, 4096)
    assert gate_up in shipped.cuda                                       # gemv.cu serves it as shipped
    tile_kernel = tuner.with_entries(shipped, gate_up, {"gemv": None, "cuda": None})
    assert gate_up not in tile_kernel.cuda and gate_up not in tile_kernel.gemv
    assert tile_kernel.tile == shipped.tile and tile_kernel.one_row == shipped.one_row    # the rest as shipped
    gemv = tuner.with_entries(shipped, o, {"gemv": tuner.GEMV[0], "cuda": None})
    assert gemv.gemv[o] == tuner.GEMV[0] and gemv.cuda == shipped.cuda
    q = tuner.with_entries(shipped, o, {"qgemv_int4": tuner.QGemv(4, 1024, 3)})
    assert q.qgemv_int4[o] == (4, 1024, 3, 0) and q.qgemv_fp8 == shipped.qgemv_fp8
    assert tuner.label_of({"gemv": None, "cuda": None}) == "tile kernel"
    assert tuner.label_of({"gemv": None, "cuda": tuner.STEP_CUDA[0]}) == f"cuda {tuple(tuner.STEP_CUDA[0])}"
    assert tuner.CudaGemv(2, 4, 8, 1) in tuner.STEP_CUDA                  # all of a small row range's weights ahead
    assert len(tuner.qgemv_candidates(132)) == 72 and tuner.QGemv(8, 2048, 2, 132) in tuner.qgemv_candidates(132)


@pytest.mark.parametrize("args,said", [(["--streams", "1,x"], "--streams: '1,x': expected positive integers"),
                                       (["--streams", "4,0"], "--streams: '4,0': expected positive integers"),
                                       (["--max-tokens", "0"], "--max-tokens: '0': expected a positive integer")])
def test_serve_load_refuses_bad_counts_as_argparse_does(args, said):
    done = run("serve_load.py", "--url", "http://127.0.0.1:9", *args)
    assert done.returncode == 2 and said in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr


@pytest.mark.parametrize("script,args,said", [
    ("fast_agreement.py", [], "give an ENGINE_DIR or --synthetic NAME, not both"),
    ("fast_agreement.py", ["some-dir", "--synthetic", "qwen3-8b"], "give an ENGINE_DIR or --synthetic NAME, not both"),
    ("fast_agreement.py", ["some-dir", "--mtp"], "--mtp / --draft-model add drafters to --synthetic weights"),
    ("fast_agreement.py", ["some-dir", "--drafters", "eagle3,none"], "--drafters 'none': expected some of eagle3,"),
    ("fast_agreement.py", ["some-dir", "--fast-only", "--against", "ort"], "--fast-only counts on the fast backend"),
    ("batch_decode.py", ["--batches", "4,0"], "--batches: '4,0': expected positive integers"),
    ("batch_decode.py", ["--new-tokens", "0"], "--new-tokens must be at least 1"),
    ("batch_decode.py", ["--gammas", "3,-1"], "--gammas: '3,-1': expected chain lengths >= 0"),
    ("batch_decode.py", ["--tau", "0.5"], "--tau must be at least 1 (the bonus token)"),
    ("open_dir.py", ["--new-tokens", "0"], "--new-tokens must be at least 1"),
    ("kv_cache_quality.py", ["--window", "0"], "--window must be at least 1"),
    ("kv_cache_quality.py", ["--heldout", "no-such.txt"], "--heldout no-such.txt: no such file"),
    ("attention_splits.py", ["--chunks", "64,100"], "--chunks: each a multiple of 64 keys"),
    ("attention_splits.py", ["--rows", "1,65"], "--rows: at most 64 rows a call"),
    ("attention_splits.py", ["--row-tiles", "16,24"], "--row-tiles: each 16, 32 or 64"),
    ("attention_splits.py", ["--contexts", "4096", "--cache", "4100"], "--cache 4100: shorter than the longest context"),
    ("open_dir.py", ["--json", "no-such-dir/r.json"], "--json no-such-dir/r.json: its folder does not exist"),
    ("gil_handoff.py", ["--intervals", "0,5"], "--intervals: '0,5': expected numbers in (0, 1000)"),
    ("first_request.py", ["some-dir", "--requests", "0"], "--requests must be at least 1"),
    ("first_request.py", ["some-dir", "--idle", "-1"], "--idle takes 0-60 seconds"),
    ("first_request.py", ["some-dir", "--json", "no-such-dir/r.json"], "--json no-such-dir/r.json: its folder"),
    ("first_request.py", ["no-such-dir"], "no-such-dir: not an engine dir (no manifest.json)"),
    ("gil_handoff.py", ["--waits", "-3"], "--waits: '-3': expected a positive integer"),
    ("trace_server.py", ["some-dir", "--requests", "0"], "--requests must be at least 1"),
    ("trace_server.py", ["some-dir", "--min-ms", "0"], "--min-ms takes (0, 1000] ms"),
    ("trace_server.py", ["no-such-dir"], "no-such-dir: not an engine dir (no manifest.json)"),
])
def test_bad_options_are_refused_as_argparse_does(script, args, said):
    done = run(script, *args)
    assert done.returncode == 2 and said in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr


def test_gil_handoff_times_the_waits_alone_and_beside_a_busy_thread_at_each_interval():
    done = run("gil_handoff.py", "--waits", "10", "--repeats", "1", "--intervals", "2,0.5")
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and [line.split(":")[0] for line in lines] == [
        f"switch interval {ms} ms, {how}" for ms in ("2", "0.5") for how in ("alone", "beside a busy thread")]
    assert all(line.endswith(" ms") and "10 waits of 20 µs in " in line for line in lines), lines


def test_fast_agreement_counts_every_drafter_against_plain_greedy_and_the_tables_read_it(capsys, monkeypatch):
    """count(), the check --fast-only keeps, over tiny torch engines of the synthetic flow (EAGLE3, MTP, a draft
    model): plain greedy once per prompt, a line per chain and tree that scripts/perf_tables.py reads back."""
    import types

    from xcompile.compile.config import Qwen3Config
    from xcompile.compile.reference import reference_engines, synthetic_manifest
    from xcompile.runtime.decoding.registry import TreeShape
    from xcompile.runtime.engines.load import EngineSet

    agree = script(BENCHMARKS / "fast_agreement.py", monkeypatch)
    tables = script(BENCHMARKS.parent / "scripts" / "perf_tables.py", monkeypatch)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    manifest = synthetic_manifest("qwen3-8b", 64, "fp32", mtp=True, config=cfg)
    engines = reference_engines(manifest, "cpu")
    es = EngineSet(None, manifest, "torch", engines, d2t=engines["eagle3"].module.d2t, mtp_d2t=None)
    args = types.SimpleNamespace(gammas=[1, 3], tree=[TreeShape(2, 2, 4)], drafters=["eagle3", "mtp"], new_tokens=8)
    prompts = [[5, 9, 2, 7], [11, 3, 3, 1]]
    with torch.inference_mode():
        gaps = agree.count(args, prompts, None, es)
    out = capsys.readouterr().out
    assert gaps == []                                   # fp32 on the CPU: every run is plain greedy's
    parsed = tables.parse_agreement_log(out, "count")
    assert "teacher" not in parsed
    assert [d["drafter"] for d in parsed["drafters"]] == ["eagle3 chain g=1", "eagle3 chain g=3", "eagle3 tree 2/2/4",
                                                          "mtp chain g=1", "mtp chain g=3", "mtp tree 2/2/4"]
    assert all(d["torch"] is None and (d["same"], d["n"]) == ("2", "2") for d in parsed["drafters"])
    assert "Counted on the fast backend alone" in tables.render_agreement(parsed)[0]


def script(path: Path, monkeypatch):
    """A script's module, imported from its file (in sys.modules for the test: its dataclasses look it up there)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def batch4_dir(tiny_target, tmp_path_factory):
    import fixtures

    pytest.importorskip("fastapi", reason="needs the serve extra (pip install -e '.[serve]')")
    pytest.importorskip("openai", reason="needs the openai client (pip install -e '.[dev]')")
    return fixtures.exported_dir(tmp_path_factory, "tiny-batch4", model=str(tiny_target), dtype="fp32", max_batch=4)


def test_first_request_times_each_request_after_the_warm_up_and_profiles_the_first(tiny_target, tmp_path_factory,
                                                                                  tmp_path):
    import fixtures

    batch = fixtures.exported_dir(tmp_path_factory, "tiny-batch4", model=str(tiny_target), dtype="fp32", max_batch=4)
    out = tmp_path / "first.json"
    done = run("first_request.py", str(batch), "--device", "cpu", "--backend", "torch", "--requests", "3",
               "--new-tokens", "5", "--idle", "0", "--profile", "1", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [r["steps"] for r in report["requests"]] == [5, 5, 5]       # a lone greedy request: a step a token
    assert all(r["first_ms"] > 0 and r["second_ms"] > 0 for r in report["requests"])
    first, second, _ = report["requests"]
    assert "function calls" in first["profile"] and second["profile"] is None
    assert [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("request")] == [
        "request 0 after idle", "request 1", "request 2 after idle"]
    one = fixtures.exported_dir(tmp_path_factory, "tiny-batch1", model=str(tiny_target), dtype="fp32")
    done = run("first_request.py", str(one), "--device", "cpu", "--backend", "torch")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "a --max-batch 1 dir runs no batch loop" in last and "Traceback" not in done.stderr


def test_trace_server_traces_each_request_on_every_server_thread(batch4_dir, tmp_path):
    """Each request's timeline holds the event loop's and the engine thread's calls, not the tracer's own, and the
    server is stopped after."""
    done = run("trace_server.py", str(batch4_dir), "--serve-args", "--device cpu --backend torch", "--requests", "2",
               "--out", str(tmp_path), "--min-ms", "0.05", timeout=300)
    assert done.returncode == 0, done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("request")] == [
        "request 0", "request 1"]
    for n in range(2):
        threads = {line.split()[2] for line in (tmp_path / f"request-{n}.txt").read_text().splitlines()}
        assert "MainThread" in threads and any(t.startswith("xcompile-engine") for t in threads), threads
        assert "xcompile-trace" not in threads
    engine = [line for line in (tmp_path / "request-0.txt").read_text().splitlines() if "xcompile-engine" in line]
    assert any("BatchGenerator.step batch.py:" in line for line in engine)     # a Python frame: its file and line
    assert any(".py:" not in line for line in engine)                          # a C call (a torch op): neither
    assert not (tmp_path / "tracing").exists()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_serve_load_drives_xrun_serve_at_each_concurrency_and_stops_it(batch4_dir, tiny_target, tmp_path_factory,
                                                                       tmp_path, monkeypatch):
    import fixtures

    from xcompile.runtime.decoding.drafters import NoDrafter
    from xcompile.runtime.decoding.generator import Generator
    from xcompile.runtime.engines.load import open_engine_dir

    out, png = tmp_path / "load.json", tmp_path / "load.png"
    done = run("serve_load.py", str(batch4_dir), "--serve-args", "--device cpu --backend ort", "--streams", "1,4",
               "--per-stream", "2", "--max-tokens", "6", "--lengths", "3", "--json", str(out), "--plot", str(png),
               timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["server_exit_status"] == 143                      # stopped by SIGTERM (128 + 15)
    assert gone(report["server"]["pid"]), "xrun serve outlived the benchmark"
    assert report["server"]["drafter"] == "plain" and report["server"]["backend"] == "ort"
    assert png.read_bytes().startswith(b"\x89PNG")

    # what each request gets alone from the batch-1 Generator (the tiny model may stop early at its EOS)
    load = script(BENCHMARKS / "serve_load.py", monkeypatch)
    args = load.argparse.Namespace(prompts=None, prompt_tokens=16)
    single = fixtures.exported_dir(tmp_path_factory, "tiny-batch1", model=str(tiny_target), dtype="fp32")
    with open_engine_dir(single, "ort", "cpu") as es:
        g = Generator(es.engines["target"], NoDrafter(), es.manifest.eos_token_ids, es.manifest.max_seq_len)
        expected = [len(g.generate(p, 6).tokens) for p in load.make_prompts(args, 8)]

    assert [lv["streams"] for lv in report["levels"]] == [1, 4]
    for lv in report["levels"]:
        n = 2 * lv["streams"]
        assert (lv["requests"], lv["ok"], lv["errors"], lv["rate_limited"]) == (n, n, 0, 0), lv
        got = [(r["tokens"], r["usage_tokens"]) for r in lv["per_request"]]
        assert got == [(e, e) for e in expected[:n]], (got, expected)     # every stream got all its tokens
        assert lv["tokens"] == sum(expected[:n]) and lv["tokens_per_s"] > 0
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
            assert 0 < lv[key]["p50"] <= lv[key]["p90"] <= lv[key]["p99"], (key, lv[key])
        assert lv["ttft_ms"]["p99"] <= lv["latency_ms"]["p99"]
        assert 0 < lv["refused_ms"]["p50"] <= lv["refused_ms"]["p99"]         # N requests refused (404), timed
        assert 0 < lv["server_ttft_ms_mean"] <= lv["ttft_ms"]["p99"]     # the server's share of the level's TTFTs
        steps = lv["server_steps"]      # ONNX Runtime fixes the batch: no lone runs, every step a batch step
        assert list(steps) == ["batch_prompt", "batch"] and all(s["count"] > 0 and s["mean_ms"] > 0
                                                               for s in steps.values())
    first = report["first_request"]             # alone before the levels; the server's TTFT histogram says its part
    assert 0 < first["server_ttft_ms"] and 0 < first["ttft_ms"] < first["latency_ms"]
    assert first["server_steps"]["batch_prompt"]["count"] == 1 and first["server_steps"]["batch"]["count"] > 0
    lengths = report["prompt_lengths"]          # prompts of 16, 17 and 18 ids, one at a time
    assert (lengths["requests"], lengths["ok"], lengths["lengths"]) == (3, 3, [16, 18])
    assert list(lengths["ttft_ms_by_length"]) == ["16", "17", "18"]
    assert lengths["slowest"]["ttft_ms"] == max(lengths["ttft_ms_by_length"].values())
    assert lengths["slowest"]["length"] in (16, 17, 18) and lengths["slowest"]["over_median"] >= 1
    # the table (head, two levels), the first request and its engine steps, each level's engine steps and
    # refusals, the lengths
    # the server's garbage collections: in the report for each part, and a line where it had any
    for part in (*report["levels"], first, lengths):
        assert all(g in ("0", "1", "2") and v["count"] > 0 and v["total_ms"] >= 0 for g, v in part["server_gc"].items())
    gc_lines = [line for line in done.stdout.splitlines() if "the server's garbage collections: generation" in line]
    assert len(gc_lines) == sum(bool(part["server_gc"]) for part in (*report["levels"], first, lengths))
    out_lines = [line for line in done.stdout.strip().splitlines() if line not in gc_lines]
    assert len(out_lines) == 10 and "tok/s" in out_lines[0], done.stdout
    assert out_lines[3].startswith("first request after ready: TTFT") and "its own mean at 1 stream" in out_lines[3]
    assert out_lines[4].startswith("the first request, the server's engine steps (count x mean): batch_prompt 1 x ")
    assert out_lines[5].startswith("1 stream(s), the server's engine steps (count x mean): batch_prompt ")
    assert out_lines[6].startswith("1 stream(s), as many requests refused before generating (404): ")
    assert out_lines[7].startswith("4 stream(s), the server's engine steps (count x mean): batch_prompt ")
    assert out_lines[8].startswith("4 stream(s), as many requests refused before generating (404): ")
    assert "prompt lengths 16-18" in out_lines[9]


def test_serve_load_refuses_a_prompt_file_shorter_than_its_longest_window(tmp_path):
    text = tmp_path / "few.txt"
    text.write_text(" ".join(["word"] * 40))
    done = run("serve_load.py", "--url", "http://127.0.0.1:9", "--prompts", str(text), "--lengths", "10")
    assert refused(done, f"--prompts {text}: fewer than 41 words (--prompt-words 32 + --lengths 10 - 1)")
    assert done.returncode == 2


def test_serve_load_reports_a_server_that_fails_to_start_in_one_line(batch4_dir, tmp_path):
    import shutil

    broken = shutil.copytree(batch4_dir, tmp_path / "broken")
    (broken / "target.onnx").write_bytes(b"not an onnx graph")
    done = run("serve_load.py", str(broken), "--serve-args", "--device cpu --backend ort", "--streams", "1",
               timeout=300)
    assert refused(done, "xrun serve exited (1): error:") and "target.onnx" in done.stderr, done.stderr
