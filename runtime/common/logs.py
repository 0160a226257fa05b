"""Logging and progress for both CLIs, through Python ``logging`` and ``rich``.

One level, set with ``-v`` / ``-q`` / ``--log-level`` on ``xcompile`` or ``xrun`` or any of their
commands, decides what xcompile prints and, mapped through ``LIBRARY_LEVELS``, what TensorRT, ONNX
Runtime and Polygraphy print. Everything logged goes to stderr; stdout holds only results (generated
text, JSON, reports), so ``xrun generate ... > out.txt`` captures the text alone.

Progress bars (``progress``) show on stderr with elapsed time and ETA when stderr is a terminal and
the level is info or lower; rich redraws them from its own thread, so a single long step (an 8B graph
export, a TensorRT build phase) still shows it is alive, and log lines print above them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass

LOGGER = "xcompile"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
DEFAULT_LEVEL = logging.INFO


@dataclass(frozen=True)
class LibraryLevels:
    """What the libraries print at one of our levels."""

    tensorrt: str           # trt.Logger severity name
    onnxruntime: int        # ORT log_severity_level: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal
    polygraphy: str         # G_LOGGER severity name (it also filters the TensorRT logger Polygraphy creates,
                            # which logs TensorRT's INFO as VERBOSE and its VERBOSE as EXTRA_VERBOSE)

    @property
    def polygraphy_python_level(self) -> int:
        """The "Polygraphy" Python logger's level: Polygraphy's WARNING/ERROR are Python's; it logs its
        verbose severities at Python levels 2-10."""
        return getattr(logging, self.polygraphy, 1)


# At our info (the default) and warning the libraries print what needs a reader: the TensorRT
# runtime its warnings; ORT and the builder (TensorRT through Polygraphy) errors only, because ORT
# warns about every constant CastLike it cannot fold and the ONNX parser about every int64 input
# ("Make sure input ... has Int64 binding"). -v (debug) opens them all fully.
LIBRARY_LEVELS = {
    logging.DEBUG: LibraryLevels("VERBOSE", 0, "EXTRA_VERBOSE"),
    logging.INFO: LibraryLevels("WARNING", 3, "ERROR"),
    logging.WARNING: LibraryLevels("WARNING", 3, "ERROR"),
    logging.ERROR: LibraryLevels("ERROR", 3, "ERROR"),
}


def logger(name: str = "") -> logging.Logger:
    """``xcompile`` or one of its children (``logger("build")`` -> ``xcompile.build``)."""
    return logging.getLogger(f"{LOGGER}.{name}" if name else LOGGER)


def level() -> int:
    """The level in force: what ``configure`` set, else (library use without a CLI) Python's default."""
    return logger().getEffectiveLevel()


def library_levels() -> LibraryLevels:
    """The libraries' levels for the level in force (the nearest one of ``LIBRARY_LEVELS`` at or above it)."""
    at = [lv for lv in sorted(LIBRARY_LEVELS) if lv >= level()]
    return LIBRARY_LEVELS[at[0] if at else logging.ERROR]


def trt_severity(trt):
    """``trt.Logger.Severity`` for the level in force (trt: the tensorrt or tensorrt_rtx module)."""
    return getattr(trt.Logger, library_levels().tensorrt)


def bind_polygraphy(g_logger) -> None:
    """Send Polygraphy's messages (and TensorRT's, through the logger Polygraphy gives it) to Python
    logging at the mapped severity, so they reach stderr like ours instead of stdout."""
    g_logger.use_python_logging_system = True
    g_logger.module_severity = getattr(g_logger, library_levels().polygraphy)
    g_logger.colors = False         # else its first message prints a "'colored' is not installed" notice to stdout


_PINNED: list = []          # the stderr our records go to while ``others_silenced`` drops everyone else's


@contextmanager
def others_silenced():
    """Within: what other code writes to stderr itself (a library's progress bars and warnings) is dropped, while
    our records still reach the stderr of before."""
    _PINNED.append(sys.stderr)
    try:
        with open(os.devnull, "w") as null, redirect_stderr(null):
            yield
    finally:
        _PINNED.pop()


class _Stderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is when a record is emitted (click's test runner and rich's
    live display each swap it), one line per record: ``message`` for info, ``level: message`` else."""

    def __init__(self):
        super().__init__()
        self.setFormatter(_Format())

    @property
    def stream(self):
        return _PINNED[-1] if _PINNED else sys.stderr

    @stream.setter
    def stream(self, _):
        pass


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.levelno >= logging.ERROR:
            message += "\n" + self.formatException(record.exc_info)
        ours = record.name == LOGGER or record.name.startswith(LOGGER + ".")
        prefix = "" if ours else f"[{record.name}] "
        if record.levelno == logging.INFO and ours:
            return message
        return f"{prefix}{record.levelname.lower()}: {message}"


def configure(lvl: int = DEFAULT_LEVEL) -> None:
    """Our messages at ``lvl`` and above to stderr; other Python loggers (torch, onnxscript, Polygraphy
    through ``bind_polygraphy``) at the mapped library level. Idempotent: replaces what it set before."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _Stderr)]:
        root.removeHandler(h)
    root.addHandler(_Stderr())
    logger().setLevel(lvl)
    root.setLevel(logging.DEBUG if lvl <= logging.DEBUG else max(logging.WARNING, lvl))   # others' info: -v only
    logging.getLogger("Polygraphy").setLevel(library_levels().polygraphy_python_level)


# --------------------------------------------------------------------------------------------
# CLI options


_META = "xcompile.log"


def level_from(verbose: int = 0, quiet: int = 0, log_level: str | None = None) -> int:
    """-v -> debug; -q -> warning, -qq -> error; --log-level NAME; none -> info. ValueError on a conflict."""
    if log_level is not None and (verbose or quiet):
        raise ValueError("give --log-level or -v/-q, not both")
    if verbose and quiet:
        raise ValueError("give -v or -q, not both")
    if log_level is not None:
        return LEVELS[log_level]
    if verbose:
        return logging.DEBUG
    if quiet:
        return logging.WARNING if quiet == 1 else logging.ERROR
    return DEFAULT_LEVEL


def add_log_options(command):
    """Give a click command or group ``-v/--verbose``, ``-q/--quiet`` and ``--log-level``. Given on the
    group or on the command (``xrun -q generate ...`` or ``xrun generate ... -q``), they configure
    logging while the command line is parsed, before the command runs."""
    import click

    def apply(ctx, param, value):
        given = ctx.find_root().meta.setdefault(_META, {})
        if value:
            given[param.name] = value
        try:
            configure(level_from(**given))
        except ValueError as e:
            raise click.UsageError(str(e), ctx) from None

    command.params += [
        click.Option(["-v", "--verbose"], count=True, expose_value=False, callback=apply,
                     help="Print debug messages, and TensorRT / ONNX Runtime / Polygraphy at their most verbose."),
        click.Option(["-q", "--quiet"], count=True, expose_value=False, callback=apply,
                     help="Print only warnings and errors (-qq: errors); hides progress and stats."),
        click.Option(["--log-level"], type=click.Choice(list(LEVELS)), expose_value=False, callback=apply,
                     help="Log level [default: info]."),
    ]
    return command


# --------------------------------------------------------------------------------------------
# progress


def _terminal() -> bool:
    return sys.stderr.isatty()


class Bar:
    """One progress bar (``progress``); every method is a no-op when bars are off."""

    def __init__(self, live=None, task=None):
        self._live, self._task = live, task

    def advance(self, n: float = 1, note: str | None = None) -> None:
        if self._live is not None:
            self._live.update(self._task, advance=n, **({} if note is None else {"note": note}))

    def update(self, completed: float | None = None, note: str | None = None) -> None:
        if self._live is not None:
            fields = {k: v for k, v in (("completed", completed), ("note", note)) if v is not None}
            self._live.update(self._task, **fields)


# the live display bars are drawn on: rich allows one at a time, so a bar opened inside another
# (train-eagle3's held-out pass inside its training bar) becomes a second line of the same display
_live: list = []


@contextmanager
def progress(description: str, total: float | None, unit: str = "") -> Iterator[Bar]:
    """A bar on stderr with elapsed time and ETA (``total`` None: no ETA), shown when stderr is a
    terminal and the level is info or lower; ``unit`` follows the counts (e.g. "steps")."""
    if not (_terminal() and level() <= logging.INFO):
        yield Bar()
        return
    if _live:
        task = _live[-1].add_task(description, total=total, note="", unit=unit)
        try:
            yield Bar(_live[-1], task)
        finally:
            _live[-1].remove_task(task)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[note]}")]
    with Progress(*columns, console=Console(file=sys.stderr, force_terminal=True), transient=True) as live:
        _live.append(live)
        try:
            yield Bar(live, live.add_task(description, total=total, note="", unit=unit))
        finally:
            _live.pop()


def each(items, description: str, unit: str = "", note: Callable[[object], str] | None = None) -> Iterator:
    """``items`` one by one under a bar that advances after each (``note(item)`` shown while it runs)."""
    items = list(items)
    with progress(description, len(items), unit) as bar:
        for item in items:
            if note is not None:
                bar.update(note=note(item))
            yield item
            bar.advance()
