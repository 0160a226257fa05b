"""A sequence of the batch loop (batch.py) and the loop's counts: what the loop, its drafts (batch_drafts.py) and
its lone sequence (solo.py) share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from xcompile.runtime.decoding.outcome import Result, Stats, Stops
from xcompile.runtime.decoding.sampling import SamplingParams

PAD = 0                 # the token of a step's padding positions (any valid id: no real token sees it)

@dataclass(eq=False)
class BatchSequence:
    """One sequence of the batch: its request, where it stands, and its ``result`` once it has stopped."""

    prompt: list[int]
    stops: Stops
    sampling: SamplingParams
    index: int
    cancel: threading.Event | None
    on_tokens: Callable[[list[int]], None] | None
    stats: Stats
    slot: int = -1              # the KV row it owns while running
    length: int = 0             # tokens in its KV slot (prompt chunks, then committed tokens but the root)
    root: int = -1              # the last committed token, not yet in the KV (written first by the next step)
    seed: int | None = None
    start: float = 0.0
    result: Result | None = None
    error: str | None = None    # why it stopped with reason "error" (its callback or stop check raised)
    accepting: float | None = None  # drafts it accepted a verify step, a running mean (batch_drafts.py; None: none yet)

    @property
    def prefilling(self) -> bool:
        return self.root < 0


@dataclass
class BatchStats:
    """What the loop did: target passes, and the tokens they carried (real, not padding)."""

    steps: int = 0
    solo_rounds: int = 0        # steps of a lone sequence on the batch-1 Generator: its prefill, then a round each
    prefill_tokens: int = 0
    decode_tokens: int = 0
    rows_used: list[int] = field(default_factory=list)     # [k]: steps with k + 1 occupied slots
