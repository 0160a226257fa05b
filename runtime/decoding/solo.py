"""The batch loop's lone sequence: speculation while a ``--max-batch N`` dir serves one request at a time.

A batch step verifies at most an EAGLE3 or MTP chain a row (batch_drafts.py) and runs every slot, so a lone
sequence does better on the batch-1 ``Generator``: fused verification, whole-round CUDA graphs, trees and the
draft model. A greedy sequence that arrives at an idle loop (nothing running, nothing else waiting) runs its
speculative rounds in slot 0, one round a loop step, as it would on a ``--max-batch 1`` dir. When another
sequence arrives it hands over between two rounds and goes on in the batch steps beside the newcomer: after a
round the Generator's state is the target's KV of the prompt and every committed token but the last, which is
exactly the batch loop's state of a decoding row (``length``, ``root``), so the sequence gets the same greedy
tokens either way. The head KV the Generator's drafter wrote is the batch drafter's too (one set of engines), so
the sequence drafts again from its second batch step (the first proposes from that drafter's stale seed).

Sampled sequences never run alone here: the Generator draws from its own stream, and a hand-over would switch
a sequence to its slot's, so they batch from the start (the same law, another draw). The Generator queues each
round ahead of the one the host reads (generator.py, pipelining): the one left unread at a hand-over writes only
target rows past the committed length, which the next step overwrites, and runs before it on the same stream.

Needs engines that take fewer sequences than their KV has slots (``Engine.partial_batch``: the torch and fast
backends; the ORT and TensorRT graphs fix the batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.generator import Generator
from xcompile.runtime.decoding.outcome import Run

if TYPE_CHECKING:
    from xcompile.runtime.decoding.batch_seats import Seats
    from xcompile.runtime.decoding.sequence import BatchSequence, BatchStats


class Solo:
    """The lone sequence of a batch loop and its Generator run (module docstring)."""

    def __init__(self, generator: Generator):
        self.gen = generator
        self.seq: BatchSequence | None = None
        self.run: Run | None = None
        self._emitted = 0

    def eligible(self, waiting: Sequence[BatchSequence], running: Sequence[BatchSequence]) -> bool:
        """Whether the one waiting sequence runs alone: nothing else running or waiting, greedy, and a request the
        Generator takes (its prompt leaves room for the drafter's round)."""
        if self.seq is not None or running or len(waiting) != 1 or not waiting[0].sampling.greedy:
            return False
        q = waiting[0]
        try:
            self.gen.check_request(q.prompt, q.stops.max_new_tokens, (), q.sampling)
        except EngineError:
            return False
        return True

    def start(self, q: BatchSequence) -> None:
        """Run ``q`` (seated in slot 0) on the Generator, counting into its stats; its stops stay the loop's."""
        self.seq, self._emitted = q, 0
        self.run = self.gen.stream(q.prompt, q.stops.max_new_tokens, stats=q.stats)

    def next_round(self) -> list[int] | None:
        """The next round's tokens (the first call: the prefill's first token), with ``length`` and ``root`` of the
        sequence kept as a decoding row of the batch has them; None once the run ended on its own."""
        try:
            tokens = next(self.run)
        except StopIteration:
            return None
        q = self.seq
        self._emitted += len(tokens)
        q.length, q.root = len(q.prompt) + self._emitted - 1, tokens[-1]
        return tokens

    @property
    def finish_reason(self) -> str:
        """Why the run ended on its own (after next_round returned None)."""
        return self.run.result.finish_reason if self.run is not None and self.run.result else "error"

    def release(self) -> None:
        """End the run: the sequence stopped, or goes on in the batch from where the last round left it."""
        self.seq = self.run = None

    def step(self, seats: Seats, stats: BatchStats, ended: list[BatchSequence]) -> bool:
        """One round of the lone sequence as the loop's step, when there is one; False: the step is a batch step.
        A sequence that stopped goes on ``ended``."""
        if self.seq is not None and (self.seq.result is not None or seats.waiting):
            self.release()              # cancelled (finished by drop_cancelled), or it goes on in the batch
        if self.seq is None:
            if not self.eligible(seats.waiting, seats.running):
                return False
            seats.seat()                # every slot free: it takes slot 0
            self.start(seats.slots[0].seq)
        q = self.seq
        tokens = self.next_round()
        stats.solo_rounds += 1
        if tokens is None:              # ended on its own: the loop's stops agree but for the cache's end
            q.stops.reason = q.stops.reason or self.finish_reason
            seats.finish(q)
        elif not seats.emit(q, tokens):
            return True
        self.release()
        ended.append(q)
        return True
