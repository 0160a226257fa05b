"""``xcompile diff`` through Polygraphy: passes on the tiny fp32 export, fails with a readable report
when a weight inside the ONNX data is perturbed, and saves inputs/RunResults that ``polygraphy run``
re-checks on its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch
from click.testing import CliRunner

from xcompile.compile import config
from xcompile.compile.cli import main
from xcompile.compile.compare import compare, tolerances
from xcompile.compile.diff import DiffOptions, run_diff
from xcompile.runtime.enginedir.integrity import record_file
from xcompile.runtime.enginedir.manifest import Manifest

MAX_SEQ = 64
# a KNOWN_MODELS stand-in small enough to export in seconds (the real aliases are 0.6B and up)
TINY = config.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_diff_passes_and_saves_a_reproducible_check(fp32_dir, tmp_path):
    save = tmp_path / "save"
    result = cli("diff", fp32_dir, "--backend", "ort", "--prompt", "hello world the cat is", "--steps", 3,
                 "--json", "--save", save)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["dtype"] == "fp32" and len(report["prompt_ids"]) == 5
    steps = {(r["graph"], r["step"]) for r in report["results"]}
    assert {("target", "prefill"), ("target", "decode3"), ("draft", "decode3"), ("eagle3_fc", "fc"),
            ("eagle3", "prompt"), ("eagle3", "draft3")} <= steps
    for r in report["results"]:
        assert r["max_abs"] <= 1e-4 and r["mean_abs"] <= r["max_abs"] and r["max_rel"] <= 1e-5
        assert r["cosine"] >= 1 - 1e-6
        if r["output"] == "logits":
            assert r["top1"] == 1.0 and r["top5"] == 1.0
    for graph in ("target", "draft", "eagle3", "eagle3_fc"):
        assert (save / f"{graph}.inputs.json").is_file() and (save / f"{graph}.reference.json").is_file()
    # the printed command re-runs the target check from the saved files alone (each step carries its KV)
    command = next(c for c in report["reproduce"] if "target.onnx" in c).split()
    assert command[:2] == ["polygraphy", "run"] and "--rtol" in command
    run = subprocess.run([str(Path(sys.executable).with_name("polygraphy")), *command[1:]], capture_output=True,
                         text=True)
    assert run.returncode == 0 and "Passed: 4/4 iterations" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def test_save_rewrites_its_own_output_but_never_an_engine_dir(fp32_dir, tmp_path):
    """--save replaces an earlier diff's save without --force; an engine dir (an xcompile output of another
    command) there is refused and left whole."""
    save = tmp_path / "save"
    for _ in range(2):
        assert cli("diff", fp32_dir, "--backend", "ort", "--steps", 1, "--save", save).exit_code == 0
    engine = tmp_path / "engine"
    shutil.copytree(fp32_dir, engine)
    before = sorted(p.name for p in engine.iterdir())
    result = cli("diff", fp32_dir, "--backend", "ort", "--steps", 1, "--save", engine)
    assert result.exit_code != 0 and "was not written by xcompile diff" in result.output
    assert "Traceback" not in result.output and sorted(p.name for p in engine.iterdir()) == before


def perturb(src: Path, dst: Path, tensor: str, scale: float) -> None:
    """Copy an engine dir and add noise to one weight inside target.onnx.data, recording the new
    data's hashes in the manifest: an export with other weights (a tampered file alone is refused
    at load: tests/compile/test_verification.py)."""
    shutil.copytree(src, dst)
    value = ir.load(dst / "target.onnx").graph.initializers[tensor].const_value
    with open(dst / "target.onnx.data", "r+b") as f:
        f.seek(value.offset)
        w = np.frombuffer(f.read(value.length), dtype=np.float32).copy()
        w += scale * np.random.default_rng(0).standard_normal(w.shape).astype(np.float32)
        f.seek(value.offset)
        f.write(w.tobytes())
    m = Manifest.load(dst)
    m.files["target.onnx.data"] = record_file(dst / "target.onnx.data")
    m.save(dst)


def test_diff_fails_on_a_perturbed_weight(fp32_dir, tmp_path):
    bad = tmp_path / "bad"
    perturb(fp32_dir, bad, "model.layers.3.mlp.down_proj.weight", 0.05)
    result = cli("diff", bad, "--steps", 2, "--draft-steps", 1)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("FAILED:") and "atol" in lines[-1]
    failing = [line.split()[:3] for line in lines if " FAIL " in line]
    assert ["target", "prefill", "logits"] in failing and ["target", "decode2", "hidden_taps"] in failing
    assert not any(row[0] in ("eagle3", "eagle3_fc", "draft") for row in failing)   # only the target changed
    assert "Traceback" not in result.output


def test_per_output_tolerances(fp32_dir):
    """A default tolerance and a per-output one reach the comparison."""
    tight = run_diff(fp32_dir, DiffOptions(steps=1, draft_steps=1, atol={"": 1e-12, "hidden_taps": 1.0},
                                           rtol={"hidden_taps": 1.0}))
    failed = {(r.graph, r.output) for r in tight.results if not r.passed}
    assert ("target", "logits") in failed and ("eagle3", "hidden_out") in failed
    assert ("target", "hidden_taps") not in failed
    assert "FAILED" in tight.table() and "max_abs > 1e-12" in tight.table()


def test_hidden_states_compare_to_their_own_scale():
    """Taps of ~100 with an fp32-sized error on an element near zero pass (per-element tolerances
    failed them); an error that matters, or a tensor pointing elsewhere, fails."""
    g = torch.Generator().manual_seed(0)
    ref = 100 * torch.randn(1, 5, 48, generator=g)
    ref[0, 2, 7] = 1e-6
    close = ref + 1e-6 * ref.abs().max() * torch.randn(ref.shape, generator=g)
    close[0, 2, 7] += 1.7e-4
    c = tolerances("hidden_taps", "fp32", {}, {})
    ok = compare("target", "prefill", "hidden_taps", ref, close, c)
    assert ok.passed and ok.max_rel < 1e-5 and ok.cosine > 0.99999
    off = ref.clone()
    off[0, 3] = -off[0, 3]                                  # one token's state flipped: cosine -1 on that row
    bad = compare("target", "prefill", "hidden_taps", ref, off, c)
    assert not bad.passed and bad.cosine < 0 and "cosine" in bad.why
    noisy = compare("target", "prefill", "hidden_taps", ref, ref + 0.1 * torch.randn(ref.shape, generator=g), c)
    assert not noisy.passed and "max_rel" in noisy.why


def test_logits_flip_passes_only_on_a_near_tie():
    ref = torch.tensor([[[5.0, 4.9995, 0.0], [5.0, 3.0, 0.0]]])
    flipped = torch.tensor([[[4.9995, 5.0, 0.0], [5.0, 3.0, 0.0]]])
    c = tolerances("logits", "fp32", {}, {})
    near_tie = compare("target", "decode1", "logits", ref, flipped, c)
    assert near_tie.passed and near_tie.top1 == 0.5
    # within atol element-wise, but the engine's choice is clearly worse in the reference: a real flip
    ref, got = torch.tensor([[[5.0, 3.5, 0.0]]]), torch.tensor([[[4.3, 4.4, 0.0]]])
    assert compare("target", "decode1", "logits", ref, got, {"atol": 1.0}).why == "top-1 differs beyond a near-tie"


def test_synthetic_export_round_trip(monkeypatch, tmp_path):
    """--synthetic weights come from a seeded per-tensor generator: diff rebuilds the same reference
    from the manifest's ``synthetic-hash:<name>:<seed>`` sources (target, and its head at seed + 1)."""
    monkeypatch.setitem(config.KNOWN_MODELS, "tiny-synthetic", config.KnownModel("none/tiny", TINY))
    out = tmp_path / "synthetic"
    result = cli("export", "--model", "tiny-synthetic", "--synthetic", "--seed", 3, "--eagle3", "--dtype", "fp32",
                 "--max-seq-len", 32, "--out", out)
    assert result.exit_code == 0, result.output
    m = Manifest.load(out)
    assert (m.models["target"].source, m.models["eagle3"].source) == ("synthetic-hash:tiny-synthetic:3",
                                                                      "synthetic-hash:tiny-synthetic:4")
    assert m.tokenizer_files == [] and m.inputs == {}
    result = cli("diff", out, "--steps", 2, "--draft-steps", 2)
    assert result.exit_code == 0 and result.stdout.strip().endswith("PASSED"), result.output
    # an earlier version's synthetic source (another generator): refused in one line, not other weights
    m = Manifest.load(out)                  # re-saved with its digest: an earlier xcompile wrote it so
    for entry in m.models.values():
        entry.source = entry.source.replace("synthetic-hash:", "synthetic:")
    m.save(out)
    result = cli("diff", out, "--steps", 2)
    assert result.exit_code != 0 and "drawn by an earlier xcompile" in result.output, result.output
    assert "Traceback" not in result.output


def test_bad_diff_requests(fp32_dir, tmp_path):
    def error(*args) -> str:
        result = cli("diff", *args)
        assert result.exit_code != 0 and "Traceback" not in result.output, result.output
        return result.output
    assert "no CUDA device" in error(fp32_dir, "--backend", "trt")
    assert "not both" in error(fp32_dir, "--prompt", "hi", "--prompt-ids", "1,2")
    assert "comma-separated" in error(fp32_dir, "--prompt-ids", "1,x")
    assert "OUTPUT=TOL" in error(fp32_dir, "--atol", "logits=big")
    assert "--prompt-ids: prompt ids must lie in [0, 256)" in error(fp32_dir, "--prompt-ids", "1,999")
    assert "--prompt-ids: the prompt has 1 token" in error(fp32_dir, "--prompt-ids", "5")
    # a value the dir cannot take is a bad option (exit 2) that names it
    for option in ("--steps", "--draft-steps"):
        result = cli("diff", fp32_dir, option, 5000)
        assert result.exit_code == 2 and f"{option} 5000: " in result.output, result.output
    assert "not an xcompile engine dir" in error(tmp_path)
