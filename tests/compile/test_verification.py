"""Artifacts verified at load, bad inputs as one line: a tampered graph, engine or source checkpoint
is refused before anything runs, NaN weights and a draft model with another vocabulary are refused
at export, and a damaged manifest, a broken chat template, invalid UTF-8 or an empty prompt get one
`error:` line. Long steps of ``xrun bench`` and ``xcompile diff`` stop on SIGINT without output.

Tampered dirs are copies of the session's tiny engine dir (conftest.tiny_engine_dir), so only the
source-checkpoint test exports its own (its manifest must name a checkpoint the test may edit).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures import Child, staging_leftovers
from safetensors.torch import load_file, save_file

from xcompile.compile.cli import main as xcompile
from xcompile.compile.errors import CompileError
from xcompile.compile.export_build import inputs_changed
from xcompile.compile.pipeline import ExportRequest, export_engine_dir
from xcompile.runtime.cli.xrun import main as xrun
from xcompile.runtime.enginedir.integrity import record_file
from xcompile.runtime.enginedir.manifest import Manifest, content_digest

IDS = "5,17,42,9"
XRUN = str(Path(sys.executable).with_name("xrun"))


def run(cli, *args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def error_line(result, code: int = 1) -> str:
    """A failed command: exit 1 (2: a bad option, refused before any work), one `error:` line on stderr
    (after any progress), no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]), result.stderr
    assert "Traceback" not in result.output
    return errors[0]


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Change one bit in the middle of ``path`` (same size: only a hash can tell)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x10
    path.write_bytes(bytes(data))


def rerecord(directory: Path, name: str) -> None:
    """Record an edited file's new hashes, as if it had been exported that way."""
    m = Manifest.load(directory)
    m.files[name] = record_file(directory / name)
    m.save(directory)


@pytest.fixture
def engine_copy(tiny_engine_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_engine_dir, tmp_path / "engines"))


def test_tampered_graph_data_is_refused_at_load(engine_copy):
    ok = run(xrun, "generate", engine_copy, "--prompt-ids", IDS, "--max-new-tokens", 4, "--backend", "ort",
             "--device", "cpu", "--verify")
    assert ok.exit_code == 0, ok.output
    flip_byte(engine_copy / "target.onnx.data")
    line = error_line(run(xrun, "generate", engine_copy, "--prompt-ids", IDS, "--backend", "ort", "--device", "cpu"))
    assert "target.onnx.data: bytes " in line and "differ from what was recorded" in line and "re-export" in line
    assert "target.onnx.data: bytes " in error_line(run(xcompile, "verify", engine_copy))


def test_verify_reports_an_intact_dir(tiny_engine_dir):
    result = run(xcompile, "verify", tiny_engine_dir)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{tiny_engine_dir}: 12 files") and "every byte" in result.stdout


def test_changed_source_checkpoint_is_refused_by_the_torch_backend(tiny_target, tmp_path):
    src = Path(shutil.copytree(tiny_target, tmp_path / "ckpt"))
    out = tmp_path / "engines"
    export_engine_dir(ExportRequest(model=str(src), out=out, dtype="fp32", max_seq_len=64))
    assert inputs_changed(out, Manifest.load(out)) is None
    flip_byte(src / "model.safetensors", -5)               # the last weight's bytes: a valid file, other weights
    line = error_line(run(xrun, "generate", out, "--prompt-ids", IDS, "--backend", "torch", "--device", "cpu"))
    assert f"{src / 'model.safetensors'}: bytes " in line and "checkpoint changed since the export" in line
    ok = run(xrun, "generate", out, "--prompt-ids", IDS, "--max-new-tokens", 2, "--backend", "ort", "--device", "cpu")
    assert ok.exit_code == 0, ok.output                    # the graphs themselves are intact
    assert "model.safetensors" in inputs_changed(out, Manifest.load(out))   # `xcompile build` re-exports


def test_nan_weights_are_refused_at_export(tiny_target, tmp_path):
    src = Path(shutil.copytree(tiny_target, tmp_path / "ckpt"))
    tensors = load_file(src / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(CompileError, match=r"model.safetensors: tensor 'model.norm.weight' holds 1 NaN/Inf value"):
        export_engine_dir(ExportRequest(model=str(src), out=tmp_path / "out", dtype="fp32", max_seq_len=64))
    assert not (tmp_path / "out").exists()


def test_fp16_overflow_is_refused_at_export(tiny_target, tmp_path):
    src = Path(shutil.copytree(tiny_target, tmp_path / "ckpt"))
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"][0, 0] = 1e6                  # finite in fp32, inf in fp16
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(CompileError, match=r"tensor 'lm_head.weight' overflows torch.float16.*--dtype bf16"):
        export_engine_dir(ExportRequest(model=str(src), out=tmp_path / "out", dtype="fp16", max_seq_len=64))


def test_draft_model_with_another_vocabulary_is_refused(tiny_target, tiny_draft, tmp_path):
    draft = Path(shutil.copytree(tiny_draft, tmp_path / "draft"))
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]          # same size, two ids swapped
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    line = error_line(run(xcompile, "export", "--model", tiny_target, "--draft-model", draft, "--out",
                          tmp_path / "out", "--max-seq-len", 64))
    assert "draft model's vocabulary differs from the target's" in line and "in 2 token(s), e.g. 'cat'" in line
    (draft / "tokenizer.json").unlink()
    assert "tokenizer.json: missing" in error_line(run(xcompile, "export", "--model", tiny_target, "--draft-model",
                                                       draft, "--out", tmp_path / "out", "--max-seq-len", 64))


def test_draft_model_larger_than_its_target_is_refused(tiny_target, tiny_draft, tmp_path):
    # the roles swapped: the tiny draft as the target, the target as its draft (same vocabulary and tokenizer)
    line = error_line(run(xcompile, "export", "--model", tiny_draft, "--draft-model", tiny_target, "--out",
                          tmp_path / "out", "--max-seq-len", 64))
    assert f"--draft-model {tiny_target}:" in line and "must be smaller than its target" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(eos_token_ids=["255"]), "field 'eos_token_ids[0]' should be an integer >= 0, got '255'"),
    (lambda m: m.update(max_seq_len=None), "field 'max_seq_len' should be an integer >= 1, got None"),
    (lambda m: m["graphs"]["target"].pop("io"), "field 'graphs.target.io' is missing"),
    (lambda m: m.pop("digest"), "field 'digest' is missing"),                  # an earlier xcompile's dir
    # well-formed edits that no longer describe the graphs beside them (the torch backend asserted on the taps, ORT
    # ran on regardless): the digest refuses the manifest as a whole
    (lambda m: m["models"]["target"]["extra"].update(taps=[0, 1, 99]), "edited since xcompile wrote it"),
    (lambda m: m["models"]["target"]["config"].update(vocab_size=300), "edited since xcompile wrote it"),
    (lambda m: m.update(dtype="bf16"), "edited since xcompile wrote it"),
])
def test_damaged_manifest_is_one_line(engine_copy, edit, message):
    data = json.loads((engine_copy / "manifest.json").read_text())
    edit(data)
    (engine_copy / "manifest.json").write_text(json.dumps(data))
    for cli, args in ((xrun, ("generate", engine_copy, "--prompt-ids", IDS)), (xcompile, ("inspect", engine_copy)),
                      (xcompile, ("diff", engine_copy))):
        assert message in error_line(run(cli, *args))


def test_manifest_re_digested_after_an_edit_is_checked_against_the_graphs(engine_copy):
    """The digest keeps out edits, not someone who recomputes it: ONNX Runtime then checks the fixed dims the
    manifest records against the graph's own."""
    data = json.loads((engine_copy / "manifest.json").read_text())
    vocab = data["graphs"]["target"]["dims"]["vocab"]
    data["graphs"]["target"]["dims"]["vocab"] = vocab + 44
    data["digest"] = content_digest(data)
    (engine_copy / "manifest.json").write_text(json.dumps(data))
    line = error_line(run(xrun, "generate", engine_copy, "--prompt-ids", IDS, "--backend", "ort", "--device", "cpu"))
    assert f"logits axis 2 ('vocab') is {vocab} in the graph, {vocab + 44} in the manifest" in line
    assert "re-export the engine dir" in line


def test_bad_prompts_are_one_line(engine_copy):
    gen = ("generate", engine_copy, "--backend", "ort", "--device", "cpu")
    assert "no token ids given" in error_line(run(xrun, *gen, "--prompt-ids", ""), code=2)
    line = error_line(run(xrun, *gen, "--prompt", "hello\udcff"), code=2)
    assert "--prompt" in line and "not valid UTF-8" in line and "0xff" in line
    config = json.loads((engine_copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }"          # unclosed
    (engine_copy / "tokenizer_config.json").write_text(json.dumps(config))
    rerecord(engine_copy, "tokenizer_config.json")
    line = error_line(run(xrun, *gen, "--chat", "hi"))
    assert "the chat template line 1 cannot be rendered (TemplateSyntaxError" in line and "use --prompt" in line


def test_inspect_names_a_missing_or_resized_file(engine_copy):
    """inspect prints what it can, then says which files the dir lacks (a stat each; verify hashes them)."""
    (engine_copy / "target.onnx.data").unlink()
    with open(engine_copy / "d2t.safetensors", "ab") as f:
        f.write(b"x")
    r = run(xcompile, "inspect", engine_copy)
    assert "graph target:" in r.stdout and "damaged: target.onnx.data: missing" in r.stdout
    assert "damaged: d2t.safetensors: " in r.stdout and "recorded" in r.stdout
    line = error_line(r)
    assert "target.onnx.data: missing" in line and "re-export" in line


def test_truncated_onnx_in_inspect(engine_copy):
    (engine_copy / "draft.onnx").write_bytes((engine_copy / "draft.onnx").read_bytes()[:500])
    line = error_line(run(xcompile, "inspect", engine_copy))
    assert "draft.onnx: not a readable ONNX file" in line and "re-export" in line


# --------------------------------------------------------------------------------------------
# SIGINT in bench and diff: exit 130, no report written

# diff prints nothing until it is done: this driver says when the first comparison step starts and
# slows each one down, so the signal lands inside the comparison
SLOW_DIFF = """
import sys, time
from xcompile.compile import diff
infer = diff.EngineRunner.infer_impl
def slow(self, feed):
    print("comparing", file=sys.stderr, flush=True)
    time.sleep(0.2)
    return infer(self, feed)
diff.EngineRunner.infer_impl = slow
from xcompile.compile.cli import main
main()
"""


def test_sigint_mid_bench_writes_no_report(tiny_engine_dir, tmp_path):
    report = tmp_path / "bench.json"
    child = Child(XRUN, "bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", "--contexts", 16,
                  "--gammas", 1, "--tree", "", "--new-tokens", 8, "--repeats", 100_000, "--json", report)
    child.wait_for("loaded")
    code, seconds = child.interrupt(signal.SIGINT)
    assert code == 130 and seconds < 15 and child.lines[-1].strip() == "interrupted", (code, child.lines)
    assert not report.exists() and staging_leftovers(tmp_path) == []


def test_sigint_mid_diff_saves_nothing(tiny_engine_dir, tmp_path):
    save = tmp_path / "save"
    child = Child(sys.executable, "-c", SLOW_DIFF, "diff", tiny_engine_dir, "--save", save, "--steps", 20)
    child.wait_for("comparing")
    code, seconds = child.interrupt(signal.SIGINT)
    assert code == 130 and seconds < 15 and child.lines[-1].strip() == "interrupted", (code, child.lines)
    assert not save.exists() and staging_leftovers(tmp_path) == []
