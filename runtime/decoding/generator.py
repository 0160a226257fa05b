"""The generation loop: prefill, then speculative rounds (propose -> verify -> accept -> commit) until a stop.

    gen = Generator(target, Eagle3TreeDrafter(eagle3, fc, d2t, topk=8, depth=6, total_tokens=48),
                    eos_ids=[151645], max_seq_len=4096, detokenize=tokenizer.decode)
    result = gen.generate(prompt_ids, max_new_tokens=256, stop=["\\n\\n"], on_tokens=print)
    samples = gen.generate_n(prompt_ids, 256, sampling=SamplingParams(temperature=0.6, top_p=0.95, n=4))

A round is device work end to end; the host reads back one small tensor (the accepted count and the
emitted tokens) per round to apply stops, stream and decide whether to go on. With greedy
verification the output equals plain greedy decoding of the target token for token, whatever the
drafter proposes (exactly so in fp32; in bf16 a verify pass over S tokens may round differently from
S single steps and flip a near-tie). With sampling, speculative sampling makes every token a draw
from the target's warped distribution, whatever the drafter proposes; the random state is the
generator's ``Sampler`` (device tensors), so a seed reproduces a run on the same backend.

KV bookkeeping: the target's KV holds every committed token but the last (the root), which the next
verify writes at ``length`` first; a round writes rows length .. length+S-1, and accepting a drafts
advances ``length`` by a+1. Rows past ``length`` are stale and no mask ever reads them.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding import kernels
from xcompile.runtime.decoding.drafters import Drafter, NoDrafter, prompt_inputs
from xcompile.runtime.decoding.sampling import GREEDY, Sampler, SamplingParams, with_seed
from xcompile.runtime.decoding.speculative import (
    Accepted,
    Block,
    accept_chain,
    accept_tree,
    bonus,
    compact_kv,
    for_host,
)
from xcompile.runtime.engines.base import Engine
from xcompile.runtime.engines.graphs import Capture, CudaGraphCapture, GraphedEngine, GraphUnavailable

if TYPE_CHECKING:
    from xcompile.runtime.decoding.kernels.accept import ChainAccept

# debug mode: stale KV rows are filled with this between rounds. Finite on purpose: attention kernels
# multiply masked rows by a zero weight, and 0 * NaN would leak a NaN the mask did exclude. (fp32/bf16:
# in fp16, q.k against it can overflow.)
POISON = 1e4


@dataclass
class Stats:
    """Counts and timings of one ``generate`` call."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0          # prompt passes of target and drafter, to the first token on the host
    decode_s: float = 0.0           # every round after that
    target_forwards: int = 0        # prefill included
    rounds: int = 0                 # verify passes after the prefill
    drafted: int = 0                # drafted tokens sent to verification
    accepted: int = 0               # of those, accepted by verification (a stop may drop some after)
    accepted_at: list[int] = field(default_factory=list)   # [i]: rounds whose draft at depth i+1 was accepted

    def add_round(self, drafted: int, accepted: int) -> None:
        self.target_forwards += 1
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole request (prefill included)."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens emitted by the rounds (all but the first) per second of decoding."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        """τ, the one definition used everywhere (bench, train-eagle3, README): tokens emitted per verify
        round, the bonus token included and tokens dropped by a stop or the length cap excluded. Every
        emitted token but the first (the prefill's) comes from a round, so τ = (new_tokens - 1) / rounds;
        ``accepted`` also counts drafts a stop then dropped, so (accepted + rounds) / rounds can be more."""
        return (self.new_tokens - 1) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [n / self.rounds for n in self.accepted_at] if self.rounds else []


@dataclass
class Result:
    """What ``generate`` returns."""

    tokens: list[int]               # generated tokens, the stopping EOS / stop-string token included
    stats: Stats
    finish_reason: str = ""         # "eos" | "stop" | "max_tokens" | "max_seq_len" | "cancelled"
    seed: int | None = None         # the sampling seed used (None: greedy); with the index, reproduces the run
    index: int = 0                  # which of the request's n samples this is


class _Stops:
    """Applies stop conditions token by token to what a round emits; tokens after a stop are dropped."""

    def __init__(self, max_new_tokens: int, eos_ids: frozenset[int], stop: Sequence[str],
                 detokenize: Callable[[list[int]], str] | None):
        self.max_new_tokens, self.eos_ids, self.stop, self.detokenize = max_new_tokens, eos_ids, tuple(stop), detokenize
        # a stop string of c characters spans at most 4c byte-level tokens: decode only that tail
        self.window = 4 * max((len(s) for s in self.stop), default=0) + 4
        self.tokens: list[int] = []
        self.reason = ""

    def push(self, new: list[int]) -> list[int]:
        """Append ``new`` up to the first stop; returns the tokens kept."""
        kept = []
        for t in new:
            self.tokens.append(t)
            kept.append(t)
            # precedence: EOS, then a stop string, then the length cap (a stop inside the budget wins)
            if t in self.eos_ids:
                self.reason = "eos"
            elif self.stop and any(s in self.detokenize(self.tokens[-self.window:]) for s in self.stop):
                self.reason = "stop"
            elif len(self.tokens) >= self.max_new_tokens:
                self.reason = "max_tokens"
            if self.reason:
                break
        return kept


class Generator:
    """Speculative generation over a target engine and a drafter (module docstring)."""

    def __init__(self, target: Engine, drafter: Drafter, eos_ids: Iterable[int], max_seq_len: int, *,
                 detokenize: Callable[[list[int]], str] | None = None, cuda_graphs: bool = False,
                 round_graphs: bool = True, capture: Capture | None = None, debug: bool = False,
                 pipeline: bool | None = None, fused: bool | None = None):
        """target: the ``target`` graph engine; drafter: what proposes blocks (``NoDrafter()`` for plain
        greedy); max_seq_len: KV capacity used (the engines may hold more); detokenize: ids -> text,
        needed for stop strings; cuda_graphs: record CUDA graphs. When every engine's steps are
        ``graph_capturable`` (torch, fast) and ``round_graphs``, each drafter's whole round (draft steps,
        verify, accept, KV compaction, draft update) is one graph, replayed once per round, recorded by
        ``capture`` (default ``CudaGraphCapture(warmup=0)``: a round is not idempotent, so the capture
        must record without running it). Otherwise the fixed-shape steps of the capturable engines are
        graphed one by one (``GraphedEngine``, with ``capture`` defaulting to one ``CudaGraphCapture``
        shared by all) and the others, e.g. TensorRT engines with graphs of their own, run as they are.
        Either falls back to eager where capture is unavailable. debug: check KV lengths and poison
        stale rows every round. pipeline (not with debug): launch each round before reading the previous
        one's outcome (``generate``); None: on a CUDA device (on the CPU a round computes as it is
        launched, so there is nothing to overlap and a round past an EOS would be wasted). fused: greedy
        chain verification and the state update in two launches, and each greedy draft pick in one
        (kernels/accept.py), instead of torch's small ops; None: on a CUDA device with triton, True: also
        in Triton's interpreter."""
        if target.kv_shape is None or target.kv_shape.max_seq_len < max_seq_len or target.kv_shape.batch != 1:
            have = None if target.kv_shape is None else (target.kv_shape.batch, target.kv_shape.max_seq_len)
            raise EngineError(f"target engine KV (batch, slots) is {have}, the generator needs (1, {max_seq_len}); "
                              "rebuild the engine dir with a larger --max-seq-len or lower it here")
        if drafter.needs_taps and "hidden_taps" not in target.spec.output_names:
            raise EngineError(f"the {drafter.name} drafter reads the target's hidden_taps, which this target engine "
                              "does not output; export the target with EAGLE3 taps")
        if not target.kv:
            target.new_kv()
        self.device = target.device
        self.max_seq_len, self.eos_ids, self.detokenize, self.debug = max_seq_len, frozenset(eos_ids), detokenize, debug
        self.drafter = drafter
        self.pipeline = (self.device.type == "cuda" if pipeline is None else pipeline) and not debug
        self._host: dict[tuple[int, ...], list[torch.Tensor]] = {}      # pinned copies of for_host, two per shape
        self.plain = NoDrafter()        # takes over when the drafter's lookahead no longer fits the cache
        self.sampler = Sampler(self.device)     # one for every request: its tensors keep their addresses
        for d in (drafter, self.plain):
            d.bind(max_seq_len, self.device, sampler=self.sampler, fused=fused, track=debug)
        self.target = target
        # the round's state on the device: the root (last committed token, not yet in the KV) and the
        # target's KV length; every round updates both in place
        self.root = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.length = torch.zeros(1, dtype=torch.int64, device=self.device)
        # whole-round CUDA graphs when every engine's steps are capturable (one replay per round), else
        # graphs per fixed-shape step of the capturable engines
        self.rounds: dict[tuple, _RoundGraph] | None = None
        self.round_fallback: str | None = None
        if cuda_graphs and round_graphs and all(e.graph_capturable for e in (target, *drafter.engines)):
            self.rounds = {}
            # a round is not idempotent: its capture records it without warm-up runs of it
            capture = capture or CudaGraphCapture(warmup=0)
            self.capture = capture.recording_only() if isinstance(capture, CudaGraphCapture) else capture
        elif cuda_graphs:
            step_capture = capture or CudaGraphCapture()

            def graphed(engine: Engine, tokens: set[int]) -> Engine:
                return GraphedEngine(engine, tokens, step_capture) if engine.graph_capturable else engine

            self.target = graphed(target, {drafter.block_size, 1})
            drafter.use_graphs(graphed)
        # logit_rows of a verify pass: every block node
        self.rows = {s: torch.arange(s, device=self.device)[None] for s in {drafter.block_size, 1}}
        # the fused greedy chain verification per block size (made by its first round, which runs eagerly)
        self.accepts: dict[tuple[int, int], ChainAccept] | None = {} if kernels.use_fused(fused, self.device) else None

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """EngineError unless the prompt is non-empty, in-range and leaves room for one drafter round."""
        need = len(prompt_ids) + self.drafter.lookahead
        if not prompt_ids:
            raise EngineError("empty prompt: give at least one token")
        if need > self.max_seq_len:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens + {self.drafter.lookahead} slots for the "
                              f"{self.drafter.name} drafter's round exceed max_seq_len {self.max_seq_len}; "
                              "shorten the prompt or rebuild with a larger --max-seq-len")
        if min(prompt_ids) < 0:
            raise EngineError(f"prompt holds a negative token id ({min(prompt_ids)})")

    def generate_n(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
                   on_tokens: Callable[[int, list[int]], None] | None = None,
                   sampling: SamplingParams = GREEDY, cancel: threading.Event | None = None) -> list[Result]:
        """``sampling.n`` independent samples of one prompt, generated one after another (batch 1).
        They share one seed (drawn here when ``sampling.seed`` is None) and differ by stream index;
        ``on_tokens(index, tokens)`` streams each; ``cancel`` ends the current one and skips the rest."""
        self._check(prompt_ids, max_new_tokens, stop, sampling)
        sampling = with_seed(sampling)
        results = []
        for j in range(sampling.n):
            if cancel is not None and cancel.is_set():
                break
            results.append(self.generate(prompt_ids, max_new_tokens, stop, None if on_tokens is None else
                                         (lambda tokens, j=j: on_tokens(j, tokens)), sampling, index=j, cancel=cancel))
        return results

    def _check(self, prompt_ids, max_new_tokens, stop, sampling) -> None:
        """Everything a request can get wrong, before any work."""
        if not isinstance(sampling, SamplingParams):
            raise EngineError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        self.check_prompt(prompt_ids)
        if stop and self.detokenize is None:
            raise EngineError("stop strings need a detokenize callback (Generator(..., detokenize=...))")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
                 on_tokens: Callable[[list[int]], None] | None = None, sampling: SamplingParams = GREEDY,
                 index: int = 0, cancel: threading.Event | None = None) -> Result:
        """One sequence of up to ``max_new_tokens`` after ``prompt_ids``, greedy unless ``sampling`` has a
        temperature (``index``: which stream of the seed, i.e. sample ``index`` of ``generate_n``). Stops
        at an EOS id or a stop string (both kept); ``on_tokens`` receives each round's new tokens as they
        are committed. Setting ``cancel`` (from another thread) ends the generation before its next round
        (reason "cancelled")."""
        self._check(prompt_ids, max_new_tokens, stop, sampling)
        stats = Stats(prompt_tokens=len(prompt_ids), target_forwards=1, accepted_at=[0] * self.drafter.max_depth)
        stops = _Stops(max_new_tokens, self.eos_ids, stop, self.detokenize)
        seed = self.sampler.reset(sampling, index)
        start = time.perf_counter()

        prompt = torch.tensor([list(prompt_ids)], dtype=torch.int64, device=self.device)
        out = self.target.run(**prompt_inputs(prompt))
        self.root.copy_(self.sampler.sample(out["logits"][:, -1]))              # [1]
        drafter = self.drafter
        drafter.start(prompt, out.get("hidden_taps"), self.root)
        emit(stops.push(self.root.tolist()), on_tokens)                         # the first token: one sync
        stats.prefill_s = time.perf_counter() - start

        n = len(prompt_ids)                                                     # KV length, on the host
        self.length.fill_(n)                                                    # and on the device
        ahead = None                # the next round, launched before this one's outcome was read
        while not stops.reason:
            if cancel is not None and cancel.is_set():      # once per round: a server frees the engine promptly
                stops.reason = "cancelled"
                break
            if ahead is None:
                if n + drafter.lookahead > self.max_seq_len:
                    if n + 1 > self.max_seq_len:
                        stops.reason = "max_seq_len"
                        break
                    drafter = self.plain    # for good: the room only shrinks, and the output law is unchanged
                current = self._launch(drafter)
            else:
                current, ahead = ahead, None
            # Pipelining: the next round reads (root, length) on the device, so it can be queued now, while
            # the host waits for this one, if it fits in the cache and runs the same drafter whatever this
            # round accepts, and this round cannot reach max_new_tokens. Only a stop the host cannot foresee
            # (EOS, a stop string, a cancel) leaves it running unread; the next request starts afresh.
            most = drafter.max_depth + 1                                        # tokens a round can emit
            if (self.pipeline and n + most + drafter.lookahead <= self.max_seq_len
                    and len(stops.tokens) + most < max_new_tokens):
                ahead = self._launch(drafter)
            drafted, host = current[0], current[1]()                           # the one copy back per round
            a = host[0]
            n += a + 1
            stats.add_round(drafted, a)
            if self.debug:
                self._check_kv(n, self.length, drafter)
            emit(stops.push(host[1:a + 2]), on_tokens)

        stats.decode_s = time.perf_counter() - start - stats.prefill_s
        stats.new_tokens = len(stops.tokens)
        return Result(stops.tokens, stats, stops.reason, seed, index)

    def _launch(self, drafter: Drafter) -> tuple[int, Callable[[], list[int]]]:
        """Queue one round (``_advance``): (drafted tokens, a function that waits for it and returns its
        ``for_host`` row as a list). On a CUDA device the row is copied into one of two pinned buffers as
        the round's last work, so a round queued after it may overwrite the graph's output meanwhile."""
        drafted, back = self._advance(drafter)
        if back.device.type != "cuda":
            row = back[0].tolist()
            return drafted, lambda: row
        slots = self._host.get(tuple(back.shape))
        if slots is None:
            slots = self._host[tuple(back.shape)] = [torch.empty(back.shape, dtype=back.dtype).pin_memory()
                                                      for _ in range(2)]
        slots.append(slots.pop(0))
        host = slots[-1]
        host.copy_(back, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return drafted, lambda: (done.synchronize(), host[0].tolist())[1]

    def _advance(self, drafter: Drafter) -> tuple[int, torch.Tensor]:
        """One round from the device state (root, length), which it updates in place: (drafted tokens,
        [1, D+2] ``for_host`` of the outcome). With round graphs, a drafter's first round runs eagerly
        (lazy set-up: allocations, kernel compilation), its second is captured (recording runs
        nothing) and replayed, every later one is a replay of that graph."""
        if self.rounds is None:
            return self._round_in_place(drafter)
        # one graph per drafter and sampler mode: greedy or not, top-k, top-p are Python branches the
        # capture bakes in (temperature, top-p, min-p values and the random state are device tensors)
        key = (id(drafter), self.sampler.mode)
        graph = self.rounds.get(key)
        if graph is None:
            graph = self.rounds[key] = _RoundGraph()
            graph.drafted, back = self._round_in_place(drafter)
            graph.back = back if self._owned(back) else back.clone()
            return graph.drafted, graph.back
        if graph.kv is not None and any(a is not b for a, b in zip(graph.kv, self._kv_lists(drafter))):
            # an engine's KV was re-bound (Engine.bind_kv) since the capture: its graphs write the old buffers
            self.rounds.clear()
            if isinstance(self.capture, CudaGraphCapture):
                self.capture.new_pool()
            return self._advance(drafter)
        if graph.replay is None:
            graph.kv = self._kv_lists(drafter)
            try:
                graph.replay, _ = self.capture(lambda: self._round_in_place(drafter, graph.back), self.device)
            except (GraphUnavailable, RuntimeError) as e:
                self.round_fallback = f"{type(e).__name__}: {e}"
                warnings.warn(f"whole-round CUDA graph unavailable, running rounds eagerly ({self.round_fallback})",
                              stacklevel=3)
                self.rounds = None
                return self._advance(drafter)
        graph.replay()
        return graph.drafted, graph.back

    def _kv_lists(self, drafter: Drafter) -> tuple[list, ...]:
        """The KV lists of the round's engines (``bind_kv`` makes a new one): what a capture recorded."""
        return tuple(e.kv for e in (self.target, *drafter.engines))

    def _round_in_place(self, drafter: Drafter, back: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """A round that advances (root, length) in place and writes its ``for_host`` into ``back``."""
        block, acc = self._round(drafter, self.root, self.length)
        fused = next((a for a in self.accepts.values() if acc is a.acc), None) if self.accepts else None
        if fused is not None:
            fused.advance(self.root, self.length)
            out = fused.host
        else:
            self.length.add_(acc.count + 1)
            self.root.copy_(bonus(acc))
            out = for_host(acc)
        if back is not None and back is not out:
            back.copy_(out)
        return block.tokens.shape[1] - 1, out

    def _owned(self, back: torch.Tensor) -> bool:
        """Whether ``back`` is a buffer of the fused verification, rewritten in place by every round."""
        return self.accepts is not None and any(back is a.host for a in self.accepts.values())

    def _accept(self, block: Block, logits: torch.Tensor) -> Accepted:
        """Verification of ``block``: the fused kernels for a greedy chain (when on and in their limits),
        else speculative.accept_chain / accept_tree."""
        s, v = block.tokens.shape[1], logits.shape[-1]
        if (self.accepts is not None and block.chain and self.sampler.greedy and block.tokens.shape[0] == 1
                and s <= 64 and v <= 1 << 20 and logits.stride(-1) == 1
                and block.tokens.is_contiguous()):
            # one per (block size, vocabulary), kept for good: a captured round graph writes its buffers
            fused = self.accepts.get((s, v))
            if fused is None:
                from xcompile.runtime.decoding.kernels.accept import ChainAccept
                fused = self.accepts[s, v] = ChainAccept(s, v, self.device)
            return fused(block.tokens, logits)
        return (accept_chain if block.chain else accept_tree)(block, logits, self.sampler)

    def _round(self, drafter: Drafter, root: torch.Tensor, length: torch.Tensor) -> tuple[Block, Accepted]:
        """One round, device work only: propose -> verify -> accept -> compact -> commit.
        root [1] is the last committed token, length [1] the target's KV length."""
        block = drafter.propose(root, length)
        pos = block.positions if block.positions is not None else length[:, None] + block.depth
        out = self.target.run(input_ids=block.tokens, position_ids=pos,
                              write_index=length, tree_mask=block.mask, logit_rows=self.rows[block.tokens.shape[1]])
        acc = self._accept(block, out["logits"])
        if not block.chain:
            compact_kv(self.target.kv, length, acc.path)
        drafter.commit(block, acc, out.get("hidden_taps"), length)
        return block, acc

    def _check_kv(self, n: int, length: torch.Tensor, drafter: Drafter) -> None:
        """Debug: every cache's committed length matches, then the stale rows past it are poisoned,
        so a step that read them would change the output."""
        for kv, cache_len, rewritten in [(self.target.kv, length, 0)] + drafter.caches():
            assert int(cache_len) == n, (int(cache_len), n)
            for buf in kv:
                buf[:, :, n - rewritten:] = POISON


class _RoundGraph:
    """A drafter's round graph: its replay (None until captured), the drafted tokens per round and
    the buffer every replay writes the round's ``for_host`` into."""

    def __init__(self):
        self.replay: Callable[[], None] | None = None
        self.drafted = 0
        self.back: torch.Tensor | None = None
        self.kv: tuple[list, ...] | None = None     # the engines' KV lists when captured


def emit(tokens: list[int], on_tokens: Callable[[list[int]], None] | None) -> None:
    """Hand ``tokens`` to the streaming callback, if any and if there are tokens."""
    if tokens and on_tokens is not None:
        on_tokens(tokens)
