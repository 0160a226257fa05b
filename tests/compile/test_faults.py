"""Fault injection against the real commands: SIGINT / SIGTERM / SIGKILL mid-export, mid-build and
mid-training (the output is absent or complete, and the next run works without --force), two
exports into one dir at once, a full disk and a read-only output (a real tmpfs in a user+mount
namespace where the machine allows one, an injected OSError everywhere), outputs that are inputs,
and a build that would silently replace another export.

The commands run in child processes (signals, concurrency); each waits for a line its step prints
before the fault is injected, so the fault lands mid-step, not before or after it.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures import WORDS, Child, staging_leftovers

from xcompile.compile import data as textdata
from xcompile.compile.cli import main
from xcompile.compile.pipeline import ExportRequest, export_engine_dir
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.manifest import Manifest

MAX_SEQ = 64
XCOMPILE = str(Path(sys.executable).with_name("xcompile"))
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
# the TensorRT-RTX build of the tiny target takes ~2 s; a monitor that sleeps 50 ms per builder step
# stretches it past 5 s so that a signal lands inside it
SLOW_BUILD = """
import time
from xcompile.compile import build, trt_loaders
monitor = trt_loaders.progress_monitor
def slow(*args, **kwargs):
    m = monitor(*args, **kwargs)
    step = type(m).step_complete
    def step_complete(self, phase, i):
        time.sleep(0.05)
        return step(self, phase, i)
    type(m).step_complete = step_complete
    return m
build.progress_monitor = slow
from xcompile.compile import data as textdata
from xcompile.compile.cli import main
main()
"""
rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="needs TensorRT-RTX (CPU-only builds)")


def export_args(model, out, *extra) -> list:
    return ["export", "--model", model, "--out", out, "--dtype", "fp32", "--max-seq-len", MAX_SEQ, *extra]


def one_line_error(result, code: int = 1) -> str:
    """A failed command: exit ``code`` (2: a bad option), its stderr ends with one `error:` line (after any progress),
    no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]), result.stderr
    assert "Traceback" not in result.output
    return errors[0]


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# --------------------------------------------------------------------------------------------
# signals


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_mid_export_leaves_nothing(tiny_target, tmp_path, sig):
    out = tmp_path / "out"
    child = Child(XCOMPILE, *export_args(tiny_target, out))
    child.wait_for("exporting target")                     # inside torch.onnx.export
    code, seconds = child.interrupt(sig)
    assert code == EXIT[sig] and seconds < 15, (code, seconds, child.lines)
    assert child.lines[-1].strip() == "interrupted" and "Traceback" not in "".join(child.lines)
    assert not out.exists() and staging_leftovers(tmp_path) == []


def test_sigkill_mid_export_then_the_rerun_cleans_up(tiny_target, tmp_path):
    out = tmp_path / "out"
    child = Child(XCOMPILE, *export_args(tiny_target, out))
    child.wait_for("exporting target")
    assert child.interrupt(signal.SIGKILL)[0] == -signal.SIGKILL
    assert not out.exists() and staging_leftovers(tmp_path)    # a killed run cannot clean up after itself
    export_engine_dir(ExportRequest(model=str(tiny_target), out=out, dtype="fp32", max_seq_len=MAX_SEQ))
    assert staging_leftovers(tmp_path) == []                   # ... the next one does, without --force
    Manifest.load(out).verify(out, Manifest.load(out).needed_files(), full=True)


@pytest.fixture(scope="module")
def exported(tiny_target, tmp_path_factory) -> Path:
    """A target-only fp32 export (what `xcompile build` finds up to date)."""
    out = tmp_path_factory.mktemp("exported") / "tiny"
    export_engine_dir(ExportRequest(model=str(tiny_target), out=out, dtype="fp32", max_seq_len=MAX_SEQ))
    return out


def build_args(model, out) -> list:
    return ["build", "--model", model, "--dtype", "fp32", "--max-seq-len", MAX_SEQ, "--max-draft-tokens", 3,
            "--out", out, "--trt", "rtx", "--compute-capability", "8.9"]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.trt
@rtx
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_signal_mid_build_keeps_the_dir_as_it_was(tiny_target, exported, tmp_path, sig):
    """TensorRT-RTX's builder swallows exceptions raised in its callbacks: the signal is held, the
    progress monitor cancels the build, and the staged dir is dropped; the export stays untouched."""
    out = tmp_path / "tiny"
    shutil.copytree(exported, out)
    before = snapshot(out)
    child = Child(sys.executable, "-c", SLOW_BUILD, *build_args(tiny_target, out))
    child.wait_for("Building engine")                      # the progress monitor's first phase
    code, seconds = child.interrupt(sig)
    if sig == signal.SIGINT:
        assert code == 130 and seconds < 15 and child.lines[-1].strip() == "interrupted", (code, seconds, child.lines)
        assert not any("built target.engine" in line for line in child.lines)
        assert staging_leftovers(tmp_path) == []
    else:
        assert code == -signal.SIGKILL and staging_leftovers(tmp_path)
    assert snapshot(out) == before
    # the next build (no --force) cleans up and builds
    rerun = subprocess.run([XCOMPILE, *map(str, build_args(tiny_target, out))], capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0 and "up to date, not re-exported" in rerun.stderr, rerun.stderr
    assert staging_leftovers(tmp_path) == [] and (out / "target.engine").is_file()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text(textdata.DOC_SEPARATOR.join(" ".join(WORDS[(7 * d + 3 * i) % 60] for i in range(40))
                                                for d in range(30)))
    return path


def train_args(model, data, out, steps) -> list:
    return ["train-eagle3", "--model", model, "--data", data, "--out", out, "--device", "cpu", "--steps", steps,
            "--draft-vocab", 64, "--ttt-steps", 2, "--batch", 2, "--seq-len", 32]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_signal_mid_training_writes_no_head(tiny_target, corpus, tmp_path, sig):
    out = tmp_path / "head"
    child = Child(XCOMPILE, *train_args(tiny_target, corpus, out, 100_000), env={"OMP_NUM_THREADS": "1"})
    child.wait_for("step     10")                          # the first log line: training is under way
    code, seconds = child.interrupt(sig)
    if sig == signal.SIGINT:
        assert code == 130 and seconds < 15 and child.lines[-1].strip() == "interrupted", (code, child.lines)
        assert staging_leftovers(tmp_path) == []
    else:
        assert code == -signal.SIGKILL and staging_leftovers(tmp_path)
    assert not out.exists()
    result = cli(*train_args(tiny_target, corpus, out, 2))     # no --force needed; leftovers removed
    assert result.exit_code == 0, result.output
    assert staging_leftovers(tmp_path) == [] and (out / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------
# concurrency, full disks, read-only outputs


def test_a_second_export_into_the_same_dir_fails_at_once(tiny_target, tmp_path):
    out = tmp_path / "out"
    first = Child(XCOMPILE, *export_args(tiny_target, out))
    first.wait_for("exporting target")                     # it holds the lock now
    start = time.monotonic()
    with pytest.raises(EngineError, match=rf"another run is writing it \(pid {first.proc.pid} on .*xcompile export"):
        export_engine_dir(ExportRequest(model=str(tiny_target), out=out, dtype="fp32", max_seq_len=MAX_SEQ,
                                        force=True))
    assert time.monotonic() - start < 5
    assert first.finish() == 0, first.lines
    m = Manifest.load(out)
    m.verify(out, m.needed_files(), full=True)             # the first one's output, whole
    assert staging_leftovers(tmp_path) == []


def test_full_disk_is_one_line_and_leaves_nothing(tiny_target, tmp_path, monkeypatch):
    """ENOSPC raised by a write (an OSError without a file name) inside the export."""
    from xcompile.compile import pipeline

    def full_disk(module, path, **kwargs):
        path.write_bytes(b"half a graph")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(pipeline, "export_graph", full_disk)
    out = tmp_path / "out"
    line = one_line_error(cli(*export_args(tiny_target, out)))
    assert line == f"error: {out}: no space left on device; free some space there or choose another output"
    assert not out.exists() and staging_leftovers(tmp_path) == []


def test_unreadable_checkpoint_is_one_line(tiny_target, tmp_path, monkeypatch):
    """EACCES on a checkpoint file (injected: root reads everything) reaches the CLI as one line naming it."""
    from xcompile.compile import pipeline

    config = tiny_target / "config.json"

    def denied(req):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(config))
    monkeypatch.setattr(pipeline, "plan_export", denied)
    line = one_line_error(cli(*export_args(tiny_target, tmp_path / "out")))
    assert line == f"error: {config}: permission denied; check the permissions or choose another path"


def _namespaces() -> str | None:
    """Why a user+mount namespace (for a real tmpfs) is not available here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return None if probe.returncode == 0 else f"unshare refused: {probe.stderr.decode().strip()[:100]}"


def in_tmpfs(mount_options: str, command: list, mountpoint: Path) -> str:
    """Run ``command`` with a fresh tmpfs at ``mountpoint`` (private to the child), then list it."""
    script = (f"mount -t tmpfs -o {mount_options} tmpfs {mountpoint} && "
              f"{' '.join(map(str, command))}; echo \"rc=$?\"; echo \"left:[$(ls -A {mountpoint})]\"")
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                         capture_output=True, text=True, timeout=300)
    return run.stdout + run.stderr


@pytest.mark.skipif(_namespaces() is not None, reason=f"a real tmpfs needs a user+mount namespace: {_namespaces()}")
@pytest.mark.parametrize("options, meaning", [("size=256k", "no space left on device"),
                                              ("ro", "read-only file system")])
def test_real_full_and_read_only_filesystems(tiny_target, tmp_path, options, meaning):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    output = in_tmpfs(options, [XCOMPILE, *export_args(tiny_target, mnt / "out")], mnt)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(mnt / "out") in errors[0] and meaning in errors[0], output
    # a read-only mount is seen before any work, as a bad --out (exit 2); a full one when a write fails
    assert f"rc={2 if options == 'ro' else 1}" in output and "Traceback" not in output
    assert "left:[]" in output, output                     # nothing left on the tmpfs


# --------------------------------------------------------------------------------------------
# outputs that are inputs, and replacing another export


def test_outputs_that_are_inputs_are_refused(tiny_target, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(tiny_target, src)
    before = snapshot(src)
    for out in (src, src / "engines", tmp_path):
        for force in ((), ("--force",)):
            line = one_line_error(cli(*export_args(src, out, *force)), code=2)
            assert "an input of this command" in line and "with or without --force" in line
    line = one_line_error(cli("train-eagle3", "--model", src, "--data", src / "config.json", "--out", src, "--force",
                              "--device", "cpu"), code=2)
    assert "--out is " in line and "an input of this command" in line
    assert snapshot(src) == before and staging_leftovers(tmp_path) == []


def test_build_does_not_silently_replace_another_export(tiny_target, exported, tmp_path):
    out = tmp_path / "tiny"
    shutil.copytree(exported, out)
    before = snapshot(out)
    line = one_line_error(cli("build", "--model", tiny_target, "--dtype", "bf16", "--max-seq-len", MAX_SEQ,
                              "--out", out, "--trt", "rtx"))
    assert "holds another export (its dtype is fp32, the request's bf16); pass --force" in line
    assert snapshot(out) == before and staging_leftovers(tmp_path) == []
