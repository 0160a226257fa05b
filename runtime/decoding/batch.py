"""Continuous batching: up to ``max_batch`` sequences decode together, joining and leaving between steps.

    batch = BatchGenerator(target, eos_ids=[151645], max_seq_len=4096, detokenize=tokenizer.decode)
    a = batch.submit(prompt_a, 64)
    b = batch.submit(prompt_b, 64, sampling=SamplingParams(temperature=0.7, seed=1), on_tokens=print)
    while not batch.idle:
        batch.step()                                    # one target pass over every slot
    a.result.tokens, b.result.tokens

Slots: the target's KV buffers are [B, Hkv, S_max, D], B the dir's ``max_batch``, and slot b owns row b. A
sequence waits (first come, first served) for a free slot, takes it between two steps and gives it back when it
stops; nothing is cleared (rows past a slot's length are stale, the contract's mask rule). batch_seats.py keeps
the slots, the queue and how a sequence stops.

A step is one ``target.run`` over all B rows with one S (ORT and TensorRT graphs fix B): row b writes at
``write_index[b]`` = its KV length under a causal mask, ``logit_rows[b]`` its last real token. A decoding row
feeds its root, a prefilling one the next chunk of its prompt (at most ``chunk`` tokens); shorter rows and free
slots are padded with token 0 after their real tokens (hidden by the mask, written past the row's length). So
prompt chunks share steps with decode tokens, the chunk bounding how long a joining prompt stretches a step.
On the fast backend a step of up to MAX_ROWS rows in all runs on the kernels, each sequence over its own cache
row; with ``capture``, steps of one token a row replay one graph. With ``drafts`` (batch_drafts.py) a greedy
decoding row feeds its root and a chain of drafts instead, verified and accepted row by row in the same pass
(its graph is recorded too). A lone greedy sequence speculates on the batch-1 Generator, until another arrives
(``solo``, solo.py).

Equality: a greedy sequence gets plain greedy decoding's tokens; a sampled one draws from a ``Sampler`` of its
slot reset with its own seed and stream, as a plain round of the batch-1 loop draws, so it also gets the tokens
it gets alone on the same backend. docs/design.md ("The batch loop") says more.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.batch_drafts import BatchDrafts
from xcompile.runtime.decoding.batch_seats import Seats
from xcompile.runtime.decoding.drafters import causal
from xcompile.runtime.decoding.generator import Generator
from xcompile.runtime.decoding.outcome import Result, Stats, Stops, check_prompt, check_request
from xcompile.runtime.decoding.sampling import GREEDY, SamplingParams, with_seed
from xcompile.runtime.decoding.sequence import BatchSequence, BatchStats, pack_step
from xcompile.runtime.decoding.solo import Solo
from xcompile.runtime.decoding.warmup import Warmed, warm_batch
from xcompile.runtime.engines.base import Engine
from xcompile.runtime.engines.graphs import Capture, GraphedEngine

# Prompt tokens a prefilling sequence feeds per step: the largest step the loop's other paths keep on their
# short-step routes (layers.MATMUL_ATTENTION_MAX_QUERIES, ort.GRAPH_MAX_TOKENS, the fast kernels' 64 rows).
CHUNK = 64


def recorded_sizes(target: Engine, max_batch: int, chunk: int, gamma: int = 0) -> list[int]:
    """The token counts S of the loop's recorded steps: 1, a verify's gamma + 1, and where the target runs
    max_batch x S rows on its own capturable kernels (``Engine.step_rows``) the powers of two up to the chunk and
    the chunk, to which a step carrying prompt chunks is padded. Eagerly, such a step of the Qwen3-8B shape at 16
    slots took 21.2 ms on an H100 against 11.3 ms for a decoding step verifying 16 chains of 3 (2026-12-06), its
    launches issued one by one from the host."""
    sizes = {1} | ({gamma + 1} if gamma else set())
    if target.step_rows is not None:
        padded = [1 << i for i in range(chunk.bit_length())] + [chunk]
        sizes |= {n for n in padded if max_batch * n <= target.step_rows}
    return sorted(sizes)


class BatchGenerator:
    """The continuous-batching loop over one target engine (module docstring)."""

    def __init__(self, target: Engine, eos_ids: Iterable[int], max_seq_len: int, *,
                 detokenize: Callable[[list[int]], str] | None = None, chunk: int = CHUNK,
                 capture: Capture | None = None, solo: Generator | None = None, drafts: BatchDrafts | None = None):
        """capture: record the steps of one token a row (every sequence decoding) as one graph and replay it
        (GraphedEngine; LLM passes CudaGraphCapture on CUDA): a step of 36 layers is some 250 launches, which
        the host would otherwise issue one by one every step. A step carrying prompt chunks is padded up to the
        next of a few token counts and replayed too, where the target runs such steps on its own kernels
        (``recorded_sizes``); others run eagerly.
        solo: a batch-1 Generator over the same target (and a drafter) that a lone greedy sequence runs on,
        speculating, until another arrives (solo.py). drafts: a chain drafter over every slot, with which greedy
        decoding rows speculate in batch steps (batch_drafts.py; bound to this loop's slots)."""
        kv = target.kv_shape
        if kv is None or kv.max_seq_len < max_seq_len:
            raise EngineError(f"target engine KV {None if kv is None else kv.shape} holds fewer than max_seq_len "
                              f"{max_seq_len} slots; rebuild the engine dir with a larger --max-seq-len")
        if not target.batched:
            raise EngineError(f"the {type(target).__name__} target runs one sequence per step, so it cannot batch; "
                              "use --backend torch/ort, or an engine dir exported with --max-batch 1")
        if chunk < 1:
            raise EngineError(f"chunk must be >= 1 prompt token per step, got {chunk}")
        if not target.kv:
            target.new_kv()
        self.target, self.device, self.chunk, self.drafts = target, target.device, chunk, drafts
        if drafts is not None and (drafts.max_batch, drafts.max_seq_len) != (kv.batch, max_seq_len):
            raise EngineError(f"drafts: bound to {drafts.max_batch} x {drafts.max_seq_len} slots, the loop has "
                              f"{kv.batch} x {max_seq_len}")
        if drafts is not None and "hidden_taps" not in target.spec.output_names:
            raise EngineError(f"the {drafts.drafter.name} drafter reads the target's hidden_taps, which this target "
                              "engine does not output; export the target with EAGLE3 taps")
        # the recorded steps, the head's feeds too: one token a row, (drafting) a root and its chain a row, and
        # prompt-carrying steps padded up to the next of ``sizes`` (recorded_sizes)
        self.sizes = recorded_sizes(target, kv.batch, chunk, drafts.gamma if drafts is not None else 0)
        self._graphed = GraphedEngine(target, self.sizes, capture) if capture is not None else None
        if capture is not None and drafts is not None:
            drafts.record(capture, self.sizes)
        if solo is not None and (solo.target is not target or not target.partial_batch):
            raise EngineError("solo: a Generator over this loop's target, which must take fewer sequences than its "
                              "KV slots (the torch and fast backends)")
        self.solo = Solo(solo) if solo is not None else None
        self.max_batch, self.max_seq_len = kv.batch, max_seq_len
        self.eos_ids, self.detokenize = frozenset(eos_ids), detokenize
        self.seats = Seats(self.device, self.max_batch, max_seq_len)
        self._pending: list[BatchSequence] = []     # what the running step() has stopped so far
        self.stats = BatchStats(rows_used=[0] * self.max_batch)
        self._causal: dict[int, torch.Tensor] = {}         # the causal tree_mask [B, S, S] of each S used

    # -- requests ----------------------------------------------------------------------------------

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """EngineError unless the prompt is non-empty, in range and leaves room for one step."""
        check_prompt(prompt_ids, self.max_seq_len, 1, "1 slot for its first step")

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str],
                      sampling: SamplingParams) -> None:
        """EngineError for anything a request can get wrong (the batch-1 Generator's checks), before any work."""
        check_request(prompt_ids, max_new_tokens, stop, sampling, check_prompt=self.check_prompt,
                      detokenize=self.detokenize, loop=type(self).__name__)

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
               sampling: SamplingParams = GREEDY, index: int = 0, cancel: threading.Event | None = None,
               on_tokens: Callable[[list[int]], None] | None = None) -> BatchSequence:
        """Queue one sequence (checked first); it takes a free slot at the start of a later ``step``.
        ``index``: which stream of the seed it draws (sample ``index`` of a request); ``cancel``: set it
        (from any thread) to end the sequence before the next step; ``on_tokens``: each step's new tokens."""
        self.check_request(prompt_ids, max_new_tokens, stop, sampling)
        if sampling.n != 1:
            raise EngineError(f"submit takes one sample (SamplingParams(n=1)), got n={sampling.n}: submit each "
                              "sample with its own index")
        seq = BatchSequence(list(prompt_ids), Stops(max_new_tokens, self.eos_ids, stop, self.detokenize), sampling,
                            index, cancel, on_tokens, Stats(prompt_tokens=len(prompt_ids)))
        self.waiting.append(seq)
        return seq

    @property
    def waiting(self) -> deque[BatchSequence]:
        return self.seats.waiting

    @property
    def running(self) -> list[BatchSequence]:
        return self.seats.running

    @property
    def recorded(self) -> bool:
        """Whether steps replay CUDA graphs (a capture given, and not fallen back to eager)."""
        return self._graphed is not None and self._graphed.fallback is None

    @property
    def idle(self) -> bool:
        return self.seats.idle

    def generate(self, requests: Sequence[tuple]) -> list[Result]:
        """Every request (``submit``'s positional arguments) through the batch; their Results in order."""
        seqs = [self.submit(*r) for r in requests]
        while not self.idle:
            self.step()
        return [s.result for s in seqs]

    def generate_n(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
                   on_tokens: Callable[[int, list[int]], None] | None = None,
                   sampling: SamplingParams = GREEDY) -> list[Result]:
        """``Generator.generate_n`` batched: the ``sampling.n`` samples of one prompt decode together, sample j
        drawing stream j of one seed (drawn here when ``sampling.seed`` is None)."""
        one = replace(with_seed(sampling), n=1)
        seqs = [self.submit(prompt_ids, max_new_tokens, stop, one, j, None,
                            None if on_tokens is None else (lambda tokens, j=j: on_tokens(j, tokens)))
                for j in range(sampling.n)]
        while not self.idle:
            self.step()
        return [q.result for q in seqs]

    def warm_up(self, samplings: Sequence[SamplingParams] = (GREEDY,),
                on_part: Callable[[Warmed], None] | None = None) -> list[Warmed]:
        """Run a step of every token count S a step can take, and the lone sequence's Generator's warm-up
        (warmup.warm_batch); then clear the KV buffers and the stats as a fresh loop has them. Only while idle.
        Returns the parts, timed."""
        if not self.idle:
            raise EngineError("warm_up runs before any sequence is submitted")
        done = warm_batch(self, samplings, on_part)
        for buf in self.target.kv:
            buf.zero_()
        self.stats = BatchStats(rows_used=[0] * self.max_batch)
        return done

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Inside, steps run on the engine itself at their own S, unpadded (the warm-up compiles every S's kernels
        so: a step near a slot's end, where the next recorded size does not fit, runs them)."""
        graphed, self._graphed = self._graphed, None
        try:
            yield
        finally:
            self._graphed = graphed

    # -- the loop ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[BatchSequence]:
        """Drop cancelled sequences, seat waiting ones, run one target pass over every slot and commit what
        it gave each row. Returns the sequences that stopped during this call."""
        # the sequences that stop in this call, kept where abort() finds them should the step raise midway
        ended = self._pending = self.seats.drop_cancelled()
        if self.solo is not None and self.solo.step(self.seats, self.stats, ended):
            self._pending = []
            return ended
        self.seats.seat()
        rows = [(b, s.seq) for b, s in enumerate(self.seats.slots) if s.seq is not None]
        if not rows:
            self._pending = []
            return ended
        drafts = self.drafts
        chains, spec = drafts.plan(rows) if drafts is not None else (None, set())
        # S: the longest row's tokens (a prefill chunk, a root and its drafts, or 1), within every row's room;
        # replaying graphs, padded up to the next recorded size that fits
        need = {b: min(len(q.prompt) - q.length, self.chunk) if q.prefilling else drafts.gamma + 1 if b in spec
                else 1 for b, q in rows}
        room = min(self.max_seq_len - q.length for _, q in rows)
        s = min(max(need.values()), room)
        if self.recorded:
            s = next((n for n in self.sizes if s <= n <= room), s)
        # logit rows a sequence: with drafts the verify's (up to S) whether or not rows draft, so that each recorded
        # size is one graph
        r = min(s, drafts.gamma + 1) if drafts is not None else 1
        need = {b: min(k, s) for b, k in need.items()}
        write_d, pos_d, ids_d, last_d = pack_step(rows, need, spec, s, r, self.max_batch, self.device)
        on = drafts.place(ids_d, chains, spec, r) if spec else None            # the speculating rows' drafts
        out = (self._graphed or self.target).run(input_ids=ids_d, write_index=write_d, tree_mask=self._mask(s),
                                                 position_ids=pos_d, logit_rows=last_d)
        logits = out["logits"]                                                  # [B, r, V]
        greedy = logits.argmax(-1)
        if spec:
            greedy = torch.cat((greedy, drafts.accepted(ids_d, greedy, on)[:, None]), dim=1)
        greedy = greedy.tolist()                                                # the one host read of a step
        self.stats.steps += 1
        self.stats.rows_used[len(rows) - 1] += 1
        fed = {}                                                                # the head's tokens of each row
        for b, q in rows:
            q.stats.target_forwards += 1
            at = q.length
            head, tokens = self._advance(b, q, greedy[b], need[b], r if b in spec else 0, logits)
            fed[b] = (at, head)
            if tokens:
                q.root = tokens[-1]
                if self.seats.emit(q, tokens):
                    ended.append(q)
        if drafts is not None:
            drafts.feed(fed, out["hidden_taps"], s)
        self._pending = []
        return ended

    def _advance(self, b: int, q: BatchSequence, greedy: list[int], n: int, verified: int,
                 logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Row b's step committed: ``n`` tokens fed; ``greedy`` the argmax at each of its logit rows, and when it
        verified a chain (``verified``: those rows) the drafts accepted after them. Returns the head's tokens for
        the row (token t + 1 with each position t fed) and what q emitted (none while its prompt goes on)."""
        at = q.length
        if q.prefilling:
            self.stats.prefill_tokens += n
            q.length += n
            if q.length < len(q.prompt):
                return q.prompt[at + 1:q.length + 1], []
            tokens = [greedy[0] if q.sampling.greedy else int(self.seats.slots[b].sampler.sample(logits[b:b + 1, 0])[0])]
            q.stats.prefill_s = time.perf_counter() - q.start
            return q.prompt[at + 1:] + tokens, tokens
        q.stats.rounds += 1
        if verified:                                    # the accepted drafts, then the target's token after them
            accepted = greedy[verified]
            tokens = greedy[:accepted + 1]
            self.drafts.tally(q, n - 1, accepted)
        else:
            tokens = [greedy[0] if q.sampling.greedy else self.seats.sampled(b, q.root, logits[b:b + 1, :1])]
        self.stats.decode_tokens += len(tokens)
        q.length += len(tokens)
        return tokens, tokens

    def abort(self, why: str) -> list[BatchSequence]:
        """Stop every sequence, running or waiting, with reason "error" (``why``): what a caller does when a
        step itself raised (an engine failure), after which no row's state can be trusted. The slots are free
        again; the next sequence's prefill rewrites its slot from row 0."""
        done, self._pending = self._pending, []        # stopped already in the step that raised
        if self.solo is not None:
            self.solo.release()
        return done + self.seats.stop_all(why)

    def _mask(self, s: int) -> torch.Tensor:
        mask = self._causal.get(s)
        if mask is None:
            mask = self._causal[s] = causal(s, self.device, self.max_batch)
        return mask
