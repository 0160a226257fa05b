"""CUDA graphs for the fixed-shape steps of any Engine whose ``run`` is capturable (the torch backend).

``GraphedEngine`` wraps an engine and is one itself. On the first call whose token count is one of
its fixed-shape steps it clones the inputs into static buffers, warms up, captures one graph for
that input signature (names, shapes, dtypes); later calls copy their inputs into the static buffers
and replay. Other shapes (prompt passes) run eagerly, and so does every call once capture turns out
to be unavailable (no CUDA device) or fails; ``fallback`` then says why.

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

import torch

from xcompile.runtime.engine import Engine

Outputs = dict[str, torch.Tensor]
# (step, device) -> (replay, the step's outputs as produced inside the capture)
Capture = Callable[[Callable[[], Outputs], torch.device], tuple[Callable[[], None], Outputs]]


class GraphUnavailable(Exception):
    """This device cannot capture graphs (the engine runs eagerly instead)."""


class CudaGraphCapture:
    """Capture with ``torch.cuda.CUDAGraph``; the graphs of one instance share a memory pool (safe:
    their outputs stay referenced, and replays run one after another on one stream)."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup        # eager runs on a side stream first, so lazy initialisation stays out of the graph
        self.pool = None

    def __call__(self, step: Callable[[], Outputs], device: torch.device) -> tuple[Callable[[], None], Outputs]:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise GraphUnavailable(f"CUDA graphs need a CUDA device, the engine is on {device}")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
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
    def __init__(self, engine: Engine, tokens: Iterable[int], capture: Capture | None = None):
        """tokens: the token counts (the contract's dynamic axis) of the steps to capture."""
        super().__init__(engine.spec, engine.kv_shape, engine.dtype, engine.device)
        self.engine, self.kv = engine, engine.kv
        self.tokens = frozenset(tokens)
        self.capture = capture or CudaGraphCapture()
        self.fallback: str | None = None
        self.graphs: dict[tuple, _Graph] = {}
        # the first input with a "tokens" axis says how many tokens a call carries
        self._count_from = next((t.name, t.shape.index("tokens")) for t in engine.spec.inputs if "tokens" in t.shape)

    def bind_kv(self, buffers) -> None:
        self.engine.bind_kv(buffers)
        self.kv = self.engine.kv
        self.graphs.clear()                 # they captured the old buffers' addresses

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
