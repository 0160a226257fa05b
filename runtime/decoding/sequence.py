"""A sequence of the batch loop (batch.py), the loop's counts and a step's inputs: what the loop, its drafts
(batch_drafts.py) and its lone sequence (solo.py) share."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

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


def pack_step(rows: Sequence[tuple[int, BatchSequence]], need: dict[int, int], spec: Collection[int], s: int, r: int,
              slots: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A batch step's inputs: write_index [B], position_ids [B, S], input_ids [B, S] and logit_rows [B, R] for the
    occupied ``rows`` (slot, sequence), row b feeding ``need[b]`` tokens (a prefill chunk, or its root; a
    speculating row of ``spec`` its root where the drafts go, batch_drafts.place) padded with PAD to S. Built as
    lists, then sent as one tensor: each torch call gives the GIL up and waits to take it back, and under xrun
    serve the event loop holds it while a burst of requests arrives."""
    ids, write, last = [[PAD] * s for _ in range(slots)], [0] * slots, [[0] * r for _ in range(slots)]
    for b, q in rows:
        k = need[b]
        ids[b][:k] = q.prompt[q.length:q.length + k] if q.prefilling else [q.root] * k
        write[b] = q.length
        last[b] = list(range(r)) if b in spec else [k - 1] * r
    n = slots
    packed = torch.tensor(write + [w + i for w in write for i in range(s)] + [t for row in ids for t in row]
                          + [t for row in last for t in row], device=device)
    return (packed[:n], packed[n:n + n * s].view(n, s), packed[n + n * s:n + 2 * n * s].view(n, s),
            packed[n + 2 * n * s:].view(n, r))
