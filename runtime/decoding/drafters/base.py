"""Drafters: what proposes the block the target verifies each round, each owning its KV buffers.

The package: base.py (the Drafter interface, plain decoding), draft_model.py, eagle3.py (EAGLE3 and MTP, chain
and tree).

    none         plain decoding: the block is the root alone
    draft-model  a small Qwen3 (contract graph ``draft``) with its own KV proposes k tokens
    eagle3       EAGLE3 head, chain of k tokens (graphs ``eagle3`` + ``eagle3_fc``)
    eagle3-tree  EAGLE3 head, EAGLE-2 dynamic tree (top-k, depth, total tokens)
    mtp          MTP module (graph ``mtp``), EAGLE3's chain over the target's last layer output
    mtp-tree     MTP module, the same dynamic tree

Chain drafters pick each token with the request's sampler (``bind``): the argmax when greedy, else a
draw from the warped draft distribution q, whose row they record in the block (``Block.q``) for
verification. The tree's children are the draft's top-k whatever the sampler (deterministic picks).

Life of a request: after the target's prefill ``start(prompt, taps, root)``; then per round
``propose(root, length) -> Block``, the target verifies it, and ``commit(block, accepted, taps, length)``
hands the drafter the target's verify outputs. ``length`` [B] (a device tensor) is the target's KV
length: every committed token except the root, which is written by the next verify. Every step has a
fixed shape given the drafter's parameters (only the prompt passes depend on the prompt length).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding import kernels
from xcompile.runtime.decoding.draft_tree import to_target
from xcompile.runtime.decoding.sampling import Sampler
from xcompile.runtime.decoding.speculative import Accepted, Block, chain_block
from xcompile.runtime.engines.base import SHORT_STEPS, Engine

if TYPE_CHECKING:
    from xcompile.runtime.decoding.kernels.accept import GreedyPick


def causal(s: int, device: torch.device, batch: int = 1) -> torch.Tensor:
    """A causal tree_mask [batch, s, s]: token i sees tokens 0..i."""
    return torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(batch, s, s)


def prompt_inputs(prompt: torch.Tensor, start: int = 0, rows: int | None = None) -> dict[str, torch.Tensor]:
    """Step inputs of a causal pass over prompt tokens [B, L] written at ``start`` (after the ``start`` tokens
    before them), logits of the last row; ``rows``: the step padded to that many rows with token 0 after the
    prompt's (written past it and hidden from it by the mask, as the batch loop pads its rows)."""
    b, n = prompt.shape
    dev = prompt.device
    rows = rows or n
    if rows > n:
        prompt = torch.nn.functional.pad(prompt, (0, rows - n))
    return dict(input_ids=prompt, position_ids=torch.arange(start, start + rows, device=dev).expand(b, rows),
                write_index=torch.full((b,), start, dtype=torch.int64, device=dev), tree_mask=causal(rows, dev, b),
                logit_rows=torch.full((b, 1), n - 1, dtype=torch.int64, device=dev))


# Prompts longer than this run in causal chunks of it, each over the keys of the chunks before it: a 131,072-token
# prompt's tree_mask in one pass is 16 GB, a chunk's 64 MB; at 8,192 rows a chunk's matmuls run at cuBLAS's full
# rate, and the weights read again per chunk cost 16.4 GB / 4.8 TB/s = 3.4 ms at the 8B shape.
PROMPT_CHUNK = 8192


def step_rows(n: int) -> int:
    """The rows a short prompt step of n tokens is padded to when its engine's short steps replay CUDA graphs
    (``prompt_pass``'s ``steps``): the next power of two, so 7 graphs cover 1..64 rows. Eager, a 64-row step
    of the 8B shape is some 250 launches issued from Python: through xrun serve on an H100, prompts of 16-64
    tokens took 24-32 ms to the first token and those of 65-79 tokens (two steps) 44-64 ms (2026-12-05)."""
    return 1 << (n - 1).bit_length()


def prompt_pass(engine: Engine, prompt: torch.Tensor, per_row: dict[str, torch.Tensor] | None = None,
                keep: str | None = None, steps: Engine | None = None
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """A causal pass of ``engine`` over prompt [B, L] written at 0, in chunks of PROMPT_CHUNK tokens, or of
    short_rows // B tokens where its B * L rows fit SHORT_STEPS of the engine's short steps (engines.base; for
    B > 1 that may take one step more, the chunk rounded down); ``per_row``: inputs [B, L, *] cut
    alike (an EAGLE3 head's hidden states). ``steps``: the engine's short steps replayed from CUDA graphs
    (GraphedEngine over every ``step_rows``): short chunks run there, padded to step_rows rows where the KV holds
    them. Returns the last chunk's outputs (its logits: the prompt's last row), that row's index in the chunk
    [B], and ``keep``'s output [B, L, *] of every chunk (the target's hidden_taps; copied where there are several
    chunks: an engine, a graph above all, may reuse its output buffers)."""
    b, n = prompt.shape
    rows, kept = engine.short_rows, []
    short = bool(rows) and b * n <= SHORT_STEPS * rows
    chunk = max(1, rows // b) if short else PROMPT_CHUNK
    room = engine.kv_shape.max_seq_len if engine.kv_shape is not None else 0
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        padded = min(step_rows(end - start), chunk) if short and steps is not None else None
        if padded is not None and start + padded > room:
            padded = None                                   # no room for the padding rows: eager, unpadded
        inputs = prompt_inputs(prompt[:, start:end], start, padded)
        for name, t in (per_row or {}).items():
            t = t[:, start:end]
            inputs[name] = torch.nn.functional.pad(t, (0, 0, 0, padded - t.shape[1])) if padded else t
        out = (steps if padded else engine).run(**inputs)
        if keep is not None and out.get(keep) is not None:
            part = out[keep][:, :end - start]
            kept.append(part if end == n and not kept else part.clone())
    taps = (kept[0] if len(kept) == 1 else torch.cat(kept, dim=1)) if kept else None
    return out, inputs["logit_rows"][:, 0], taps


class Drafter(ABC):
    """Proposes the block the target verifies each round and owns its engines' KV (module docstring)."""

    name = ""
    needs_taps = False          # start/commit read the target's hidden_taps
    chains = True               # its blocks are chains (node i's parent is i-1), not trees

    def __init__(self, max_depth: int, block_size: int, lookahead: int, engines: tuple[Engine, ...] = ()):
        self.max_depth = max_depth          # longest drafted path
        self.block_size = block_size        # tokens per verify pass, the root included
        self.lookahead = lookahead          # KV slots past `length` that one round writes (target included)
        self.engines = engines
        self.sampler = Sampler()
        self.picks: dict[int, GreedyPick] | None = None     # the fused greedy picks (bind)
        self.track = True           # keep the committed KV length on the device (caches(); bind)
        self.prompt_engines = engines       # those of its engines that take prompt passes (start)
        # their short prompt steps replayed from graphs (prompt_pass's steps), by engine: set by the generator
        self.prompt_steps: dict[Engine, Engine] = {}

    def bind(self, max_seq_len: int, device: torch.device, batch: int = 1, sampler: Sampler | None = None,
             fused: bool | None = None, track: bool = True) -> None:
        """Check the engines against the generator's limits, allocate KV and step buffers; ``sampler``
        (the generator's) picks the drafted tokens (default: greedy); ``fused``: greedy picks in one launch
        each (kernels/accept.py; None: on a CUDA device with triton, True: also in Triton's interpreter);
        ``track``: keep the committed KV lengths that ``caches`` reports (two launches a round; the
        generator's debug checks read them, nothing else does)."""
        self.sampler = sampler or Sampler(device, batch)
        self.track = track
        self.picks = {} if batch == 1 and kernels.use_fused(fused, device) else None
        for e in self.engines:
            if e.device != device:
                raise EngineError(f"drafter {self.name!r}: {e.spec.graph} engine is on {e.device}, the target on {device}")
            if e.kv_shape is not None:
                # more slots than sequences: a batch dir's engines, whose first rows the lone sequence uses
                if e.kv_shape.max_seq_len < max_seq_len or e.kv_shape.batch < batch or (
                        e.kv_shape.batch > batch and not e.partial_batch):
                    raise EngineError(f"drafter {self.name!r}: {e.spec.graph} engine holds {e.kv_shape.batch} x "
                                      f"{e.kv_shape.max_seq_len} KV slots, the generator needs {batch} x {max_seq_len}; "
                                      "rebuild the engine dir with a larger --max-seq-len or lower it here")
                if not e.kv:
                    if e.kv_shape.batch > batch:
                        e.narrow_batch(batch)       # no KV for slots it never drafts for (0.6B draft, 64 slots: 30 GB)
                    e.new_kv()
        self._alloc(device, batch)

    def _alloc(self, device: torch.device, batch: int) -> None:
        """Preallocate the buffers ``propose`` writes by index."""

    def start(self, prompt: torch.Tensor, taps: torch.Tensor | None, root: torch.Tensor) -> None:
        """After the target's prefill over prompt [B, L] (taps [B, L, 3H]); root [B] is its greedy token."""

    @abstractmethod
    def propose(self, root: torch.Tensor, length: torch.Tensor) -> Block:
        """The block to verify at write_index ``length``; root [B] is the last committed token."""

    def commit(self, block: Block, acc: Accepted, taps: torch.Tensor | None, length: torch.Tensor) -> None:
        """After verification at ``length`` (the old KV length) accepted ``acc``."""

    def caches(self) -> list[tuple[list[torch.Tensor], torch.Tensor, int]]:
        """Per KV cache, for the debug checks: (buffers, committed length [B], how many rows at the end of
        the committed prefix the next round rewrites before reading them); the lengths are kept only when
        bound with ``track``."""
        return []

    def _pick(self, block: Block, i: int, logits: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """Draft token i of ``block`` (target ids, ``targets`` the draft->target lookup of
        draft_tree.target_table) from draft logits [B, Vq], written into block.tokens[:, i]: the argmax
        when greedy (one launch where ``bind`` put the kernels), else a draw from the warped q, with q's
        row and q(token) written into the block."""
        s = self.sampler
        if s.greedy:
            if (self.picks is not None and logits.stride(-1) == 1 and logits.dtype != torch.float64
                    and (targets is None or (targets.is_contiguous() and targets.dtype == torch.int64))):
                pick = self.picks.get(logits.shape[-1])
                if pick is None:            # made by the first round, which runs eagerly
                    from xcompile.runtime.decoding.kernels.accept import GreedyPick
                    pick = self.picks[logits.shape[-1]] = GreedyPick(logits.shape[-1], logits.device)
                pick(logits, targets, block.tokens[:, i])
            else:
                block.tokens[:, i] = to_target(logits.argmax(-1), targets)
            return
        if block.q is None:                 # made on the first sampled round (the vocab is the logits')
            b, n = block.tokens.shape
            block.q = torch.zeros(b, n, logits.shape[-1], dtype=torch.float32, device=logits.device)
            block.q_tok = torch.ones(b, n, dtype=torch.float32, device=logits.device)
            block.q_ids = targets
        if s.draws_by_kernel and logits.stride(-1) == 1 and (targets is None or targets.is_contiguous()):
            # the draw, q's row and q(token) in two launches (kernels/sample.py), where torch's warp, draw and
            # probs take a dozen or more over the draft vocabulary
            from xcompile.runtime.decoding.kernels import sample
            sample.sample(logits, s, out=block.tokens[:, i], q=block.q[:, i], q_tok=block.q_tok[:, i],
                          targets=targets)
            return
        w = s.warp(logits)
        col = s.draw(w)                                                         # [B] column of q
        q = w.probs()
        block.q[:, i] = q
        block.q_tok[:, i] = q.gather(1, col[:, None])[:, 0]
        block.tokens[:, i] = to_target(col, targets)


class NoDrafter(Drafter):
    """Plain decoding: the block is the root alone."""

    name = "none"

    def __init__(self):
        super().__init__(max_depth=0, block_size=1, lookahead=1)

    def _alloc(self, device, batch):
        self.block = chain_block(torch.zeros(batch, 1, dtype=torch.int64, device=device))

    def propose(self, root, length):
        self.block.tokens[:, 0] = root
        return self.block


def advance(committed: torch.Tensor, length: torch.Tensor, acc: Accepted) -> None:
    """committed <- length + acc.count + 1 (a drafter's KV length after the round), in two launches."""
    torch.add(length, acc.count, out=committed).add_(1)
