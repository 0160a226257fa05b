"""runtime/common/files.py: staged outputs, one writer per output, never over an input, leftovers of killed
runs removed, OS errors as one line. Plain files, no models: these run in milliseconds."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest

from xcompile.runtime.common import files
from xcompile.runtime.common.errors import EngineError, OptionError


def write_into(out, content: str = "new", replace: bool = False, **kw):
    with files.staged_dir(out, "test", replace=replace, **kw) as tmp:
        (tmp / "f.txt").write_text(content)


def siblings(out) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def test_staged_dir_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError):
        with files.staged_dir(out, "test") as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("failed mid-way")
    assert not (tmp_path / "a").exists()                    # parents made for it are gone too
    write_into(out)
    assert (out / "f.txt").read_text() == "new" and files.written_by_xcompile(out)
    assert json.loads((out / files.MARKER).read_text())["written_by"] == "test"
    assert siblings(out) == []                              # no staging dir, no lock file


@pytest.mark.parametrize("where", [".", "", "inner"])
def test_the_current_directory_is_never_replaced(tmp_path, monkeypatch, where):
    """--out . (or "", or a dir holding the current one) with --force would pull the directory the process and the
    user's shell stand in from under them: refused, the dir as it was."""
    out = tmp_path / "out"
    write_into(out, "first")
    (out / "inner").mkdir()
    monkeypatch.chdir(out / "inner" if where == "inner" else out)
    with pytest.raises(EngineError, match="is the current directory"):
        write_into(".." if where == "inner" else where, "second", replace=True)
    assert (out / "f.txt").read_text() == "first" and (out / "inner").is_dir()


def test_replace_needs_force_and_only_replaces_what_xcompile_wrote(tmp_path):
    out = tmp_path / "out"
    write_into(out, "first")
    with pytest.raises(EngineError, match="already exists; pass --force"):
        write_into(out, "second")
    write_into(out, "second", replace=True)
    assert (out / "f.txt").read_text() == "second"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model.safetensors").write_text("weights")
    with pytest.raises(EngineError, match="not written by xcompile; refusing to replace it, even with --force"):
        write_into(theirs, replace=True)
    assert (theirs / "model.safetensors").read_text() == "weights"
    empty = tmp_path / "empty"
    empty.mkdir()
    write_into(empty, replace=True)                         # an empty dir holds nothing to lose
    for shipped in (files.SHIPPED / "mtp", files.SHIPPED / "new"):    # the demo models the package ships
        with pytest.raises(EngineError, match="part of the installed xcompile package"):
            write_into(shipped, replace=True)
    assert not (files.SHIPPED / "new").exists()
    with pytest.raises(EngineError, match="exists and is not a directory"):
        write_into(theirs / "model.safetensors", replace=True)


@pytest.mark.parametrize("where, relation", [("same", "is"), ("inside", "lies inside"), ("parent", "contains")])
def test_an_output_never_touches_an_input(tmp_path, where, relation):
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "config.json").write_text("{}")
    out = {"same": source, "inside": source / "sub", "parent": tmp_path}[where]
    with pytest.raises(EngineError, match=f"--out {relation} .*ckpt, an input of this command.*with or without --force"):
        write_into(out, replace=True, inputs=[source])
    link = tmp_path / "link"
    link.symlink_to(source)                                 # through a symlink too
    with pytest.raises(EngineError, match="an input of this command"):
        write_into(out, replace=True, inputs=[link])
    assert sorted(p.name for p in source.iterdir()) == ["config.json"]
    with pytest.raises(EngineError, match="--json lies inside"):
        with files.staged_file(source / "bench.json", "test", inputs=[source], option="--json"):
            pass


def test_staged_file(tmp_path):
    out = tmp_path / "new" / "report.json"
    with pytest.raises(KeyboardInterrupt):
        with files.staged_file(out, "test") as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert not (tmp_path / "new").exists()
    for text in ("one", "two"):                             # a file the user names is rewritten
        with files.staged_file(out, "test") as tmp:
            tmp.write_text(text)
    assert out.read_text() == "two" and siblings(out) == []


def test_a_file_of_a_dir_xcompile_wrote_is_not_written_over(tmp_path):
    """--json engines/x/manifest.json replaced an engine dir's manifest (a hostile-input probe): refused, exit 2;
    a new file beside it is written."""
    out = tmp_path / "engines"
    write_into(out, "weights")
    with pytest.raises(OptionError, match=f"{out / 'f.txt'}: a file of the dir .* --json over it"):
        with files.staged_file(out / "f.txt", "test", option="--json") as tmp:
            tmp.write_text("report")
    assert (out / "f.txt").read_text() == "weights"
    with files.staged_file(out / "report.json", "test", option="--json") as tmp:
        tmp.write_text("report")
    assert (out / "report.json").read_text() == "report"


def test_leftovers_of_killed_runs_are_removed_by_the_next_run(tmp_path):
    out = tmp_path / "out"
    write_into(out, "old")
    partial = tmp_path / ".out.abcd1234.partial"            # a run killed while writing
    partial.mkdir()
    (partial / "target.onnx").write_text("half")
    other = tmp_path / ".out.b.abcd1234.partial"            # staging of the output "out.b": not ours to remove
    other.mkdir()
    (tmp_path / ".out.lock").write_text('{"pid": 1}')       # its lock file (the kernel dropped the lock)
    write_into(out, "new", replace=True)
    assert (out / "f.txt").read_text() == "new"
    assert siblings(out) == [".out.b.abcd1234.partial"]


def test_a_swap_killed_between_its_renames_is_undone(tmp_path):
    """The previous output waits in an .old dir while the new one is renamed in: if the process dies
    right there, the next run puts the previous output back before anything else."""
    out = tmp_path / "out"
    write_into(out, "old")
    held = tmp_path / ".out.abcd1234.old"
    held.mkdir()
    out.rename(held / "out")
    with pytest.raises(EngineError, match="already exists"):
        write_into(out, "new")
    assert (out / "f.txt").read_text() == "old" and siblings(out) == []


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from xcompile.runtime.common import files
        with files.staged_dir({str(out)!r}, "xcompile export"):
            print("holding", flush=True)
            sys.stdin.readline()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(EngineError, match=rf"another run is writing it \(pid {holder.pid} on .*`xcompile export"):
            write_into(out, replace=True)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
    finally:
        holder.kill()
    write_into(out, replace=True)                           # released: the next writer goes ahead


@pytest.mark.parametrize("code, meaning", [(errno.ENOSPC, "no space left on device; free some space"),
                                           (errno.EACCES, "permission denied; check the permissions"),
                                           (errno.EROFS, "read-only file system; choose a path on a writable")])
def test_os_errors_inside_a_staged_write_are_one_line(tmp_path, code, meaning):
    out = tmp_path / "out"
    with pytest.raises(EngineError, match=f"^{out}: {meaning}") as e:
        with files.staged_dir(out, "test") as tmp:
            (tmp / "part").write_text("x")
            raise OSError(code, os.strerror(code))          # as a write() raises it: no file name
    assert "\n" not in str(e.value) and not out.exists() and siblings(out) == []
    named = OSError(code, os.strerror(code), "/data/model.safetensors")
    assert files.os_error_line(named).startswith("/data/model.safetensors: ")


def test_unwritable_place_fails_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(EngineError, match=f"{blocker / 'out'}: cannot write there: not a directory"):
        write_into(blocker / "out")
    assert blocker.read_text() == "x" and siblings(blocker) == []
