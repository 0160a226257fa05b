"""Log levels and progress (runtime/common/logs.py): -v/-q/--log-level change what both CLIs print, the
libraries' levels follow, everything but results goes to stderr, and progress bars (with ETA) go
there too."""

from __future__ import annotations

import json
import logging
import re

import fake_trt
import pytest
from click.testing import CliRunner

from xcompile.runtime.cli.xrun import main as xrun_main
from xcompile.runtime.common import logs

PROMPT_IDS = "5,17,42,9,100,7"


@pytest.fixture(autouse=True)
def restore_level():
    yield
    logs.configure(logs.DEFAULT_LEVEL)


def xrun(*args, input=None):
    return CliRunner().invoke(xrun_main, [str(a) for a in args], input=input)


def test_level_from_options():
    assert logs.level_from() == logging.INFO
    assert logs.level_from(verbose=1) == logging.DEBUG
    assert logs.level_from(quiet=1) == logging.WARNING
    assert logs.level_from(quiet=2) == logging.ERROR
    assert logs.level_from(log_level="error") == logging.ERROR
    with pytest.raises(ValueError, match="-v or -q"):
        logs.level_from(verbose=1, quiet=1)
    with pytest.raises(ValueError, match="--log-level or -v/-q"):
        logs.level_from(quiet=1, log_level="debug")


def test_library_levels_follow_ours():
    trt = fake_trt.FakeTrt()
    logs.configure(logging.DEBUG)
    assert (logs.library_levels().onnxruntime, logs.trt_severity(trt)) == (0, trt.Logger.VERBOSE)
    assert logging.getLogger("Polygraphy").level < logging.DEBUG          # Polygraphy's verbose severities pass
    logs.configure(logging.INFO)
    assert (logs.library_levels().onnxruntime, logs.trt_severity(trt)) == (3, trt.Logger.WARNING)
    assert logging.getLogger("Polygraphy").level == logging.ERROR
    logs.configure(logging.ERROR)
    assert logs.trt_severity(trt) == trt.Logger.ERROR


def test_ort_sessions_take_the_mapped_severity(tiny_engine_dir):
    from xcompile.runtime.engines import ort

    for level, severity in ((logging.DEBUG, 0), (logging.INFO, 3)):
        logs.configure(level)
        engine = ort.load(tiny_engine_dir, "eagle3_fc", "cpu")
        assert engine.session.get_session_options().log_severity_level == severity
        engine.close()


def test_polygraphy_warnings_follow_the_level_and_errors_are_collected(capsys):
    from polygraphy.logger import G_LOGGER

    from xcompile.compile.trt_loaders import polygraphy_errors

    for level, shown in ((logging.DEBUG, True), (logging.INFO, False)):
        logs.configure(level)
        with polygraphy_errors() as errors:
            G_LOGGER.warning("a builder warning")
            G_LOGGER.error("a parser error")
        err = capsys.readouterr()
        assert errors == ["a parser error"]
        assert ("a builder warning" in err.err) == shown and "a builder warning" not in err.out


@pytest.mark.parametrize("flags, stats, debug", [
    ([], True, False),
    (["-q"], False, False),
    (["--log-level", "error"], False, False),
    (["-v"], True, True),
])
def test_log_levels_change_what_generate_prints(tiny_engine_dir, flags, stats, debug):
    """The text goes to stdout whatever the level; the stats line (info) and debug lines to stderr."""
    r = xrun("generate", tiny_engine_dir, "--device", "cpu", "--backend", "ort", "--prompt", "the cat",
             "--max-new-tokens", 6, *flags)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() and "tok/s" not in r.stdout
    assert ("tok/s" in r.stderr and "tokens per verify round" in r.stderr) == stats
    assert bool(re.search(r"load \d+\.\d\d s, warm-up \d+\.\d\d s, prefill \d+\.\d ms, decode \d+\.\d{3} s", r.stderr)) == stats
    assert ("debug: opened" in r.stderr) == debug


def test_log_options_on_the_group_or_the_command(tiny_engine_dir):
    args = ["--device", "cpu", "--backend", "ort", "--prompt-ids", PROMPT_IDS, "--max-new-tokens", 4]
    assert xrun("-q", "generate", tiny_engine_dir, *args).stderr == ""
    assert xrun("generate", tiny_engine_dir, *args, "-q").stderr == ""
    r = xrun("-v", "generate", tiny_engine_dir, *args, "-q")
    assert r.exit_code == 2 and "give -v or -q, not both" in r.stderr


def test_json_alone_on_stdout(tiny_engine_dir):
    r = xrun("generate", tiny_engine_dir, "--device", "cpu", "--backend", "ort", "--prompt-ids", PROMPT_IDS,
             "--max-new-tokens", 4, "--json", "-v")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["stats"]["new_tokens"] == 4 and "debug:" in r.stderr


def test_progress_bars_go_to_stderr(tiny_engine_dir, tmp_path, monkeypatch):
    """With a terminal on stderr, bench draws a bar with ETA there; stdout holds the report alone, and
    --json writes its file (--plot, which needs the plot extra, is tested in tests/runtime/cli/test_xrun.py)."""
    monkeypatch.setattr(logs, "_terminal", lambda: True)
    report = tmp_path / "bench.json"
    r = xrun("bench", tiny_engine_dir, "--device", "cpu", "--backend", "torch", "--contexts", 16, "--gammas", 1,
             "--tree", "", "--new-tokens", 4, "--repeats", 1, "--json", report)
    assert r.exit_code == 0, r.output
    assert "measurements" in r.stderr and "eta" in r.stderr and "\x1b[" in r.stderr     # a live bar, redrawn
    assert "eta" not in r.stdout and "\x1b[" not in r.stdout
    assert r.stdout.startswith("device cpu") and "speedup_e2e" in r.stdout
    assert json.loads(report.read_text())["generation"]


def test_no_bar_without_a_terminal_or_when_quiet(monkeypatch, capsys):
    for terminal, level in ((False, logging.INFO), (True, logging.WARNING)):
        monkeypatch.setattr(logs, "_terminal", lambda t=terminal: t)
        logs.configure(level)
        with logs.progress("work", 3, "items") as bar:
            bar.advance()
        assert capsys.readouterr().err == ""


def test_nested_bars_share_one_display(monkeypatch, capsys):
    monkeypatch.setattr(logs, "_terminal", lambda: True)
    logs.configure(logging.INFO)
    with logs.progress("outer", 2, "steps") as outer:
        for _ in logs.each(range(3), "inner", "batches"):
            pass
        outer.advance()
    err = capsys.readouterr().err
    assert "outer" in err and "inner" in err
