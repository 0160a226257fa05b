"""``xcompile``'s option checks: every bad option fails at once, with one line naming it, before any
export, build or training starts; and ``xcompile build DIR`` builds from an existing export with the
builder controls TensorRT users expect."""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures import refused

from xcompile.compile.cli import main

rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="needs TensorRT-RTX")


def xcompile(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.txt"
    path.write_text("some text\n")
    return path


@pytest.mark.parametrize("args, needles", [
    (["--steps", -1], ["--steps", "-1"]),
    (["--steps", 0], ["--steps", "0"]),                 # no longer "one epoch"
    (["--tokens", 0], ["--tokens"]),
    (["--ttt-steps", 0], ["--ttt-steps"]),
    (["--batch", 0], ["--batch"]),
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--lr", "-1e-3"], ["--lr"]),
    (["--lr", "inf"], ["--lr", "inf"]),
    (["--minutes", 0], ["--minutes"]),
    (["--draft-vocab", 0], ["--draft-vocab"]),
    (["--seq-len", 2], ["--seq-len"]),
    (["--seq-len", 8, "--ttt-steps", 7], ["--seq-len 8", "--ttt-steps 7", "at least 9"]),
    (["--steps", 10, "--tokens", 1000], ["--steps and --tokens"]),
    (["--max-new-tokens", 64], ["--max-new-tokens", "--regenerate"]),
    (["--max-new-tokens", 0, "--regenerate"], ["--max-new-tokens"]),
])
def test_train_eagle3_options_are_checked_before_training(args, needles, data, tmp_path):
    out = tmp_path / "head"
    refused(xcompile("train-eagle3", "--model", "no-such-model", "--data", data, "--out", out, "--device", "cpu",
                     *args), *needles)
    assert not out.exists()


def test_train_eagle3_out_must_be_writable(data, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    refused(xcompile("train-eagle3", "--model", "x", "--data", data, "--out", blocker / "head"), "--out",
            "not a writable directory")


@pytest.mark.parametrize("args, needles, code", [
    (["--max-draft-tokens", -5], ["--max-draft-tokens", "-5"], 2),
    (["--max-seq-len", 0], ["--max-seq-len"], 2),
    (["--max-batch", 0], ["--max-batch"], 2),
    (["--compute-capability", "abc"], ["--compute-capability", "abc", "MAJOR.MINOR"], 2),
    (["--builder-optimization-level", 6], ["--builder-optimization-level", "6"], 2),
    (["--workspace", "0"], ["--workspace"], 2),
    (["--workspace", "lots"], ["--workspace", "512M"], 2),
    (["--seed", 3], ["--seed", "--synthetic"], 2),
    (["--max-seq-len", 32, "--max-draft-tokens", 32], ["--max-draft-tokens 32", "at most 31"], 2),
    # TensorRT flavor and targets: checked before the export (they used to fail after a whole one); a missing library
    # is the machine's (1), a value the chosen builder cannot take a bad option (2)
    (["--trt", "tensorrt"], ["TensorRT is not installed", "pip install"], 1),
    (["--trt", "rtx", "--compute-capability", "9.0"], ["9.0", "targets", "--trt tensorrt"], 2),
    (["--trt", "rtx", "--timing-cache", "t.cache"], ["--timing-cache", "full TensorRT only"], 2),
])
def test_build_options_are_checked_before_exporting(args, needles, code, tiny_target, tmp_path, monkeypatch):
    if code == 1 and importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.skip("needs TensorRT-RTX installed (the check names what it supports)")
    if "tensorrt" in args:
        monkeypatch.setitem(__import__("sys").modules, "tensorrt", None)     # full TensorRT absent, whatever is here
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    r = xcompile("build", "--model", tiny_target, "--out", out, *args)
    refused(r, *needles, code=code)
    assert not out.exists() and "exporting" not in r.output


def test_build_needs_a_model_or_a_directory(tiny_engine_dir, tiny_target):
    refused(xcompile("build"), "--model", "DIRECTORY")
    refused(xcompile("build", tiny_engine_dir, "--model", tiny_target), "--model", "exported already")
    refused(xcompile("build", tiny_engine_dir, "--out", tiny_engine_dir.parent / "elsewhere"), "--out",
            "writes its engines into it; give no --out")
    refused(xcompile("build", tiny_engine_dir, "--dtype", "fp16", "--max-seq-len", 64), "--dtype, --max-seq-len")


@pytest.mark.parametrize("args, needles", [
    (["--max-seq-len", 0], ["--max-seq-len"]),
    (["--max-batch", -1], ["--max-batch"]),
    (["--max-batch", 100_000_000], ["--max-batch", "1<=x<=1024"]),        # ran the export out of host memory
    (["--seed", 1], ["--seed", "--synthetic"]),
])
def test_export_options(args, needles, tiny_target, tmp_path):
    refused(xcompile("export", "--model", tiny_target, "--out", tmp_path / "out", *args), *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, needles", [
    (["--steps", -1], ["--steps"]),
    (["--draft-steps", -2], ["--draft-steps"]),
    (["--atol", "nan"], ["--atol", "finite"]),
    (["--rtol", "logits=-1"], ["--rtol"]),
    (["--atol", "foo=1e-3"], ["--atol", "no graph has an output 'foo'", "logits"]),
    (["--atol", "logits=1e-3", "--atol", "logits=1"], ["--atol", "'logits=1'", "already has a tolerance"]),
    (["--rtol", "1e-3", "--rtol", "2e-3"], ["--rtol", "the default already has a tolerance"]),
    (["--device", "tpu"], ["--device", "cpu, cuda or cuda:N"]),
    (["--prompt", "caf\udcff"], ["--prompt", "not valid UTF-8", "0xff"]),
    (["--prompt-ids", "1,x"], ["--prompt-ids"]),
])
def test_diff_options(args, needles, tiny_engine_dir):
    refused(xcompile("diff", tiny_engine_dir, *args), *needles)


def test_diff_prompt_from_stdin_and_bad_stdin(tiny_engine_dir):
    refused(xcompile("diff", tiny_engine_dir, "--prompt", "-", input=b"\xff\xfe"), "stdin is not valid UTF-8")
    r = xcompile("diff", tiny_engine_dir, "--prompt", "-", "--steps", 1, "--draft-steps", 1, "--json",
                 input="the cat sat on")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_engine_dir / "tokenizer.json")).encode("the cat sat on", add_special_tokens=False).ids
    assert report["passed"] and report["prompt_ids"] == ids


@pytest.mark.trt
@rtx
def test_build_from_an_existing_export_with_builder_controls(tiny_engine_dir, tmp_path):
    """`xcompile build DIR` builds engines from the ONNX graphs there (no export), records the builder
    controls, keeps up-to-date engines and rebuilds when a control changes."""
    directory = tmp_path / "tiny"
    shutil.copytree(tiny_engine_dir, directory)
    onnx = {p.name: p.stat().st_mtime_ns for p in directory.glob("*.onnx*")}
    r = xcompile("build", directory, "--trt", "rtx", "--compute-capability", "8.9", "--workspace", "256M",
                 "--builder-optimization-level", 1)
    assert r.exit_code == 0, r.output
    assert "export" not in r.stderr and {p.name: p.stat().st_mtime_ns for p in directory.glob("*.onnx*")} == onnx
    manifest = json.loads((directory / "manifest.json").read_text())
    assert set(manifest["engines"]) == set(manifest["graphs"])
    for e in manifest["engines"].values():
        assert (directory / e["file"]).stat().st_size > 0
        assert e["builder"] == {"workspace": 256 * 2**20, "optimization_level": 1}
    assert r.stdout.startswith(f"{directory}: ")
    same = xcompile("build", directory, "--trt", "rtx", "--compute-capability", "8.9", "--workspace", "256M",
                    "--builder-optimization-level", 1)
    assert same.exit_code == 0 and same.stderr.count("up to date, kept") == len(manifest["graphs"]), same.stderr
    other = xcompile("build", directory, "--trt", "rtx", "--compute-capability", "8.9", "--builder-optimization-level", 0)
    assert other.exit_code == 0 and "up to date" not in other.stderr, other.stderr
    assert {e["builder"]["optimization_level"] for e in json.loads((directory / "manifest.json").read_text())[
        "engines"].values()} == {0}


@pytest.mark.trt
@rtx
def test_builder_controls_reach_the_tensorrt_rtx_config():
    """create_config hands workspace and optimization level to the IBuilderConfig TensorRT-RTX gets."""
    from xcompile.compile.trt_loaders import create_config, polygraphy_backend

    trt, poly = polygraphy_backend("rtx")
    builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    network = builder.create_network(0)
    x = network.add_input("x", trt.float32, (1, 4))
    network.mark_output(network.add_identity(x).get_output(0))
    loader = create_config(trt, poly, "rtx", [], (), None, None, workspace=3 * 2**20, optimization_level=2)
    config = loader(builder, network)
    assert config.builder_optimization_level == 2
    assert config.get_memory_pool_limit(trt.MemoryPoolType.WORKSPACE) == 3 * 2**20


@pytest.mark.parametrize("command", [["export"], ["build"], ["quantize", "--scheme", "fp8"], ["train-eagle3", "--data"],
                                     ["train-mtp", "--data"]])
def test_an_empty_model_is_a_bad_option_not_the_current_directory(command, tmp_path):
    if command[-1] == "--data":
        (tmp_path / "d.txt").write_text("some text\n")
        command = [*command, tmp_path / "d.txt"]
    refused(xcompile(*command, "--model", " ", "--out", tmp_path / "x"), "--model", "an empty value")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command, option", [(["quantize", "--scheme", "fp8"], "--calibration"),
                                             (["train-eagle3"], "--data"), (["train-mtp"], "--heldout")])
def test_text_files_that_are_not_utf8_or_hold_no_text_are_bad_options(command, option, tiny_target, tmp_path):
    """Checked before the target loads (minutes for an 8B model), gzip-compressed ones too."""
    good, binary, empty, gz = (tmp_path / n for n in ("good.txt", "bin.txt", "empty.txt", "bad.txt.gz"))
    good.write_text("some text\n")
    binary.write_bytes(b"text \xff\xfe")
    empty.write_text("\n \n")
    gz.write_bytes(gzip.compress(b"\xff"))
    data = [] if option == "--data" else ["--data", good] if command[0] != "quantize" else []
    for bad, said in ((binary, "is not valid UTF-8"), (empty, "holds no text"), (gz, "is not valid UTF-8")):
        refused(xcompile(*command, "--model", tiny_target, *data, option, bad, "--out", tmp_path / "x"), option, said)
    assert not (tmp_path / "x").exists()


def test_revision_picks_the_cached_snapshot(tiny_target, tmp_path, monkeypatch):
    """--revision reaches resolution: the export reads the snapshot of that revision and records it."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / ("ab" * 20)
    shutil.copytree(tiny_target, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text("ab" * 20)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    refused(xcompile("export", "--model", "org/tiny", "--out", tmp_path / "x", "--revision", "v2"),
            "at revision 'v2'", "--revision v2", code=1)
    refused(xcompile("export", "--model", "qwen3-0.6b", "--synthetic", "--out", tmp_path / "x", "--revision", "v1"),
            "--revision", "--synthetic")
    refused(xcompile("export", "--model", tiny_target, "--synthetic", "--out", tmp_path / "x"),
            f"--model {tiny_target}: no synthetic weights in that shape", "qwen3-0.6b")
    assert not (tmp_path / "x").exists()
    r = xcompile("export", "--model", "org/tiny", "--revision", "v1", "--out", tmp_path / "out", "--dtype", "fp32",
                 "--max-seq-len", 16)
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["models"]["target"]["source"] == str(snapshot)
