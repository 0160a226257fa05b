"""``xcompile diff``'s graphs and runners: the dir's engines beside their PyTorch references (``graphs``), a
Polygraphy runner over either (``EngineRunner``), and the recorder that runs a reference over teacher-forced
feeds built from its own outputs (``Recorder``, ``step_feed``). compile/diff.py drives them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from xcompile.compile.reference import reference_engines
from xcompile.runtime.enginedir.contract import DYNAMIC_DIMS, MODEL_DTYPE, GraphSpec, KVShape
from xcompile.runtime.enginedir.manifest import Manifest
from xcompile.runtime.engines.base import TORCH_DTYPES, Engine
from xcompile.runtime.engines.torch_module import TorchEngine


class EngineRunner(BaseRunner):
    """A Polygraphy runner over any xcompile Engine (torch reference, ORT, TensorRT): fresh zeroed
    KV buffers at activation, then the cache carries across iterations like in a generation."""

    def __init__(self, make: Callable[[], Engine], spec: GraphSpec, dims: dict, name: str):
        super().__init__(name=name, prefix="xcompile")
        self.make, self.spec, self.dims = make, spec, dims
        self.engine: Engine | None = None

    def activate_impl(self):
        self.engine = self.make()
        self.engine.new_kv()

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for t in self.spec.step_inputs:
            dtype = self.engine.dtype if t.dtype == MODEL_DTYPE else TORCH_DTYPES[t.dtype]
            meta.add(t.name, dtype=dtype, shape=[None if d in DYNAMIC_DIMS else self.dims[d] for d in t.shape])
        return meta

    def infer_impl(self, feed_dict):
        inputs = {n: torch.as_tensor(v).to(self.engine.device) for n, v in feed_dict.items()}
        start = time.perf_counter()
        # outputs may be views of buffers the next step overwrites: keep host copies
        out = OrderedDict((n, t.detach().to("cpu", copy=True)) for n, t in self.engine.run(**inputs).items())
        self.inference_time = time.perf_counter() - start
        return out

    def deactivate_impl(self):
        self.engine.close()
        self.engine = None


# --------------------------------------------------------------------------------------------
# the dir's graphs: reference modules rebuilt from the manifest's sources, engines from the backend


@dataclass
class Graph:
    spec: GraphSpec
    dims: dict
    kv: KVShape | None
    module: torch.nn.Module                     # the PyTorch reference
    engine: Engine                              # the backend's, loaded once

    def reference(self) -> Engine:
        return TorchEngine(self.module, self.spec, self.kv, self.engine.dtype, self.engine.device)


def load_engine(backend: str, directory: Path, manifest: Manifest, graph: str, device: str) -> Engine:
    if backend == "ort":
        from xcompile.runtime.engines import ort

        return ort.load(directory, graph, device, manifest=manifest)
    from xcompile.runtime.engines import trt

    return trt.load(directory, graph, device, manifest=manifest)


def load_graphs(directory: Path, manifest: Manifest, backend: str, device: str) -> dict[str, Graph]:
    """Engines load first, so a graph the backend cannot run fails before the reference is built."""
    engines = {name: load_engine(backend, directory, manifest, name, device) for name in manifest.graphs}
    references = reference_engines(manifest, device)
    return {name: Graph(manifest.graph_spec(name), entry.dims, manifest.kv_shape(name), references[name].module,
                         engines[name]) for name, entry in manifest.graphs.items()}


# --------------------------------------------------------------------------------------------
# teacher-forced feeds


def step_feed(ids: torch.Tensor, start: int, rows: list[int], hidden: torch.Tensor | None = None) -> dict:
    """Contract step inputs for ``ids`` [B, S] written at ``start`` with a causal mask (+ the
    EAGLE3 ``hidden_states`` [B, S, H] when given)."""
    b, s = ids.shape
    feed = {"input_ids": ids} | ({"hidden_states": hidden} if hidden is not None else {})
    return feed | {"position_ids": (start + torch.arange(s)).expand(b, s).contiguous(),
                   "write_index": torch.full((b,), start, dtype=torch.int64),
                   "tree_mask": torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s).contiguous(),
                   "logit_rows": torch.tensor([rows] * b, dtype=torch.int64)}


class Recorder:
    """Runs a graph's reference over feeds built from its own outputs, recording each step's label,
    feed and outputs, and (for --save) the KV cache before it."""

    def __init__(self, graph: Graph, keep_kv: bool):
        self.engine, self.spec, self.keep_kv = graph.reference(), graph.spec, keep_kv
        self.engine.new_kv()
        self.labels, self.feeds, self.kv = [], [], []

    @torch.inference_mode()
    def __call__(self, label: str, feed: dict) -> dict:
        if self.keep_kv:
            self.kv.append([b.cpu().clone() for b in self.engine.kv])
        out = self.engine.run(**{k: v.to(self.engine.device) for k, v in feed.items()})
        self.labels.append(label)
        self.feeds.append({k: v.cpu() for k, v in feed.items()})
        return {n: t.cpu().clone() for n, t in out.items()}

    def full_feeds(self) -> list[dict]:
        """Feeds plus the KV inputs of the graph: what a stateless ``polygraphy run`` needs."""
        names = self.spec.input_names[len(self.spec.step_inputs):]
        return [f | dict(zip(names, kv)) for f, kv in zip(self.feeds, self.kv or [[]] * len(self.feeds))]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[B, R, V] -> the last row's argmax as [B, 1] int64."""
    return logits[:, -1].float().argmax(-1, keepdim=True).to(torch.int64)
