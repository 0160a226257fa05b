"""runtime/common/interrupts.py: an interrupt that Python ignores (raised by a signal handler inside a weakref
callback or a ``__del__``) is delivered again, so a CLI command still stops (tests/compile/test_faults.py once saw
SIGTERM land in an import's module-lock callback mid-export, and the export run to its end with exit 0)."""

from __future__ import annotations

import signal
import sys
import time
import weakref

import pytest

from xcompile.runtime.common import interrupts


class Thing:
    pass


def swallowed(exc: BaseException) -> None:
    """``exc`` raised in a weakref callback, as a signal handler's raise there is: Python reports it to
    sys.unraisablehook and carries on."""
    thing = Thing()
    ref = weakref.ref(thing, lambda _: (_ for _ in ()).throw(exc))      # noqa: F841 (kept alive until the del)
    del thing


def wait_for_signal() -> None:
    for _ in range(2000):
        time.sleep(0.001)


@pytest.mark.parametrize("exc,kind", [(interrupts.Terminated, interrupts.Terminated),
                                      (KeyboardInterrupt, KeyboardInterrupt)])
def test_an_interrupt_a_callback_swallowed_is_raised_again(exc, kind):
    hook = sys.unraisablehook
    with pytest.raises(kind) as caught:
        with interrupts.sigterm_raises():
            swallowed(exc())
            wait_for_signal()                   # the signal sent again is raised here
    assert interrupts.exit_code(caught.value) == interrupts.EXIT_CODES[
        signal.SIGTERM if kind is interrupts.Terminated else signal.SIGINT]
    assert sys.unraisablehook is hook         # restored on the way out


def test_other_ignored_errors_still_reach_the_previous_hook(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value)))
    with interrupts.sigterm_raises():
        swallowed(ValueError("not an interrupt"))
    assert seen == [ValueError]
