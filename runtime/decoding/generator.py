"""The generation loop: prefill, then rounds of propose -> verify -> commit -> emit until a stop.

    gen = Generator(target, Eagle3TreeDrafter(eagle3, fc, d2t, topk=8, depth=6, total_tokens=48),
                    eos_ids=[151645], max_seq_len=4096, detokenize=tokenizer.decode)
    result = gen.generate(prompt_ids, max_new_tokens=256, stop=["\\n\\n"], on_tokens=print)
    for tokens in gen.stream(prompt_ids, 256, sampling=SamplingParams(temperature=0.6)): ...

A round is device work end to end (rounds.py); the host reads back one small row per round (the accepted
count and the emitted tokens) to apply stops, stream and decide whether to go on. With greedy verification
the output equals plain greedy decoding of the target token for token, whatever the drafter proposes
(exactly so in fp32; in bf16 a verify pass over S tokens may round differently from S single steps and flip
a near tie). With sampling, speculative sampling makes every token a draw from the target's warped
distribution, whatever the drafter proposes; the random state is the generator's ``Sampler`` (device
tensors), so a seed reproduces a run on the same backend.

KV bookkeeping: the target's KV holds every committed token but the last (the root), which the next verify
writes at ``length`` first; a round writes rows length .. length+S-1, and accepting a drafts advances
``length`` by a+1. Rows past ``length`` are stale and no mask ever reads them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding import kernels
from xcompile.runtime.decoding.drafters import Drafter, NoDrafter, prompt_pass, step_rows
from xcompile.runtime.decoding.outcome import Result, Run, Stats, Stops, check_prompt, check_request
from xcompile.runtime.decoding.rounds import Eager, Graphed, HostRows, Round, RoundState, verifier_for
from xcompile.runtime.decoding.sampling import GREEDY, Sampler, SamplingParams, with_seed
from xcompile.runtime.decoding.warmup import ROUNDS, SHORT, SHORT_PASSES, Parts, Warmed, describe, prompt_lengths, spans
from xcompile.runtime.engines.base import Engine
from xcompile.runtime.engines.graphs import Capture, CudaGraphCapture, GraphedEngine

# debug mode: stale KV rows are filled with this between rounds. Finite on purpose: attention kernels
# multiply masked rows by a zero weight, and 0 * NaN would leak a NaN the mask did exclude. (fp32/bf16:
# in fp16, q.k against it can overflow.)
POISON = 1e4


@dataclass(frozen=True)
class LoopOptions:
    """How the loop runs (the output does not depend on it).

    cuda_graphs  record each drafter's whole round as one CUDA graph and replay it (when every engine's steps
                 are capturable: the torch and fast backends; TensorRT and ORT record graphs of their own)
    fused        the loop's kernels (decoding/kernels: greedy chain verification, draft picks, tree levels,
                 sampled draws);
                 None: on a CUDA device with triton, True: also in Triton's interpreter (tests)
    pipeline     queue each round before reading the previous one's outcome; None: on a CUDA device (on the
                 CPU a round computes as it is launched: nothing to overlap)
    debug        check the KV lengths and poison stale KV rows every round (no pipelining)
    capture      how a round is recorded (default: CudaGraphCapture without warm-up); tests pass stand-ins
    step_capture how a short prompt step is recorded, with cuda_graphs (default: CudaGraphCapture); tests pass
                 stand-ins
    """

    cuda_graphs: bool = False
    fused: bool | None = None
    pipeline: bool | None = None
    debug: bool = False
    capture: Capture | None = None
    step_capture: Capture | None = None


class Generator:
    """Speculative generation over a target engine and a drafter (module docstring)."""

    def __init__(self, target: Engine, drafter: Drafter, eos_ids: Iterable[int], max_seq_len: int, *,
                 detokenize: Callable[[list[int]], str] | None = None, options: LoopOptions = LoopOptions()):
        """target: the ``target`` graph's engine; drafter: what proposes blocks (``NoDrafter()`` for plain
        decoding); max_seq_len: the KV capacity used (the engines may hold more); detokenize: ids -> text,
        needed for stop strings."""
        # a batch dir's target runs one sequence in its first slot where it can (the batch loop's lone sequence)
        if target.kv_shape is not None and target.kv_shape.batch != 1 and not target.partial_batch:
            raise EngineError(f"the {type(target).__name__} target's graphs fix the batch at {target.kv_shape.batch} "
                              "sequences (an engine dir exported with --max-batch > 1), and this loop runs one; use "
                              "--backend torch or fast, or export with --max-batch 1")
        if target.kv_shape is None or target.kv_shape.max_seq_len < max_seq_len:
            have = None if target.kv_shape is None else (target.kv_shape.batch, target.kv_shape.max_seq_len)
            raise EngineError(f"target engine KV (batch, slots) is {have}, the generator needs (1, {max_seq_len}); "
                              "rebuild the engine dir with a larger --max-seq-len or lower it here")
        if drafter.needs_taps and "hidden_taps" not in target.spec.output_names:
            raise EngineError(f"the {drafter.name} drafter reads the target's hidden_taps, which this target engine "
                              "does not output; export the target with EAGLE3 taps")
        if not target.kv:
            target.new_kv()
        self.target, self.drafter, self.options = target, drafter, options
        self.device = target.device
        self.max_seq_len, self.eos_ids, self.detokenize = max_seq_len, frozenset(eos_ids), detokenize
        self.plain = NoDrafter()            # takes over when the drafter's lookahead no longer fits the cache
        # one for every request (its tensors keep their addresses); its draws by kernel follow options.fused
        self.sampler = Sampler(self.device, fused=options.fused)
        self.fused = kernels.use_fused(options.fused, self.device)
        if options.step_capture is not None and not options.cuda_graphs:
            raise EngineError("LoopOptions.step_capture records prompt steps with cuda_graphs only; set cuda_graphs")
        self.graphs = options.cuda_graphs and all(e.graph_capturable for e in (target, *drafter.engines))
        for d in (drafter, self.plain):
            d.bind(max_seq_len, self.device, sampler=self.sampler, fused=options.fused, track=options.debug)
        # the short prompt steps (drafters.prompt_pass) replayed from graphs too, one per padded row count
        steps = self.graphs and (options.step_capture is not None or self.device.type == "cuda")
        self.prompt_steps = {e: GraphedEngine(e, {step_rows(r) for r in range(1, e.short_rows + 1)},
                                              options.step_capture or CudaGraphCapture())
                             for e in (target, *drafter.prompt_engines) if steps and e.short_rows}
        drafter.prompt_steps = self.prompt_steps
        self.state = RoundState(self.device)
        self.pipeline = (self.device.type == "cuda" if options.pipeline is None else options.pipeline) \
            and not options.debug
        # a round is not idempotent: it is recorded without warm-up runs of it
        capture = options.capture or CudaGraphCapture()
        self.capture = capture.recording_only() if isinstance(capture, CudaGraphCapture) else capture
        self._executors: dict[tuple[bool, tuple], Eager | Graphed] = {}   # (plain?, sampler mode) -> executor
        self._kv = self._kv_lists()
        self._host = HostRows()

    # -- requests ----------------------------------------------------------------------------------

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """EngineError unless the prompt is non-empty, in range and leaves room for one drafter round."""
        lookahead = self.drafter.lookahead
        check_prompt(prompt_ids, self.max_seq_len, lookahead, f"{lookahead} slots for the {self.drafter.name} "
                     "drafter's round")

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str],
                      sampling: SamplingParams) -> None:
        """Everything a request can get wrong, before any work."""
        check_request(prompt_ids, max_new_tokens, stop, sampling, check_prompt=self.check_prompt,
                      detokenize=self.detokenize, loop=type(self).__name__)

    def generate_n(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
                   on_tokens: Callable[[int, list[int]], None] | None = None,
                   sampling: SamplingParams = GREEDY, cancel: threading.Event | None = None) -> list[Result]:
        """``sampling.n`` independent samples of one prompt, one after another. They share one seed (drawn
        here when ``sampling.seed`` is None) and differ by stream index; ``on_tokens(index, tokens)`` streams
        each; ``cancel`` ends the current one and skips the rest."""
        self.check_request(prompt_ids, max_new_tokens, stop, sampling)
        sampling = with_seed(sampling)
        results = []
        for j in range(sampling.n):
            if cancel is not None and cancel.is_set():
                break
            results.append(self.generate(prompt_ids, max_new_tokens, stop, None if on_tokens is None else
                                         (lambda tokens, j=j: on_tokens(j, tokens)), sampling, index=j, cancel=cancel))
        return results

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
                 on_tokens: Callable[[list[int]], None] | None = None, sampling: SamplingParams = GREEDY,
                 index: int = 0, cancel: threading.Event | None = None) -> Result:
        """One sequence of up to ``max_new_tokens`` after ``prompt_ids`` (``stream``'s arguments);
        ``on_tokens`` receives each round's new tokens as they are committed."""
        run = self.stream(prompt_ids, max_new_tokens, stop, sampling, index, cancel)
        for tokens in run:
            if on_tokens is not None:
                on_tokens(tokens)
        return run.result

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
               sampling: SamplingParams = GREEDY, index: int = 0, cancel: threading.Event | None = None,
               stats: Stats | None = None) -> Run:
        """One sequence of up to ``max_new_tokens`` after ``prompt_ids``, greedy unless ``sampling`` has a
        temperature (``index``: which stream of the seed, i.e. sample ``index`` of ``generate_n``), as an
        iterator of each round's new tokens; its ``result`` once exhausted. Stops at an EOS id or a stop
        string (both kept). Setting ``cancel`` (from another thread) ends it before its next round (reason
        "cancelled"). Checked before any work; nothing runs until the first token is asked for. ``stats``:
        count into this object, round by round (the batch loop's lone sequence, runtime/decoding/solo.py)."""
        self.check_request(prompt_ids, max_new_tokens, stop, sampling)
        stats = stats if stats is not None else Stats()
        return Run(self._rounds(list(prompt_ids), max_new_tokens, stop, sampling, index, cancel, stats))

    # -- the loop ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def _rounds(self, prompt_ids: list[int], max_new_tokens: int, stop: Sequence[str], sampling: SamplingParams,
                index: int, cancel: threading.Event | None, stats: Stats) -> Iterator[list[int]]:
        stats.prompt_tokens, stats.accepted_at = len(prompt_ids), [0] * self.drafter.max_depth
        stats.target_forwards += 1
        stops = Stops(max_new_tokens, self.eos_ids, stop, self.detokenize)
        seed = self.sampler.reset(sampling, index)
        self._forget_stale_graphs()
        start = time.perf_counter()

        self._prefill(prompt_ids)
        first = stops.push(self.state.root.tolist())                          # the first token: one sync
        stats.prefill_s = time.perf_counter() - start
        yield first

        n = len(prompt_ids)                                                     # KV length, on the host
        self.state.length.fill_(n)                                              # and on the device
        drafter, ahead = self.drafter, None
        while not stops.reason:
            if cancel is not None and cancel.is_set():      # once a round: a server frees the engine promptly
                stops.reason = "cancelled"
                break
            if ahead is None and n + drafter.lookahead > self.max_seq_len:
                if n + 1 > self.max_seq_len:
                    stops.reason = "max_seq_len"
                    break
                drafter = self.plain        # for good: the room only shrinks, and the output law is the same
            current, ahead = ahead or self._queue(drafter), None
            # Pipelining: the next round reads (root, length) on the device, so it can be queued now, while the
            # host waits for this one, if it fits in the cache, runs the same drafter whatever this round
            # accepts, and this round cannot reach max_new_tokens. Only a stop the host cannot foresee (EOS, a
            # stop string, a cancel) leaves it running unread; the next request starts afresh.
            most = drafter.max_depth + 1                                        # tokens a round can emit
            if (self.pipeline and n + most + drafter.lookahead <= self.max_seq_len
                    and len(stops.tokens) + most < max_new_tokens):
                ahead = self._queue(drafter)
            host = current()                                                    # the one copy back a round
            accepted = host[0]
            n += accepted + 1
            stats.add_round(drafter.block_size - 1, accepted)
            if self.options.debug:
                self._check_kv(n, drafter)
            yield stops.push(host[1:accepted + 2])

        stats.decode_s = time.perf_counter() - start - stats.prefill_s
        stats.new_tokens = len(stops.tokens)
        return Result(stops.tokens, stats, stops.reason, seed, index)

    def _prefill(self, prompt_ids: list[int]) -> None:
        """The target's pass over the prompt and the drafter's own; the first token (the sampler's) in state.root."""
        prompt = torch.tensor([prompt_ids], dtype=torch.int64, device=self.device)
        out, _, taps = prompt_pass(self.target, prompt, keep="hidden_taps", steps=self.prompt_steps.get(self.target))
        self.state.root.copy_(self.sampler.sample(out["logits"][:, -1]))
        self.drafter.start(prompt, taps, self.state.root)

    @torch.inference_mode()
    def warm_up(self, samplings: Sequence[SamplingParams] = (GREEDY,),
                on_part: Callable[[Warmed], None] | None = None, prompt: int | None = None) -> list[Warmed]:
        """Run every prompt-pass shape and every round a request can reach (decoding/warmup.py), rounds under each
        of ``samplings``' sampler modes, so that no request waits on a kernel compile or a graph capture; then
        clear the KV buffers and the round state as a fresh generator has them. ``prompt``: only the pass of a
        prompt of that many tokens (one known request, as ``xrun generate`` has). Returns the parts, timed."""
        parts, sync = Parts(on_part), (lambda: self.state.root.tolist())
        lengths = [prompt] if prompt is not None else prompt_lengths(self.max_seq_len - self.drafter.lookahead)
        self._forget_stale_graphs()
        for group in ([n for n in lengths if n <= SHORT], [n for n in lengths if n > SHORT]):
            if group:
                with parts.part(f"prompt passes of {spans(group)} tokens", sync):
                    for n in group:
                        for _ in range(SHORT_PASSES if n <= SHORT else 1):
                            self._prefill([0] * n)
        for sampling in samplings:
            what = f"rounds ({self.drafter.name}; plain, as near the cache's end), {describe(sampling)}"
            with parts.part(what, sync):
                self.sampler.reset(sampling)
                self._prefill([0])
                self.state.length.fill_(n := 1)
                for drafter in (self.drafter, self.plain):
                    for _ in range(ROUNDS):
                        if n + drafter.lookahead > self.max_seq_len:
                            break
                        n += self._queue(drafter)()[0] + 1
        for kv in self._kv_lists():
            for buf in kv:
                buf.zero_()
        self.state.root.zero_()
        self.state.length.zero_()
        self.sampler.reset(GREEDY)
        return parts.done

    def _executor(self, drafter: Drafter) -> Eager | Graphed:
        """The round of ``drafter`` under the request's sampler mode (greedy or not, top-k, top-p: Python
        branches a recording bakes in), its verifier and executor chosen once and kept (a recording writes
        their buffers)."""
        key = (drafter is self.plain, self.sampler.mode)
        executor = self._executors.get(key)
        if executor is None:
            round_ = Round(self.target, drafter, verifier_for(drafter, self.sampler, self.fused), self.state)
            executor = self._executors[key] = Graphed(round_, self.capture) if self.graphs else Eager(round_)
        return executor

    def _queue(self, drafter: Drafter) -> Callable[[], list[int]]:
        """Queue one round; a function that waits for it and returns its host row as a list."""
        return self._host.fetch(self._executor(drafter)())

    def _kv_lists(self) -> tuple[list, ...]:
        return tuple(e.kv for e in (self.target, *self.drafter.engines))

    def _forget_stale_graphs(self) -> None:
        """Drop every round and its recording when an engine's KV was re-bound (Engine.bind_kv) since they were
        made: a recording writes the buffers it was made with. Later recordings go to a new memory pool (torch
        refuses captures into a pool whose graphs are all gone)."""
        kv = self._kv_lists()
        if any(a is not b for a, b in zip(kv, self._kv)):
            self._executors.clear()
            for steps in self.prompt_steps.values():
                steps.forget()
            if isinstance(self.capture, CudaGraphCapture):
                self.capture.new_pool()
        self._kv = kv

    @property
    def graph_fallback(self) -> str | None:
        """Why a round or a prompt step runs eagerly although CUDA graphs were asked for (None: they replay, or
        were not asked)."""
        rounds = (e.fallback for e in self._executors.values() if isinstance(e, Graphed))
        return next((f for f in (*rounds, *(s.fallback for s in self.prompt_steps.values())) if f), None)

    def _check_kv(self, n: int, drafter: Drafter) -> None:
        """Debug: every cache's committed length matches, then the stale rows past it are poisoned, so a step
        that read them would change the output."""
        for kv, cache_len, rewritten in [(self.target.kv, self.state.length, 0)] + drafter.caches():
            assert int(cache_len) == n, (int(cache_len), n)
            for buf in kv:
                buf[:, :, n - rewritten:] = POISON

