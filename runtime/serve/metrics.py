"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per app.

    xcompile_requests_total{route, status}          HTTP responses by route and status code
    xcompile_generations_total{reason}              choices ended: stop | length | timeout | cancelled | error
    xcompile_prompt_tokens_total, xcompile_generation_tokens_total
    xcompile_draft_tokens_total, xcompile_accepted_tokens_total     (their ratio: the acceptance rate)
    xcompile_queue_depth, xcompile_requests_running                 requests waiting / on the device (0 or 1)
    xcompile_time_to_first_token_seconds             the request reaching the app (its headers read) to its first
                                                    token: the body's parse, checks, tokenizing and queueing included
    xcompile_time_per_output_token_seconds           per choice: (last token - first token) / (tokens - 1)
    xcompile_acceptance_length                       tau of each choice: tokens per target forward
    xcompile_engine_step_seconds{kind}              the batching engine thread's steps (--max-batch N dirs): a lone
                                                    sequence's prefill (prompt) or speculative round (round), or a
                                                    batch step carrying prompt chunks (batch_prompt) or decoding
                                                    rows alone (batch); wall time on that thread
    xcompile_gc_pause_seconds{generation}           the garbage collector's collections in the server process, by
                                                    the generation collected (a pause of whichever thread ran it)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# latency buckets from 1 ms (a draft step of a small model) to a minute (a long queue)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# engine steps: a draft-model step of a small model (~1 ms) to a long prompt's prefill
STEP_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)
# the kinds of xcompile_engine_step_seconds and the reasons of xcompile_generations_total, each child made when the app
# is: its first make took 5.2 ms on the engine thread, inside the first request's TTFT (H100, 2026-12-07, traced)
STEP_KINDS = ("prompt", "round", "batch_prompt", "batch")
FINISHES = ("stop", "length", "timeout", "cancelled", "error")
TAU_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
# collector pauses: a young generation's tens of µs to a full collection of an unfrozen heap (156 ms on the 2-core
# CPU with the demo dir open)
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class Metrics:
    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("xcompile_requests", "HTTP responses by route and status code",
                                ["route", "status"], registry=r)
        self.generations = Counter("xcompile_generations", "Choices ended, by reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("xcompile_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("xcompile_generation_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("xcompile_draft_tokens", "Draft tokens sent to verification", registry=r)
        self.accepted = Counter("xcompile_accepted_tokens", "Draft tokens accepted by verification", registry=r)
        Gauge("xcompile_queue_depth", "Requests waiting for the device", registry=r).set_function(queue_depth)
        Gauge("xcompile_requests_running", "Requests on the device", registry=r).set_function(running)
        self.ttft = Histogram("xcompile_time_to_first_token_seconds", "The request reaching the app to its first token, parse and queueing included",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("xcompile_time_per_output_token_seconds", "Per choice: mean time between tokens "
                              "after the first", buckets=LATENCY_BUCKETS, registry=r)
        self.tau = Histogram("xcompile_acceptance_length", "Tokens per target forward (tau) of each choice",
                             buckets=TAU_BUCKETS, registry=r)
        self.steps = Histogram("xcompile_engine_step_seconds", "Steps of the batching engine thread: a lone "
                               "sequence's prefill (prompt) or round (round), or a batch step carrying prompt chunks (batch_prompt) "
                               "or decoding rows alone (batch)", ["kind"],
                               buckets=STEP_BUCKETS, registry=r)
        for kind in STEP_KINDS:
            self.steps.labels(kind)
        for reason in FINISHES:
            self.generations.labels(reason)

        self.gc_pauses = Histogram("xcompile_gc_pause_seconds", "Garbage collections in the server process, by "
                                   "the generation collected", ["generation"], buckets=GC_BUCKETS, registry=r)

    def watch_gc(self) -> Callable[[], None]:
        """Time every collection into xcompile_gc_pause_seconds from now on; returns what stops it."""
        children, began = [self.gc_pauses.labels(str(g)) for g in range(3)], [0.0]

        def timed(phase: str, info: dict) -> None:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                children[info["generation"]].observe(time.perf_counter() - began[0])
        gc.callbacks.append(timed)
        return lambda: gc.callbacks.remove(timed)

    def finished(self, result, first_token_s: float, done_s: float) -> None:
        """One choice ended normally (times: time.monotonic())."""
        s = result.stats
        self.generations.labels("stop" if result.finish_reason in ("eos", "stop") else "length").inc()
        self.generation_tokens.inc(s.new_tokens)
        self.drafted.inc(s.drafted)
        self.accepted.inc(s.accepted)
        if s.rounds:
            self.tau.observe(s.acceptance_length)
        if s.new_tokens > 1:
            self.tpot.observe((done_s - first_token_s) / (s.new_tokens - 1))

    def step(self, kind: str, seconds: float) -> None:
        """One step of the batching engine thread (called on that thread; prometheus_client is thread-safe)."""
        self.steps.labels(kind).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
