"""The ``ort`` backend: an exported ONNX graph run by ONNX Runtime through IOBinding.

Every tensor is bound by address to a torch buffer: inputs are the caller's tensors, outputs are
views of buffers preallocated for ``max_tokens`` new tokens / ``max_rows`` logit rows, and each
``present_*`` output is bound to the very buffer of its ``past_*`` input, so ORT's TensorScatter
updates the cache in place (it copies past -> present only when they differ).

Providers: cpu (``onnxruntime``) and cuda (``onnxruntime-gpu``; ORT runs on torch's current
stream via ``user_compute_stream``). Precision limits of ORT's CPU provider (1.32): fp32 runs
(1e-5 from the torch reference); fp16 runs (~1e-2 on tiny-model logits); bf16 does not: there is
no bf16 MatMul kernel, so session creation fails with NOT_IMPLEMENTED (this backend refuses it
up front); a bf16 graph needs the cuda provider (onnxruntime-gpu ships bf16 MatMul, Attention,
RotaryEmbedding and TensorScatter kernels; not run here) or TensorRT.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from xcompile.runtime.contract import MODEL_DTYPE, GraphSpec
from xcompile.runtime.engine import MODEL_TORCH_DTYPES, TORCH_DTYPES, Engine, KVShape
from xcompile.runtime.errors import EngineError
from xcompile.runtime.manifest import Manifest

# IOBinding element types; bf16 has no numpy dtype, ORT takes the ONNX enum (TensorProto.BFLOAT16)
_ELEMENT_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: 16,
                  torch.int64: np.int64, torch.bool: np.bool_}


class OrtEngine(Engine):
    """One ONNX graph of the contract on ONNX Runtime.

    ``kv`` is the graph's cache geometry and ``dims`` its fixed symbolic sizes (the manifest's
    ``Manifest.kv_shape`` and ``dims``). ``run`` returns views of preallocated output buffers,
    overwritten by the next run: copy what you keep.
    """

    def __init__(self, onnx_path: Path, spec: GraphSpec, kv: KVShape | None, dims: dict, dtype: torch.dtype,
                 device: torch.device | str = "cpu", *, max_tokens: int | None = None, max_rows: int = 64,
                 session_options=None):
        device = torch.device(device)
        super().__init__(spec, kv, dtype, device)
        if device.type == "cpu" and dtype == torch.bfloat16:
            raise EngineError(f"{onnx_path}: ONNX Runtime's CPU provider has no bfloat16 MatMul kernel; run a bf16 "
                              "graph with device='cuda' (onnxruntime-gpu) or TensorRT, or export --dtype fp32/fp16")
        self.path, self.dims = Path(onnx_path), dict(dims)
        if max_tokens is None and "max_seq_len" not in dims:
            raise EngineError(f"{onnx_path}: a graph without a KV cache needs max_tokens")
        self.max_tokens = max_tokens or dims["max_seq_len"]
        self.max_rows = min(max_rows, self.max_tokens)
        self.session = _session(self.path, device, session_options)
        self._check_session()
        self._inputs, self._outputs = spec.step_inputs, spec.step_outputs
        # one flat buffer per output, sized for max_tokens / max_rows; runs bind a contiguous prefix
        self._buffers = {t.name: torch.empty(math.prod(self._size(d, self.max_tokens, self.max_rows) for d in t.shape),
                                             dtype=self._dtype(t.dtype), device=device) for t in self._outputs}
        self._binding = self.session.io_binding()
        self._device_type = "cuda" if device.type == "cuda" else "cpu"
        self._device_id = device.index or 0

    def _dtype(self, name: str) -> torch.dtype:
        return self.dtype if name == MODEL_DTYPE else TORCH_DTYPES[name]

    def _size(self, dim: str, tokens: int, rows: int) -> int:
        if dim == "tokens":
            return tokens
        if dim == "rows":
            return rows
        return self.dims[dim]

    def _check_session(self) -> None:
        got = [i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()]
        if got != (self.spec.input_names, self.spec.output_names):
            raise EngineError(f"{self.path}: graph I/O {got} does not match the contract's "
                              f"{(self.spec.input_names, self.spec.output_names)}; re-export the engine dir")

    def _bind(self, bind, name: str, t: torch.Tensor) -> None:
        bind(name, self._device_type, self._device_id, _ELEMENT_TYPES[t.dtype], tuple(t.shape), t.data_ptr())

    def bind_kv(self, buffers) -> None:
        super().bind_kv(buffers)
        names = self.spec.input_names[len(self._inputs):]
        for i, buf in enumerate(self.kv):
            # past and present on one buffer: TensorScatter writes the new rows in place
            self._bind(self._binding.bind_input, names[i], buf)
            self._bind(self._binding.bind_output, self.spec.outputs[len(self._outputs) + i].name, buf)

    def run(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.kv_shape and not self.kv:
            raise EngineError(f"{self.spec.graph}: bind KV buffers (bind_kv/new_kv) before run")
        names = {t.name for t in self._inputs}
        if set(inputs) != names:
            raise EngineError(f"{self.spec.graph}: expected inputs {sorted(names)}, got {sorted(inputs)}")
        for t in self._inputs:
            x = inputs[t.name]
            if x.dtype != self._dtype(t.dtype) or x.device != self.device:
                raise EngineError(f"{self.spec.graph}: input {t.name} is {x.dtype} on {x.device}, expected "
                                  f"{self._dtype(t.dtype)} on {self.device}")
            # IOBinding reads raw memory: expanded/strided views are bound as dense copies, kept alive
            # in ``inputs`` until the run returns
            inputs[t.name] = x = x.contiguous()
            self._bind(self._binding.bind_input, t.name, x)
        tokens, rows = self._tokens_rows(inputs)
        if tokens > self.max_tokens or rows > self.max_rows:
            raise EngineError(f"{self.spec.graph}: {tokens} tokens / {rows} rows exceed the engine's preallocated "
                              f"max_tokens={self.max_tokens} / max_rows={self.max_rows}")
        outputs = {}
        for t in self._outputs:
            shape = tuple(self._size(d, tokens, rows) for d in t.shape)
            out = self._buffers[t.name][: math.prod(shape)].view(shape)
            self._bind(self._binding.bind_output, t.name, out)
            outputs[t.name] = out
        try:
            self.session.run_with_iobinding(self._binding)
        except Exception as e:   # ORT raises its own pybind exception types; one line with the cause kept
            raise EngineError(f"{self.path.name}: ONNX Runtime failed: {str(e).splitlines()[0]}") from e
        return outputs

    def _tokens_rows(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int]:
        tokens = rows = 0
        for t in self._inputs:
            if "tokens" in t.shape:
                tokens = inputs[t.name].shape[t.shape.index("tokens")]
            if "rows" in t.shape:
                rows = inputs[t.name].shape[t.shape.index("rows")]
        return tokens, rows

    def close(self) -> None:
        super().close()
        self._binding.clear_binding_inputs()
        self._binding.clear_binding_outputs()
        self.session = None


def _session(path: Path, device: torch.device, options):
    import onnxruntime as ort

    if not path.is_file():
        raise EngineError(f"{path}: ONNX graph not found; export it with `xcompile export`")
    if options is None:
        options = ort.SessionOptions()
        options.log_severity_level = 3          # errors only: ORT warns about every unfoldable CastLike
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise EngineError("ONNX Runtime has no CUDA provider here; install onnxruntime-gpu (not next to "
                              "onnxruntime) or run on cpu")
        stream = torch.cuda.current_stream(device).cuda_stream
        providers = [("CUDAExecutionProvider", {"device_id": device.index or 0, "user_compute_stream": str(stream)}),
                     "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as e:   # ORT raises its own pybind exception types
        raise EngineError(f"{path}: ONNX Runtime cannot load it: {str(e).splitlines()[0]}") from e


def load(directory: Path, graph: str, device: torch.device | str = "cpu", *, manifest: Manifest | None = None,
         verify: bool = False, **options) -> OrtEngine:
    """The ONNX graph ``graph`` of an engine dir on ONNX Runtime, checked against manifest and contract.

    ``manifest``: the dir's, when the caller has read it already; ``verify``: hash every byte of the
    graph's files, not only sampled blocks; ``options`` go to OrtEngine (``max_tokens`` defaults to
    the dir's max_seq_len)."""
    directory = Path(directory)
    manifest = manifest if manifest is not None else Manifest.load(directory)
    if graph not in manifest.graphs:
        raise EngineError(f"{directory}: no {graph!r} graph in the manifest (has {sorted(manifest.graphs)})")
    entry = manifest.graphs[graph]
    manifest.verify(directory, manifest.graph_files(graph), full=verify)
    options.setdefault("max_tokens", manifest.max_seq_len)
    return OrtEngine(directory / entry.onnx, manifest.graph_spec(graph), manifest.kv_shape(graph), entry.dims,
                     MODEL_TORCH_DTYPES[manifest.dtype], device, **options)
