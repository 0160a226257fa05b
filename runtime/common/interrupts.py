"""SIGINT and SIGTERM: every long step stops within seconds, cleans up, and exits 130 (143 for SIGTERM).

Python turns SIGINT into KeyboardInterrupt, so staged outputs (runtime/common/files.py) are removed on the
way out. SIGTERM would kill the process without that, so the CLIs raise ``Terminated`` (a
KeyboardInterrupt) for it. Native code that calls back into Python (the TensorRT builder's progress
monitor) swallows exceptions raised in the callback; there the signal is recorded by ``deferred``
and the callback asks ``pending()`` to cancel the build, and the interrupt is raised once it returned.
Python itself ignores an exception raised in a weakref callback or a ``__del__``: a signal that lands in one
(an import's module-lock callback, mid-export) is delivered again (``sigterm_raises``), else the command ran to
its end after SIGTERM and exited 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}      # 128 + signal number, as shells report


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every cleanup path runs."""


def interrupt_for(signum: int) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def exit_code(e: KeyboardInterrupt) -> int:
    return EXIT_CODES[signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT]


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """For the duration (a CLI command), SIGTERM raises ``Terminated``, and an interrupt Python ignored (module
    docstring) is delivered again; the previous handler and hook come back after."""
    if not _main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    hook = sys.unraisablehook

    def unraisable(u) -> None:
        if isinstance(u.exc_value, KeyboardInterrupt):
            # an interrupt Python ignored: the signal again 50 ms later, from a timer thread, so that its handler
            # runs once this hook and the callback are left (sent at once, it raised inside the hook, ignored again)
            signum = signal.SIGTERM if isinstance(u.exc_value, Terminated) else signal.SIGINT
            timer = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            timer.daemon = True
            timer.start()
        else:
            hook(u)

    previous = signal.signal(signal.SIGTERM, handler)
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = hook
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def deferred() -> Iterator[Callable[[], bool]]:
    """Hold SIGINT/SIGTERM during a block: they are recorded, not raised; ``pending()`` (yielded)
    says whether one came. On leaving, the first one is raised as KeyboardInterrupt/Terminated
    (replacing any error the block raised because it was cancelled). Off the main thread, where
    Python delivers no signals, the block runs as is."""
    got: list[int] = []
    if not _main_thread():
        yield lambda: False
        return

    def record(signum, frame):
        got.append(signum)

    previous = {s: signal.signal(s, record) for s in SIGNALS}
    try:
        yield lambda: bool(got)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if got:
            raise interrupt_for(got[0])
