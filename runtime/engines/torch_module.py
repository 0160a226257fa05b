"""The ``torch`` backend: runs a reference module that follows the I/O contract's call signature.

The runtime never imports the model code (it lives on the compile side); a module is handed in,
or found through the ``xcompile.torch_models`` entry point when loading an engine dir.
"""

from __future__ import annotations

import torch

from xcompile.runtime.enginedir.contract import GraphSpec, KVShape
from xcompile.runtime.engines.base import KV_FP8, Engine


class TorchEngine(Engine):
    """A reference module behind the Engine interface; its steps are plain torch ops, so CUDA graphs can
    record them (``GraphedEngine``)."""

    graph_capturable = True
    partial_batch = True        # a step of B sequences runs on rows 0..B-1 of each KV buffer
    # an FP8 (e4m3) cache: the reference modules write its codes and read them back in the compute dtype
    kv_dtypes = (KV_FP8,)

    def __init__(self, module: torch.nn.Module, spec: GraphSpec, kv: KVShape | None, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(spec, kv, dtype, torch.device(device))
        self.module = module
        self._inputs = [t.name for t in spec.step_inputs]
        self._outputs = [t.name for t in spec.step_outputs]

    @torch.inference_mode()
    def run(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        kv, batch = self.kv, inputs[self._inputs[0]].shape[0]
        if kv and batch < kv[0].shape[0]:
            kv = [t[:batch] for t in kv]            # views: the module writes into the first rows in place
        out = self.module(*(inputs[n] for n in self._inputs), *kv)
        out = out if isinstance(out, tuple) else (out,)
        # KV outputs are the bound buffers themselves (written in place by layers.write_kv)
        return dict(zip(self._outputs, out[: len(self._outputs)]))
