"""CUDA graphs for the fixed-shape steps of any Engine whose ``run`` is capturable (the torch and fast backends),
and the capture that this wrapper, the generation loop's whole-round graphs (runtime/decoding/rounds.py) and the
trt backend (which records its own launches) use. ``xrun bench`` times single steps through the wrapper.

``GraphedEngine`` wraps an engine and is one itself. On the first call whose token count is one of
its fixed-shape steps it clones the inputs into static buffers, warms up, captures one graph for
that input signature (names, shapes, dtypes); later calls copy their inputs into the static buffers
and replay. Other shapes (prompt passes) run eagerly, and so does every call once capture turns out
to be unavailable (no CUDA device) or fails, or when the engine does not declare its steps
``graph_capturable`` (runtime/engines/base.py: a TensorRT engine replays graphs of its own); ``fallback``
then says why.

Two things callers rely on:
  - replay returns the graph's static output buffers: they hold until the next call of the same
    shape, so keep a copy of what must outlive it (the drafters copy their seeds);
  - warm-up and capture run the step on the real inputs. An engine step is idempotent (it writes the
    KV rows its inputs determine, then reads), so running it again changes nothing.
The KV buffers must stay where they are: ``bind_kv`` drops every captured graph.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from xcompile.runtime.engines.base import Engine

Outputs = dict[str, torch.Tensor]
T = TypeVar("T")
# (step, device) -> (replay, what the step returned inside the capture)
Capture = Callable[[Callable[[], T], torch.device], tuple[Callable[[], None], T]]


class GraphUnavailable(Exception):
    """This device cannot capture graphs (the engine runs eagerly instead)."""


class CudaGraphCapture:
    """Capture with ``torch.cuda.CUDAGraph``: a whole torch-backend step for ``GraphedEngine``, one
    engine launch for the trt backend. The graphs of one instance share a memory pool (safe: their
    outputs stay referenced, and replays run one after another on one stream).

    Rules (torch.cuda.graphs, trtexec, Torch-TensorRT): shapes and addresses fixed first, the step run
    uncaptured before its capture so lazy initialisation stays out of the graph, capture on a side
    stream ordered after the current one.
    """

    def __init__(self, warmup: int = 2, error_mode: str = "global"):
        # warmup: eager runs on the side stream right before capture. The trt backend passes 0: the
        # first launch of each shape already ran uncaptured, as a real step.
        # error_mode: torch.cuda.graph's capture_error_mode. The trt backend passes "thread_local": only
        # this thread's CUDA calls are checked, so a call another thread makes meanwhile (TensorRT's or
        # the application's) does not invalidate the capture.
        self.warmup, self.error_mode = warmup, error_mode
        self.pool = None

    def new_pool(self) -> None:
        """Record later graphs into a new memory pool: call it when dropping graphs. Once every graph of
        a pool is destroyed, torch no longer counts the pool as in use, and capturing into its handle
        again fails an allocator assert (``use_count > 0``, CUDACachingAllocator.cpp; seen on the H200)."""
        self.pool = None

    def recording_only(self) -> CudaGraphCapture:
        """This capture without warm-up runs (same pool and error mode), for steps that must run once
        only, such as a whole speculative round (runtime/decoding/generator.py)."""
        if not self.warmup:
            return self
        capture = CudaGraphCapture(warmup=0, error_mode=self.error_mode)
        capture.pool = self.pool
        return capture

    def __call__(self, step: Callable[[], T], device: torch.device) -> tuple[Callable[[], None], T]:
        """Warm up, then record one call of ``step``: (replay, what that call returned). Raises
        GraphUnavailable off CUDA, RuntimeError when the step cannot be captured."""
        if device.type != "cuda" or not torch.cuda.is_available():
            raise GraphUnavailable(f"CUDA graphs need a CUDA device, the engine is on {device}")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode=self.error_mode):
                out = step()
        finally:
            current.wait_stream(side)
        return graph.replay, out


class _Graph:
    def __init__(self, static: Outputs, replay: Callable[[], None], outputs: Outputs):
        self.static, self.replay, self.outputs = static, replay, outputs

    def __call__(self, inputs: Outputs) -> Outputs:
        for name, t in inputs.items():
            self.static[name].copy_(t)
        self.replay()
        return dict(self.outputs)


class GraphedEngine(Engine):
    """``engine`` with its fixed-shape steps replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, engine: Engine, tokens: Iterable[int], capture: Capture | None = None):
        """tokens: the token counts (the contract's dynamic axis) of the steps to capture."""
        super().__init__(engine.spec, engine.kv_shape, engine.dtype, engine.device)
        self.engine, self.kv, self.kv_dtype = engine, engine.kv, engine.kv_dtype
        self.short_rows, self.step_rows = engine.short_rows, engine.step_rows
        self.tokens = frozenset(tokens)
        self.capture = capture or CudaGraphCapture()
        self.fallback: str | None = None
        if not engine.graph_capturable:
            self.fallback = f"{type(engine).__name__} steps cannot be recorded into a CUDA graph (graph_capturable)"
        self.graphs: dict[tuple, _Graph] = {}
        # the first input with a "tokens" axis says how many tokens a call carries
        self._count_from = next((t.name, t.shape.index("tokens")) for t in engine.spec.inputs if "tokens" in t.shape)

    def bind_kv(self, buffers) -> None:
        self.engine.bind_kv(buffers)
        self.kv = self.engine.kv
        self.forget()

    def forget(self) -> None:
        """Drop every graph (they captured the KV buffers' addresses: after the engine's KV was re-bound)."""
        self.graphs.clear()
        if isinstance(self.capture, CudaGraphCapture):
            self.capture.new_pool()

    @torch.inference_mode()
    def run(self, **inputs: torch.Tensor) -> Outputs:
        if self.fallback is None:
            key = tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(inputs.items()))
            graph = self.graphs.get(key)
            name, axis = self._count_from
            if graph is None and inputs[name].shape[axis] in self.tokens:
                graph = self._capture(key, inputs)
            if graph is not None:
                return graph(inputs)
        return self.engine.run(**inputs)

    def replay_of(self, **inputs: torch.Tensor) -> Callable[[], None] | None:
        """The bare replay of the graph serving ``inputs`` (recorded if need be, the inputs copied into its
        static buffers once), as a step runs inside a recorded round; None when this engine runs eagerly."""
        self.run(**inputs)
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(inputs.items()))
        graph = self.graphs.get(key) if self.fallback is None else None
        return graph.replay if graph is not None else None

    def _capture(self, key: tuple, inputs: Outputs) -> _Graph | None:
        static = {name: t.clone() for name, t in inputs.items()}
        try:
            replay, outputs = self.capture(lambda: self.engine.run(**static), self.device)
        except (GraphUnavailable, RuntimeError) as e:
            self.fallback = f"{type(e).__name__}: {e}"
            warnings.warn(f"{self.spec.graph}: CUDA graph capture unavailable, running eagerly ({self.fallback})",
                          stacklevel=3)
            return None
        self.graphs[key] = _Graph(static, replay, outputs)
        return self.graphs[key]

    def close(self) -> None:
        self.graphs.clear()
        self.engine.close()
        super().close()
