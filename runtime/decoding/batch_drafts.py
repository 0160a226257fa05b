"""Speculation under load: in a step of the batch loop every greedy decoding sequence verifies its own chain.

    drafts = BatchDrafts(Eagle3ChainDrafter(eagle3, fc, d2t, k=3), max_batch=16, max_seq_len=4096)
    loop = BatchGenerator(target, eos_ids, 4096, drafts=drafts)

A step of the batch loop (batch.py) starts with one ``propose`` over every slot (the head's k - 1 single-token
steps for all rows at once) and feeds each greedy decoding row its root and those k drafts; the target's pass
verifies every row's chain, and each row keeps the longest prefix of drafts the target's argmax agrees with plus
the bonus token: 1 to k + 1 tokens a step, plain greedy's tokens. After the pass one ``feed`` of the head over
every row keeps its KV and its next proposal current: a decoding row's emitted tokens paired with the target's
features at the rows that verified them, a prefilling row's prompt chunk shifted by one (feature t goes with
token t + 1: the next prompt token, or at the prompt's end the first generated one), so the head's prompt pass
rides along with the target's chunks and a sequence speculates from its first decode step.

Sampled sequences (their draws follow the batch-1 loop's plain rounds, batch.py) and rows with less than the
drafter's lookahead left in their slot decode one token a step; their drafts are proposed with the others' and
dropped. The drafter's state only decides how many drafts are accepted, never which tokens come out.

A step verifies chains only while it pays: while the drafting rows' running mean of accepted drafts reaches
BREAK_EVEN, else it decodes one token a row and verifies once every PROBE steps to measure again (``pays``).

The chain's length (docs/design.md, "Speculation under load"): a step runs every slot, so k + 1 tokens a row put
max_batch * (k + 1) rows through the target, and the fast kernels take up to MAX_ROWS (64) rows a call (more go
to the reference modules, several times slower a step); so k <= MAX_ROWS // max_batch - 1: 6 up to --max-batch
9, 3 at 16, none past 32 (the loop then decodes one token a row). A lone greedy sequence runs the batch-1
Generator instead (solo.py: fused verification, whole-round graphs, trees) and continues here when another
arrives, its head KV already written (the two drafters share the engines; the first step's proposal starts
from this drafter's stale seed, after which its own feed takes over).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.drafters import Eagle3ChainDrafter
from xcompile.runtime.decoding.registry import DrafterSpec
from xcompile.runtime.decoding.sequence import PAD
from xcompile.runtime.engines.graphs import Capture, GraphedEngine
from xcompile.runtime.engines.kernels import MAX_ROWS

if TYPE_CHECKING:
    from xcompile.runtime.decoding.sequence import BatchSequence


# When a step verifies chains (BatchDrafts.plan): a verify step of chains of 3 a row costs 1.6-1.7x a plain step on
# an H100 at 4-16 slots (9.9 / 6.1 ms at 4, 11.2 / 6.6 ms at 16, the head's passes graphed; two calls of two days,
# docs/performance.md),
# so it pays while the drafting rows accept 0.7 drafts a step on average; below that the loop decodes plainly
# and verifies once every PROBE steps to measure the acceptance again.
BREAK_EVEN = 0.7
PROBE = 32
RATE = 0.25         # the weight of a verify step's accepted drafts in a row's running mean


def max_gamma(max_batch: int) -> int:
    """The longest chain a batch step of ``max_batch`` slots verifies within MAX_ROWS rows (0: none)."""
    return max(0, MAX_ROWS // max_batch - 1)


def batch_chain(spec: DrafterSpec, max_batch: int) -> DrafterSpec:
    """What a batch step of ``max_batch`` slots drafts for a loop speculating with ``spec`` (resolved): its EAGLE3
    or MTP chain, or a tree's depth as a chain, of at most max_gamma drafts; DrafterSpec("none") for the draft
    model (its own KV pass per row is not batched), plain decoding and batches too wide for any chain."""
    gamma = min(spec.gamma if spec.tree is None else spec.tree.depth, max_gamma(max_batch))
    if spec.name not in ("eagle3", "mtp") or gamma < 1:
        return DrafterSpec("none")
    return replace(spec, gamma=gamma, tree=None)


class BatchDrafts:
    """An EAGLE3 or MTP chain drafter over every slot of a batch loop (module docstring)."""

    def __init__(self, drafter: Eagle3ChainDrafter, max_batch: int, max_seq_len: int, device: torch.device,
                 break_even: float = BREAK_EVEN):
        """break_even: the accepted drafts a verify step a drafting row must average for a step to verify chains
        (0: every step with a drafting row verifies)."""
        if not isinstance(drafter, Eagle3ChainDrafter):
            raise EngineError(f"batched speculation drafts EAGLE3 or MTP chains, not {drafter.name!r}; a "
                              "lone sequence speculates with any drafter (solo)")
        if drafter.k > max_gamma(max_batch):
            raise EngineError(f"batched speculation: a chain of {drafter.k} drafts in {max_batch} slots is "
                              f"{max_batch * (drafter.k + 1)} rows a step, past {MAX_ROWS}; use gamma <= "
                              f"{max_gamma(max_batch)}")
        device = torch.device(device)
        drafter.bind(max_seq_len, device, batch=max_batch, track=False)
        self.drafter, self.gamma = drafter, drafter.k
        self.max_batch, self.max_seq_len, self.device = max_batch, max_seq_len, device
        self.fed = False            # propose needs a seed: the head's first feed makes it
        self.break_even = break_even
        self.plain = 0              # steps since the last verify step

    def record(self, capture: Capture, sizes: Sequence[int]) -> None:
        """Replay the head's fixed-shape passes from CUDA graphs, as the loop does its target steps
        (``GraphedEngine``): the proposals' one-token steps, and feeds of the loop's recorded ``sizes`` (one token,
        a chain's k + 1, padded prompt chunks) a row."""
        d = self.drafter
        d.eagle3 = GraphedEngine(d.eagle3, sizes, capture)
        if d.fc is not None:
            d.fc = GraphedEngine(d.fc, sizes, capture)

    def speculates(self, q: BatchSequence) -> bool:
        """Whether q verifies drafts this step: greedy, decoding, and room for the drafter's round."""
        return q.sampling.greedy and not q.prefilling and q.length + self.drafter.lookahead <= self.max_seq_len

    def plan(self, rows: Sequence[tuple[int, BatchSequence]]) -> tuple[torch.Tensor | None, set[int]]:
        """This step's chains (``propose``) and the slots that verify theirs: none unless the step pays (``pays``)."""
        drafting = [(b, q) for b, q in rows if self.speculates(q)]
        chains = self.propose(rows) if drafting and self.pays([q for _, q in drafting]) else None
        return chains, {b for b, _ in drafting} if chains is not None else set()

    def pays(self, drafting: Sequence[BatchSequence]) -> bool:
        """Whether a step verifying the ``drafting`` sequences' chains pays (BREAK_EVEN): their running means of
        accepted drafts (``rate``) average at least
        ``break_even``, or PROBE plain steps since the last verify."""
        rates = [self.rate(q) for q in drafting]
        if sum(rates) >= self.break_even * len(rates) or self.plain >= PROBE:
            self.plain = 0
            return True
        self.plain += 1
        return False

    def rate(self, q: BatchSequence) -> float:
        """q's running mean of accepted drafts a verify step; k before its first verify, so that it drafts."""
        return self.gamma if q.accepting is None else q.accepting

    def place(self, ids: torch.Tensor, chains: torch.Tensor, slots: set[int], r: int) -> torch.Tensor:
        """Write each of ``slots``' drafts into its row of the step's ids [B, S] (columns 1..r-1, after the root);
        returns those rows as a mask [B] on the device."""
        on = torch.zeros(self.max_batch, dtype=torch.bool)
        on[list(slots)] = True
        on = on.to(self.device)
        ids[:, 1:r] = torch.where(on[:, None], chains[:, 1:r], ids[:, 1:r])
        return on

    def tally(self, q: BatchSequence, drafted: int, accepted: int) -> None:
        """A verify step's drafts into q's running mean and stats (its rounds and target passes are the loop's)."""
        rate = self.rate(q)
        q.accepting = rate + RATE * (accepted - rate)
        stats = q.stats
        stats.drafted, stats.accepted = stats.drafted + drafted, stats.accepted + accepted
        stats.accepted_at += [0] * (self.gamma - len(stats.accepted_at))
        for i in range(accepted):
            stats.accepted_at[i] += 1

    def propose(self, rows: Sequence[tuple[int, BatchSequence]]) -> torch.Tensor | None:
        """Every slot's chain [max_batch, k + 1] (root, then k drafts) on the device; None before the first
        feed. Rows without room for the head's steps propose at a clamped length: they do not speculate."""
        if not self.fed:
            return None
        roots, lengths = [PAD] * self.max_batch, [0] * self.max_batch
        for b, q in rows:
            roots[b] = max(q.root, PAD)
            lengths[b] = min(q.length, self.max_seq_len - self.drafter.lookahead)
        dev = self.device
        return self.drafter.propose(torch.tensor(roots, device=dev), torch.tensor(lengths, device=dev)).tokens

    @staticmethod
    def accepted(ids: torch.Tensor, greedy: torch.Tensor, speculating: torch.Tensor) -> torch.Tensor:
        """Drafts each row keeps [B]: the longest prefix of ids[:, 1:R] (the drafts) equal to the target's argmax
        greedy [B, R] at the rows before them; 0 for rows not ``speculating`` [B]."""
        r = greedy.shape[1]
        match = (ids[:, 1:r] == greedy[:, :r - 1]) & speculating[:, None]
        return match.long().cumprod(1).sum(1)

    def feed(self, fed: dict[int, tuple[int, list[int]]], taps: torch.Tensor, width: int = 1) -> None:
        """The head's pass over this step: ``fed`` {slot: (write_index, tokens)}, token j of a slot paired with
        its row j of the target's taps [B, S, *]; each slot's next proposal from its last token. At least
        ``width`` tokens a row (a verify step's k + 1: one recorded shape however many each row accepted; the
        padding's KV lands past the row's length, where the next feed writes)."""
        s = max(width, *(len(t) for _, t in fed.values()))
        ids = torch.full((self.max_batch, s), PAD, dtype=torch.int64)
        write, rows = torch.zeros(self.max_batch, dtype=torch.int64), torch.zeros(self.max_batch, dtype=torch.int64)
        for b, (at, tokens) in fed.items():
            ids[b, :len(tokens)] = torch.tensor(tokens)
            write[b], rows[b] = at, len(tokens) - 1
        dev = self.device
        self.drafter.feed(ids.to(dev), taps[:, :s], write.to(dev), rows.to(dev))
        self.fed = True
