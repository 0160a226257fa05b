"""One speculative round as device work, and the two choices made once when a request is bound: how the
target's logits are verified (``Verifier``) and how the round runs (``Executor``).

    round:     propose -> verify (one target pass over the block) -> accept -> commit
    verifier:  FusedChainVerifier (a greedy chain: kernels/accept.py, two launches), FusedSampledVerifier
               (a sampled chain or tree, top-k 1..32: kernels/accept_sampled*.py, two launches) or TorchVerifier
               (speculative.accept_chain / accept_tree with the request's sampler: greedy or speculative
               sampling, chains and trees)
    executor:  Eager, or Graphed: the whole round recorded as one CUDA graph and replayed (the torch and fast
               backends' steps are capturable; one replay per round instead of ~2,000 launches)

A round reads the device state (root, length) and updates it in place, so rounds can be queued back to
back without the host; each leaves its outcome in its verifier's ``host`` row [1, D+2] (the accepted count,
then the emitted tokens), the one tensor copied back per round.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from xcompile.runtime.decoding.drafters import Drafter
from xcompile.runtime.decoding.kernels import SAMPLE_MAX_K
from xcompile.runtime.decoding.sampling import Sampler
from xcompile.runtime.decoding.speculative import Accepted, Block, accept_chain, accept_tree, bonus, compact_kv
from xcompile.runtime.engines.base import Engine
from xcompile.runtime.engines.graphs import Capture, GraphUnavailable

MAX_FUSED_NODES = 64        # the fused chain verification holds a chain's nodes in one register tile


class RoundState:
    """What rounds share on the device: the root (the last committed token, not yet in the target's KV) and the
    target's KV length; every round updates both in place."""

    def __init__(self, device: torch.device):
        self.root = torch.zeros(1, dtype=torch.int64, device=device)
        self.length = torch.zeros(1, dtype=torch.int64, device=device)


class Verifier(Protocol):
    """Accepts a verified block, then commits its outcome to the round state."""

    host: torch.Tensor | None       # the last round's host row (made by the first)

    def accept(self, block: Block, logits: torch.Tensor) -> Accepted:
        """The accepted drafts and the bonus token, from the target's logits [1, S, V] at the block's nodes."""

    def advance(self, acc: Accepted, state: RoundState) -> torch.Tensor:
        """root <- the bonus token, length += count + 1; returns the host row [1, D+2] (a buffer of its own,
        rewritten by every round)."""


class TorchVerifier:
    """Verification in torch ops with the request's sampler: the longest greedy-matching path, or speculative
    sampling (speculative.py has the rules), for chains and trees."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.host: torch.Tensor | None = None           # made by the first round, which runs eagerly

    def accept(self, block: Block, logits: torch.Tensor) -> Accepted:
        return (accept_chain if block.chain else accept_tree)(block, logits, self.sampler)

    def advance(self, acc: Accepted, state: RoundState) -> torch.Tensor:
        state.length.add_(acc.count + 1)
        state.root.copy_(bonus(acc))
        if self.host is None:
            self.host = acc.count.new_zeros(1, acc.tokens.shape[1] + 1)
        return torch.cat((acc.count[:, None], acc.tokens), dim=1, out=self.host)


class FusedChainVerifier:
    """Greedy verification of a chain in one launch and the state update in another (kernels/accept.py),
    where torch takes a dozen small launches."""

    def __init__(self):
        self.kernel = None                              # made by the first round: the vocabulary is the logits'

    def accept(self, block: Block, logits: torch.Tensor) -> Accepted:
        if self.kernel is None:
            from xcompile.runtime.decoding.kernels.accept import ChainAccept
            self.kernel = ChainAccept(block.tokens.shape[1], logits.shape[-1], logits.device)
        return self.kernel(block.tokens, logits)

    def advance(self, acc: Accepted, state: RoundState) -> torch.Tensor:
        self.kernel.advance(state.root, state.length)
        return self.kernel.host

    @property
    def host(self) -> torch.Tensor | None:
        return None if self.kernel is None else self.kernel.host


class FusedSampledVerifier(TorchVerifier):
    """Speculative sampling in two launches, of a chain (kernels/accept_sampled.py) or of a tree of deterministic
    drafts (kernels/accept_sampled_tree.py), where the torch rule takes a dozen over the block's [S, V] logits;
    other blocks by the torch rule; the state update as TorchVerifier's."""

    def __init__(self, sampler: Sampler):
        super().__init__(sampler)
        self.kernel = None                              # made by the first round, which runs eagerly

    def accept(self, block: Block, logits: torch.Tensor) -> Accepted:
        from xcompile.runtime.decoding.kernels.accept_sampled import SampledChainAccept
        from xcompile.runtime.decoding.kernels.accept_sampled_tree import SampledTreeAccept
        if SampledChainAccept.fits(self.sampler, block):
            self.kernel = self.kernel or SampledChainAccept(*block.tokens.shape, logits.device)
        elif SampledTreeAccept.fits(self.sampler, block):
            self.kernel = self.kernel or SampledTreeAccept(*block.tokens.shape, block.max_depth, logits.device)
        else:
            return super().accept(block, logits)
        return self.kernel(block, logits, self.sampler)


def verifier_for(drafter: Drafter, sampler: Sampler, fused: bool) -> Verifier:
    """The fused kernels (when ``fused``) for greedy chains that fit them and for sampled chains and trees whose
    top-k is 1..SAMPLE_MAX_K, else torch's ops."""
    if fused and drafter.block_size <= MAX_FUSED_NODES:
        if sampler.greedy and drafter.chains:
            return FusedChainVerifier()
        # (plain decoding's sampled token is sample.py's draw, inside the torch rule)
        if not sampler.greedy and drafter.block_size > 1 and 0 < sampler.params.top_k <= SAMPLE_MAX_K:
            return FusedSampledVerifier(sampler)
    return TorchVerifier(sampler)


class Round:
    """One drafter's round, device work only: propose -> verify -> accept -> (tree: compact the KV) -> commit."""

    def __init__(self, target: Engine, drafter: Drafter, verifier: Verifier, state: RoundState):
        self.target, self.drafter, self.verifier, self.state = target, drafter, verifier, state
        # logit rows of a verify pass: every block node
        self.rows = torch.arange(drafter.block_size, device=state.root.device)[None]

    @property
    def engines(self) -> tuple[Engine, ...]:
        return (self.target, *self.drafter.engines)

    def __call__(self) -> torch.Tensor:
        root, length = self.state.root, self.state.length
        block = self.drafter.propose(root, length)
        positions = block.positions if block.positions is not None else length[:, None] + block.depth
        out = self.target.run(input_ids=block.tokens, position_ids=positions, write_index=length,
                              tree_mask=block.mask, logit_rows=self.rows)
        acc = self.verifier.accept(block, out["logits"])
        if not block.chain:
            compact_kv(self.target.kv, length, acc.path)    # the accepted path's KV rows, made contiguous
        self.drafter.commit(block, acc, out.get("hidden_taps"), length)
        return self.verifier.advance(acc, self.state)


class Eager:
    """Runs the round as it is, launch by launch."""

    def __init__(self, round_: Round):
        self.round = round_

    def __call__(self) -> torch.Tensor:
        return self.round()


class Graphed:
    """The round recorded as one CUDA graph: its first call runs eagerly (lazy set-up: allocations, kernel
    compilation), its second records it (a round is not idempotent, so recording runs nothing) and replays
    the recording, every later call replays. A failed capture warns and leaves the round eager for good
    (``fallback`` says why). The recording holds the KV buffers' addresses: the generator drops it when an
    engine's KV is re-bound (Engine.bind_kv)."""

    def __init__(self, round_: Round, capture: Capture):
        self.round, self.capture = round_, capture
        self.replay: Callable[[], None] | None = None
        self.fallback: str | None = None
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if self.fallback is not None or self.calls == 1:
            return self.round()
        if self.replay is None:
            try:
                self.replay, _ = self.capture(self.round, self.round.state.root.device)
            except (GraphUnavailable, RuntimeError) as e:
                self.fallback = f"{type(e).__name__}: {e}"
                warnings.warn(f"whole-round CUDA graph unavailable, running rounds eagerly ({self.fallback})",
                              stacklevel=3)
                return self.round()
        self.replay()
        return self.round.verifier.host


class HostRows:
    """The one copy back a round: on a CUDA device each round's host row goes into one of two pinned buffers of
    its shape as the round's last work, so a round queued after it may overwrite the verifier's row meanwhile."""

    def __init__(self):
        self._slots: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def fetch(self, back: torch.Tensor) -> Callable[[], list[int]]:
        """Queue the copy of ``back`` [1, D+2]; a function that waits for it and returns the row as a list."""
        if back.device.type != "cuda":
            row = back[0].tolist()
            return lambda: row
        slots = self._slots.get(tuple(back.shape))
        if slots is None:
            slots = self._slots[tuple(back.shape)] = [torch.empty(back.shape, dtype=back.dtype).pin_memory()
                                                       for _ in range(2)]
        slots.append(slots.pop(0))
        host = slots[-1]
        host.copy_(back, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return lambda: (done.synchronize(), host[0].tolist())[1]
