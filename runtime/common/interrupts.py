"""SIGINT and SIGTERM: every long step stops within seconds, cleans up, and exits 130 (143 for SIGTERM).

Python turns SIGINT into KeyboardInterrupt, so staged outputs (runtime/common/files.py) are removed on the
way out. SIGTERM would kill the process without that, so the CLIs raise ``Terminated`` (a
KeyboardInterrupt) for it. Native code that calls back into Python (the TensorRT builder's progress
monitor) swallows exceptions raised in the callback; there the signal is recorded by ``deferred``
and the callback asks ``pending()`` to cancel the build, and the interrupt is raised once it returned.
"""

from __future__ import annotations

import contextlib
import signal
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
    """For the duration (a CLI command), SIGTERM raises ``Terminated``; the previous handler comes back after."""
    if not _main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
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
