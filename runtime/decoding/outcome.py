"""What a generation returns and when it stops: ``Stats``, ``Result``, the stop conditions (``Stops``), and ``Run``,
a generation as an iterator of its rounds' tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.sampling import SamplingParams


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


class Stops:
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


def check_prompt(prompt_ids: Sequence[int], max_seq_len: int, room: int, room_for: str) -> None:
    """EngineError unless the prompt is non-empty, in range and leaves ``room`` slots (what ``room_for`` says)."""
    if not prompt_ids:
        raise EngineError("empty prompt: give at least one token")
    if len(prompt_ids) + room > max_seq_len:
        raise EngineError(f"prompt of {len(prompt_ids)} tokens + {room_for} exceed max_seq_len {max_seq_len}; "
                          "shorten the prompt or rebuild with a larger --max-seq-len")
    if min(prompt_ids) < 0:
        raise EngineError(f"prompt holds a negative token id ({min(prompt_ids)})")


def check_request(prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str], sampling: SamplingParams, *,
                  check_prompt: Callable[[Sequence[int]], None], detokenize: Callable | None, loop: str) -> None:
    """EngineError for anything a request can get wrong, before any work: the rule of both loops (the batch-1
    Generator and the BatchGenerator, named by ``loop``), each checking prompts its own way (``check_prompt``)."""
    if not isinstance(sampling, SamplingParams):
        raise EngineError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    check_prompt(prompt_ids)
    if stop and detokenize is None:
        raise EngineError(f"stop strings need a detokenize callback ({loop}(..., detokenize=...))")
    if max_new_tokens < 1:
        raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


class Run:
    """A generation as an iterator of each round's new tokens; ``result`` (a ``Result``) once exhausted."""

    def __init__(self, rounds: Iterator[list[int]]):
        self._rounds = rounds
        self.result: Result | None = None

    def __iter__(self) -> Run:
        return self

    def __next__(self) -> list[int]:
        while True:
            try:
                tokens = next(self._rounds)
            except StopIteration as done:
                self.result = done.value
                raise
            if tokens:
                return tokens
