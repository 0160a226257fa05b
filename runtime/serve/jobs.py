"""What the server's front (runtime/serve/app.py) hands the device's loops (runtime/serve/scheduler.py, batch_loop.py):
a request as a ``Job`` of ``Generation``s, and ``DONE``, the last event the loops post for a job."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from xcompile.runtime.decoding.sampling import GREEDY, SamplingParams


@dataclass
class Generation:
    """One choice: a prompt's ids, its token budget and stop strings, how it samples and which of the
    seed's streams it draws from (choice j of a prompt: stream j)."""

    prompt: list[int]
    max_new_tokens: int
    stop: list[str]
    sampling: SamplingParams = GREEDY
    index: int = 0


@dataclass
class Job:
    """One request's generations, run back to back in the device slot."""

    generations: list[Generation]
    deadline: float | None = None               # time.monotonic() seconds
    cancel: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False
    arrived: float = field(default_factory=time.monotonic)

    def expire(self) -> None:
        self.timed_out = True
        self.cancel.set()


DONE = object()         # the worker's last event of a job
