"""Warm-up: every path a request can reach, run once before the first request (issue 37 item 3).

What a cold request pays, and where:

    prompt passes  one pass over the L prompt tokens (target, then the drafter's own). Passes of up to
                   ``SHORT`` tokens take each backend's short-step route, which specialises on L: the fast
                   backend's Triton kernels (tiles of 16 rows as a constexpr, integer arguments equal to 1 or
                   divisible by 16, the attention's register cap by grid size: a compile per new case),
                   ONNX Runtime's CUDA graphs (one per token count up to ort.GRAPH_MAX_TOKENS), TensorRT's
                   graphs of its decode profile. So every L from 1 to SHORT is run, twice (TensorRT records on
                   a shape's second run). Longer passes run the reference modules (fast: past SHORT_STEPS
                   short steps, drafters.prompt_pass), ORT or TensorRT without graphs: shape-generic kernels
                   (cuBLAS, SDPA) whose first use loads what they pick, run at SHORT + 1, powers of two up to
                   the longest prompt the engine dir admits, and SHORT_STEPS * SHORT + 1.
    rounds         a round is recorded as one CUDA graph per (drafter, sampler mode) on its second call, and
                   the loop's fused kernels compile on the first; the plain round the loop falls back to near
                   the cache's end is another. Each is run twice (eager; recorded and replayed) under each
                   sampler mode of ``sampler_modes``.
    batch steps    the batch loop's steps take S = 1 .. its chunk tokens (ORT graphs one per S): each is run
                   twice, greedy and eagerly, then once at each of the loop's recorded sizes (a CUDA graph each:
                   prompt-carrying steps are padded to them, batch.recorded_sizes), and sampled steps once per
                   sampled mode; with drafts (batch_drafts.py) the head's feeds ride along, and two sequences
                   decode a few verify steps (the head's proposals, the verify step recorded); its lone
                   sequence's Generator (solo.py) is warmed as above.

Afterwards the KV buffers and the loop's state are cleared as a fresh loop has them (the recordings, compiled
kernels and cached masks stay: that is the point), so a request's output is what it is without warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from xcompile.runtime.decoding.sampling import GREEDY, SamplingParams
from xcompile.runtime.engines.base import SHORT_STEPS

# The longest step on every backend's short-step route: the fast kernels' MAX_ROWS, ort.GRAPH_MAX_TOKENS and
# the batch loop's CHUNK (tests/runtime/decoding/test_warmup.py holds it to them).
SHORT = 64
ROUNDS = 2          # calls of a graphed round: eager (lazy set-up, compiles), then recorded and replayed
SHORT_PASSES = 2    # runs of each short step: TensorRT records a step shape's graph on its second run


@dataclass(frozen=True)
class Warmed:
    """One part of a warm-up: what ran and how long it took (seconds, the device synchronised)."""

    what: str
    seconds: float


class Parts:
    """The parts of one warm-up as they finish; ``on_part`` hears of each (a server logs it)."""

    def __init__(self, on_part: Callable[[Warmed], None] | None = None):
        self.done: list[Warmed] = []
        self.on_part = on_part

    @contextmanager
    def part(self, what: str, sync: Callable[[], None]) -> Iterator[None]:
        start = time.perf_counter()
        yield
        sync()
        self.done.append(Warmed(what, time.perf_counter() - start))
        if self.on_part is not None:
            self.on_part(self.done[-1])


def prompt_lengths(longest: int) -> list[int]:
    """Prompt lengths whose passes cover every shape a prompt of 1 .. ``longest`` tokens can reach (module
    docstring): each up to SHORT, then SHORT + 1, the powers of two between, the shortest past SHORT_STEPS short
    steps (the fast backend's first prompt on the reference modules), and ``longest``."""
    lengths = list(range(1, min(SHORT, longest) + 1))
    n = SHORT + 1
    while n < longest:
        lengths.append(n)
        n = 1 << n.bit_length()             # the next power of two
    if longest > SHORT:
        lengths.append(longest)
    return sorted(set(lengths) | ({SHORT_STEPS * SHORT + 1} if longest > SHORT_STEPS * SHORT else set()))


def sampler_modes(defaults: dict | None) -> list[SamplingParams]:
    """One request's sampling per sampler mode to warm (what a recording bakes in: greedy, top_k, top-p on):
    greedy, plain sampling, top-p, top-k with top-p off and on (the two variants of the sampling kernels,
    decoding/kernels/sample.py) and the engine dir's generation_config values (``defaults``, as
    sampling.generation_defaults reads them; None: no file). Other top_k values record their round on
    first use (no compile: the kernels take k as an argument, and top-k past theirs is torch.topk)."""
    seeded = dict(temperature=1.0, seed=0)
    candidates = [GREEDY, SamplingParams(**seeded), SamplingParams(top_p=0.9, **seeded),
                  SamplingParams(top_k=20, **seeded), SamplingParams(top_k=20, top_p=0.9, **seeded)]
    if defaults is not None:
        candidates.append(SamplingParams(top_k=int(defaults["top_k"] or 0), top_p=float(defaults["top_p"]), **seeded))
    modes, out = set(), []
    for s in candidates:
        mode = (s.greedy, s.top_k, s.top_p < 1)
        if mode not in modes:
            modes.add(mode)
            out.append(s)
    return out


def describe(s: SamplingParams) -> str:
    """A sampler mode in words, for the warm-up's log lines."""
    if s.greedy:
        return "greedy"
    return "sampled" + (f", top-k {s.top_k}" if s.top_k else "") + (", top-p" if s.top_p < 1 else "")


def spans(lengths: list[int]) -> str:
    """[1, 2, 3, 65, 128] -> '1..3, 65, 128'."""
    out, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] != lengths[i - 1] + 1:
            a, b = lengths[start], lengths[i - 1]
            out.append(str(a) if a == b else f"{a}..{b}")
            start = i
    return ", ".join(out)


def warm_batch(loop, samplings: list[SamplingParams] | tuple[SamplingParams, ...],
               on_part: Callable[[Warmed], None] | None) -> list[Warmed]:
    """The batch loop's steps of every S from 1 to its chunk, one sequence at a time, greedy, then two steps under
    each sampled mode of ``samplings``, then its lone sequence's Generator's warm-up (greedy: it runs no other);
    the caller clears the KV and the loop's stats."""
    device = loop.device
    parts = Parts(on_part)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sizes = list(range(1, min(loop.chunk, loop.max_seq_len - 1) + 1))
    solo, loop.solo = loop.solo, None           # these single sequences take batch steps
    try:
        with parts.part(f"batch steps of {spans(sizes)} tokens, greedy", sync), loop.eager():
            for s in sizes:                     # one sequence at a time: a step of s tokens each
                for _ in range(SHORT_PASSES):
                    loop.generate([([0] * s, 1)])
        if loop.recorded:                       # the recorded steps (CUDA graphs), prompt chunks padded to them
            recorded = [s for s in loop.sizes if s < loop.max_seq_len]
            with parts.part(f"batch steps recorded at {', '.join(map(str, recorded))} tokens", sync):
                for s in recorded:
                    loop.generate([([0] * s, 1)])
        if loop.drafts is not None:             # two sequences: verify steps of a root and its chain a row,
            gamma = loop.drafts.gamma           # at least two however many drafts each accepts
            with parts.part(f"batch steps verifying chains of {gamma} drafts", sync):
                loop.generate([([0], 2 * gamma + 3)] * 2)
        for sampling in samplings:
            if not sampling.greedy:
                with parts.part(f"batch steps, {describe(sampling)}", sync):
                    loop.generate([([0], 2, (), sampling)])
    finally:
        loop.solo = solo
    return parts.done + (solo.gen.warm_up(on_part=on_part) if solo is not None else [])
