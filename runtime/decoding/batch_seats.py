"""The batch loop's seats (batch.py): which sequence holds which KV row, who waits for one, and how a sequence
stops and gives its row back.

Slot b owns row b of the target's KV buffers and a ``Sampler`` of its own (reset with each sequence's seed and
stream, as the batch-1 loop resets one), so a sampled sequence draws what it draws alone. Sequences wait first
come, first served and take free slots between steps; nothing is cleared when a slot changes hands.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from xcompile.runtime.decoding.outcome import Result
from xcompile.runtime.decoding.sampling import Sampler
from xcompile.runtime.decoding.sequence import BatchSequence
from xcompile.runtime.decoding.speculative import accept_chain, chain_block

log = logging.getLogger("xcompile.batch")


@dataclass
class Slot:
    sampler: Sampler            # per slot: its own seed, stream and counter, as the batch-1 loop has one
    block: object = None        # a root-only chain block (sampled rows verify through accept_chain)
    seq: BatchSequence | None = None


class Seats:
    """``max_batch`` slots over ``device`` and the queue of sequences waiting for one; a sequence stops at its
    own stops or one token short of ``max_seq_len`` (the next step would write past its row)."""

    def __init__(self, device: torch.device, max_batch: int, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.slots = [Slot(Sampler(device)) for _ in range(max_batch)]
        for s in self.slots:
            s.block = chain_block(torch.zeros(1, 1, dtype=torch.int64, device=device))
        self.waiting: deque[BatchSequence] = deque()

    @property
    def running(self) -> list[BatchSequence]:
        return [s.seq for s in self.slots if s.seq is not None]

    @property
    def idle(self) -> bool:
        return not self.waiting and all(s.seq is None for s in self.slots)

    def seat(self) -> None:
        """Waiting sequences into free slots, in order; each slot's sampler reset with its sequence's seed."""
        for b, slot in enumerate(self.slots):
            if not self.waiting:
                return
            if slot.seq is None:
                q = self.waiting.popleft()
                q.slot, q.start = b, time.perf_counter()
                q.seed = slot.sampler.reset(q.sampling, q.index)
                slot.seq = q

    def sampled(self, b: int, root: int, logits: torch.Tensor) -> int:
        """Row b's next token as a plain round of the batch-1 loop verifies it (speculative.accept_chain over
        a root-only block: one coin, then the bonus draw), so the slot's stream makes the same draws."""
        slot = self.slots[b]
        slot.block.tokens.fill_(root)
        return int(accept_chain(slot.block, logits, slot.sampler).tokens[0, 0])

    def emit(self, q: BatchSequence, tokens: list[int]) -> bool:
        """Apply q's stops to its new tokens and stream them; True when q has stopped (its slot is free then).
        An exception of q's own (its stop check's detokenize, its callback) stops q alone, reason "error"."""
        try:
            kept = q.stops.push(tokens)
            if kept and q.on_tokens is not None:
                q.on_tokens(kept)
        except Exception as e:              # q's own failure: record it, never let it reach the other rows
            log.exception("a batched sequence failed in its stop check or callback")
            q.error = f"{type(e).__name__}: {e}"
            q.stops.reason = "error"
        if not q.stops.reason and q.length + 1 > self.max_seq_len:
            q.stops.reason = "max_seq_len"             # the next step would write its root past the slot
        if q.stops.reason:
            self.finish(q)
            return True
        return False

    def drop_cancelled(self) -> list[BatchSequence]:
        """Stop every sequence, waiting or seated, whose cancel event is set (reason "cancelled"); returns them."""
        ended = [q for q in self.waiting if q.cancel is not None and q.cancel.is_set()]
        for q in ended:
            self.waiting.remove(q)
        ended += [s.seq for s in self.slots if s.seq is not None and s.seq.cancel is not None
                  and s.seq.cancel.is_set()]
        for q in ended:
            q.stops.reason = "cancelled"
            self.finish(q)
        return ended

    def stop_all(self, why: str) -> list[BatchSequence]:
        """Stop every sequence, seated or waiting, with reason "error" (``why``); returns them."""
        ended = self.running + list(self.waiting)
        self.waiting.clear()
        for q in ended:
            q.error, q.stops.reason = why, "error"
            self.finish(q)
        return ended

    def finish(self, q: BatchSequence) -> None:
        """q's slot freed and its Result made from its stops and timings."""
        if q.slot >= 0:
            self.slots[q.slot].seq = None
        stats = q.stats
        stats.new_tokens = len(q.stops.tokens)
        if q.start:
            stats.decode_s = time.perf_counter() - q.start - stats.prefill_s
        q.result = Result(q.stops.tokens, stats, q.stops.reason, q.seed, q.index)
