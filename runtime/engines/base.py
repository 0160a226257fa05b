"""One engine interface over every backend (torch, ort, trt).

Lifecycle: construct (load/deserialize) -> ``bind_kv(buffers)`` once -> ``run(**inputs)`` per step
-> ``close()``; ``with engine: ...`` closes it on the way out. KV buffers are preallocated by the caller (``new_kv``) and updated in place by every
run; only the non-KV inputs of the graph's contract are passed to ``run``, and ``run`` returns the
non-KV outputs by name. Backends differ only in how they execute the graph.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import DTYPES, GraphSpec, KVShape
from xcompile.runtime.engines.qweight import E4M3_MAX

# contract dtype name -> torch dtype, and back: the one map every backend and the exporter use
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int64": torch.int64, "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# manifest dtype ("fp32", "fp16", "bf16") -> torch dtype of an engine's floating tensors
MODEL_TORCH_DTYPES = {name: TORCH_DTYPES[contract_name] for name, contract_name in DTYPES.items()}
KV_FP8 = torch.float8_e4m3fn    # an FP8 KV cache's dtype (Engine.set_kv_dtype)


def fp8_codes(x: torch.Tensor) -> torch.Tensor:
    """x's e4m3 codes as bytes, unscaled (vLLM's FP8 cache without calibrated scales), values past +-448
    saturated: what an FP8 KV cache holds. Bytes, because torch has no float8 scatter or index_put."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8).view(torch.uint8)


def new_kv(kv: KVShape, dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Zeroed buffers in contract order: key_0, value_0, key_1, ...; consecutive slices of one
    [2 * layers, *kv.shape] tensor, so that work over every buffer (speculative.compact_kv) can be one
    launch instead of one per buffer."""
    return list(torch.zeros(2 * kv.layers, *kv.shape, dtype=dtype, device=device).unbind(0))


def normalize_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so devices compare equal to those of the tensors they hold."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# Prompts of up to this many short steps run as short steps (Engine.short_rows), whose every size the warm-up
# compiled, not as one pass on the long route, whose kernels are picked per size: through xrun serve of the 8B
# shape on an H100, prompts of 16-79 tokens one at a time took a median 40.7 ms to the first token and the
# slowest, 72 tokens, 144 ms; the 15 lengths past 64 were the ones on the long route (2026-12-05).
SHORT_STEPS = 2


class Engine(ABC):
    """A compiled graph (or the reference module) that runs one step of the I/O contract."""

    # Whether ``run`` may be recorded into an outer CUDA graph (runtime/engines/graphs.py GraphedEngine): device
    # work only, no host sync, fixed addresses. The torch backend's steps are; a TensorRT engine replays
    # graphs of its own launches (recording it again would capture a capture), and an ONNX Runtime run is
    # host code that may allocate or synchronise. A backend whose steps are capturable sets it True.
    graph_capturable = False
    # Whether the rows of one step may hold different sequences (each its own write_index and positions, the
    # continuous-batching loop, runtime/decoding/batch.py).
    batched = True
    # Whether a step may carry fewer sequences than the KV buffers have slots (rows 0..B-1 of each): the batch
    # loop's lone sequence runs the batch-1 loop in slot 0 (runtime/decoding/solo.py). ORT and TensorRT graphs
    # fix the batch.
    partial_batch = False
    # The most rows a step takes on the engine's short-step route, whose every size the warm-up compiles (the
    # fast kernels' MAX_ROWS); None: one route for any size. A prompt of up to SHORT_STEPS of them runs in such
    # steps (drafters.prompt_pass).
    short_rows: int | None = None
    # The most rows (B sequences x S tokens) a batch step runs on the engine's own capturable kernels: the batch
    # loop pads prompt-carrying steps up to a few token counts within it and replays them from CUDA graphs
    # (runtime/decoding/batch.py). None: only its fixed steps (one token a row, a verify's chain) are recorded.
    step_rows: int | None = None

    # KV dtypes besides the compute dtype that the engine's steps write and read (set_kv_dtype)
    kv_dtypes: tuple[torch.dtype, ...] = ()

    def __init__(self, spec: GraphSpec, kv: KVShape | None, dtype: torch.dtype, device: torch.device):
        self.spec, self.kv_shape, self.dtype, self.device = spec, kv, dtype, normalize_device(device)
        self.kv_dtype = dtype
        self.kv: list[torch.Tensor] = []

    def set_kv_dtype(self, dtype: torch.dtype) -> None:
        """Hold the KV cache in ``dtype`` (the compute dtype, or one of ``kv_dtypes``: an FP8 cache), before any KV
        is bound."""
        if dtype != self.dtype and dtype not in self.kv_dtypes:
            raise EngineError(f"{self.spec.graph}: this {type(self).__name__} holds its KV cache in {self.dtype} "
                              f"only, not {dtype}")
        if self.kv:
            raise EngineError(f"{self.spec.graph}: the KV dtype is set before KV buffers are bound")
        self.kv_dtype = dtype

    def bind_kv(self, buffers: Sequence[torch.Tensor]) -> None:
        """Bind preallocated KV buffers; every later run reads and updates them in place."""
        want = 2 * (self.kv_shape.layers if self.kv_shape else 0)
        if len(buffers) != want:
            raise EngineError(f"{self.spec.graph}: expected {want} KV buffers, got {len(buffers)}")
        for b in buffers:
            if tuple(b.shape) != self.kv_shape.shape or b.dtype != self.kv_dtype or b.device != self.device:
                raise EngineError(f"{self.spec.graph}: KV buffer {tuple(b.shape)} {b.dtype} on {b.device} does not "
                                  f"match {self.kv_shape.shape} {self.kv_dtype} on {self.device}")
        self.kv = list(buffers)

    def narrow_batch(self, batch: int) -> None:
        """Hold KV for ``batch`` sequences instead of the graph's slots (a partial_batch engine, none bound yet): a
        batch dir's draft model serves only the lone sequence in the first slot (runtime/decoding/solo.py; EAGLE3
        and MTP heads draft for every slot, batch_drafts.py)."""
        if not self.partial_batch or self.kv or self.kv_shape is None:
            raise EngineError(f"{self.spec.graph}: cannot narrow the KV of this engine to {batch} sequences")
        self.kv_shape = dataclasses.replace(self.kv_shape, batch=batch)

    def new_kv(self) -> list[torch.Tensor]:
        """Allocate and bind fresh zeroed KV buffers for this engine."""
        buffers = new_kv(self.kv_shape, self.kv_dtype, self.device) if self.kv_shape else []
        self.bind_kv(buffers)
        return buffers

    @abstractmethod
    def run(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Run one step; inputs/outputs are the contract's non-KV tensors, by name, on ``self.device``."""

    def weight_bytes(self) -> int | None:
        """Bytes of weights one decoded token reads, where the engine knows them (the fast engines), else None."""
        return None

    def close(self) -> None:
        self.kv = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
