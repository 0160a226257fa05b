"""The ``ort`` backend: an exported ONNX graph run by ONNX Runtime through IOBinding.

Every tensor is bound by address to a torch buffer: inputs are the caller's tensors, outputs are
views of buffers preallocated for ``max_tokens`` new tokens / ``max_rows`` logit rows, and each
``present_*`` output is bound to the very buffer of its ``past_*`` input, so ORT's TensorScatter
updates the cache in place (it copies past -> present only when they differ).

Providers: cpu (``onnxruntime``) and cuda (``onnxruntime-gpu``, the ``gpu`` extra; ORT runs on a
torch stream of the engine's own, its ``user_compute_stream``, which waits for the caller's stream
before each run and the caller's for it after, so ORT's own per-run host sync is skipped). Its CUDA 13 / cuDNN 9 libraries are the ones the
torch wheels installed under ``site-packages/nvidia/*/lib``: they are loaded (``preload_cuda_libraries``)
before the first CUDA session, so no LD_LIBRARY_PATH is needed. ``cuda_graphs`` turns on ORT's own CUDA
graphs (provider option ``enable_cuda_graph``): every step of up to ``GRAPH_MAX_TOKENS`` tokens gets a
graph per (tokens, rows, mask_keys) shape (run option ``gpu_graph_id``), replayed on later calls of that shape;
inputs are then copied into static buffers so each replay reads the addresses it was captured with.
Longer steps (prompt passes) run without a graph (``gpu_graph_id`` -1).

Precision limits of ORT's CPU provider (1.32): fp32 runs (1e-5 from the torch reference); fp16 runs
(~1e-2 on tiny-model logits); bf16 does not: there is no bf16 MatMul kernel, so session creation
fails with NOT_IMPLEMENTED (this backend refuses it up front); a bf16 graph needs the cuda provider
(onnxruntime-gpu ships bf16 MatMul, Attention, RotaryEmbedding and TensorScatter kernels) or TensorRT.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
from functools import cache
from pathlib import Path

import numpy as np
import torch

from xcompile.runtime.common import logs
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import DYNAMIC_DIMS, MODEL_DTYPE, GraphSpec, KVShape
from xcompile.runtime.enginedir.manifest import Manifest
from xcompile.runtime.engines.base import MODEL_TORCH_DTYPES, TORCH_DTYPES, Engine

# IOBinding element types; bf16 has no numpy dtype, ORT takes the ONNX enum (TensorProto.BFLOAT16)
_ELEMENT_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: 16,
                  torch.int64: np.int64, torch.bool: np.bool_}

# Steps of up to this many tokens get an ORT CUDA graph (decode, chain/tree verify, draft steps: the
# drafters' blocks stay well below it); longer ones are prompt passes of arbitrary length, run eagerly.
GRAPH_MAX_TOKENS = 64
_NO_GRAPH = "-1"        # ORT's gpu_graph_id that skips capture and replay for one run
# what ORT's CUDA provider links (CUDA 13 runtime, cuBLAS(Lt), cuFFT, cuRAND, cuDNN 9), in load order
# (cuDNN's sub-libraries are dlopened by libcudnn itself, from its own folder)
_CUDA_LIBRARIES = ("libcudart.so*", "libnvJitLink.so*", "libcublasLt.so*", "libcublas.so*", "libcufft.so*",
                   "libcurand.so*", "libcudnn.so*")


class OrtEngine(Engine):
    """One ONNX graph of the contract on ONNX Runtime.

    ``kv`` is the graph's cache geometry and ``dims`` its fixed symbolic sizes (the manifest's
    ``Manifest.kv_shape`` and ``dims``). ``run`` returns views of preallocated output buffers,
    overwritten by the next run: copy what you keep.
    """

    def __init__(self, onnx_path: Path, spec: GraphSpec, kv: KVShape | None, dims: dict, dtype: torch.dtype,
                 device: torch.device | str = "cpu", *, max_tokens: int | None = None, max_rows: int = 64,
                 session_options=None, cuda_graphs: bool = False):
        device = torch.device(device)
        super().__init__(spec, kv, dtype, device)
        if device.type == "cpu" and dtype == torch.bfloat16:
            raise EngineError(f"{onnx_path}: ONNX Runtime's CPU provider has no bfloat16 MatMul kernel; run a bf16 "
                              "graph with device='cuda' (onnxruntime-gpu) or TensorRT, or export --dtype fp32/fp16")
        if cuda_graphs and device.type != "cuda":
            raise EngineError(f"{onnx_path}: ONNX Runtime's CUDA graphs need device='cuda'")
        self.path, self.dims = Path(onnx_path), dict(dims)
        if max_tokens is None and "max_seq_len" not in dims:
            raise EngineError(f"{onnx_path}: a graph without a KV cache needs max_tokens")
        self.max_tokens = max_tokens or dims["max_seq_len"]
        self.max_rows = min(max_rows, self.max_tokens)
        self.graph_fallback: str | None = None     # why ORT's CUDA graphs are off although asked for
        # ORT's kernels run on a stream of this engine's, ordered after the caller's stream before each run
        # and the caller's after it (``run``): no host sync, whatever stream the caller uses. (Handing ORT
        # torch's current stream instead fails for the legacy default stream, handle 0, which ORT does not
        # take as a user stream: its kernels then ran unordered, and outputs were read before ORT wrote
        # them, seen on the H200 at the Qwen3-8B shape, 2026-12-01.)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        handle = self._stream.cuda_stream if self._stream is not None else 0
        try:
            self.session = _session(self.path, device, session_options, cuda_graphs, handle)
        except EngineError as e:
            if not cuda_graphs:
                raise
            # e.g. nodes ORT places on the CPU: a session with graphs refuses them; run without
            self.graph_fallback, cuda_graphs = str(e), False
            self.session = _session(self.path, device, session_options, False, handle)
        self._session_graphs = cuda_graphs          # the session was made with enable_cuda_graph
        self._check_session()
        self._inputs, self._outputs = spec.step_inputs, spec.step_outputs
        # one flat buffer per output, sized for max_tokens / max_rows; runs bind a contiguous prefix
        self._buffers = {t.name: torch.empty(math.prod(self._size(d, self.max_tokens, self.max_rows) for d in t.shape),
                                             dtype=self._dtype(t.dtype), device=device) for t in self._outputs}
        self._binding = self.session.io_binding()
        self._device_type = "cuda" if device.type == "cuda" else "cpu"
        self._device_id = device.index or 0
        # ORT CUDA graphs: the session was made with enable_cuda_graph; ``cuda_graphs`` may be turned off later
        # (bench measures both) and a failed capture turns ``graphs_enabled`` off: then every run passes
        # gpu_graph_id -1 (a session with graphs captures id 0 when none is given). One RunOptions per
        # graph id, made once (ORT warns whenever a config entry is overwritten).
        self.graphs_enabled = self.cuda_graphs = cuda_graphs
        self._graph_ids: dict[tuple[int, int, int], str] = {}
        self._run_options: dict[str, object] = {}
        # inputs of graphed steps are copied here: a replay reads the addresses its capture saw
        tokens = min(GRAPH_MAX_TOKENS, self.max_tokens)
        self._static = {t.name: torch.empty(math.prod(self._size(d, tokens, min(tokens, self.max_rows))
                                                      for d in t.shape), dtype=self._dtype(t.dtype), device=device)
                        for t in self._inputs} if cuda_graphs else {}

    def _dtype(self, name: str) -> torch.dtype:
        return self.dtype if name == MODEL_DTYPE else TORCH_DTYPES[name]

    def _size(self, dim: str, tokens: int, rows: int) -> int:
        if dim in ("tokens", "mask_keys"):          # buffers: mask_keys is sized like tokens
            return tokens
        if dim == "rows":
            return rows
        return self.dims[dim]

    def _check_session(self) -> None:
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        got = [i.name for i in inputs], [o.name for o in outputs]
        if got != (self.spec.input_names, self.spec.output_names):
            raise EngineError(f"{self.path}: graph I/O {got} does not match the contract's "
                              f"{(self.spec.input_names, self.spec.output_names)}; re-export the engine dir")
        # the fixed dims the manifest records against the graph's own: a manifest edited and re-digested, or one
        # of another export, no longer describes the graph beside it
        for arg, t in zip((*inputs, *outputs), (*self.spec.inputs, *self.spec.outputs)):
            for axis, (dim, want) in enumerate(zip(arg.shape, t.shape)):
                if isinstance(dim, int) and want not in DYNAMIC_DIMS and want in self.dims and dim != self.dims[want]:
                    raise EngineError(f"{self.path}: {t.name} axis {axis} ('{want}') is {dim} in the graph, "
                                      f"{self.dims[want]} in the manifest; the manifest does not describe this graph: "
                                      "re-export the engine dir")

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
        tokens, rows, keys = self._dynamic(inputs)
        if tokens > self.max_tokens or rows > self.max_rows:
            raise EngineError(f"{self.spec.graph}: {tokens} tokens / {rows} rows exceed the engine's preallocated "
                              f"max_tokens={self.max_tokens} / max_rows={self.max_rows}")
        graph_id = self._graph_id(tokens, rows, keys)
        for t in self._inputs:
            x = inputs[t.name]
            if graph_id != _NO_GRAPH:
                x = self._static[t.name][: x.numel()].view(x.shape).copy_(x)
            else:
                # IOBinding reads raw memory: expanded/strided views are bound as dense copies, kept alive
                # in ``inputs`` until the run returns
                inputs[t.name] = x = x.contiguous()
            self._bind(self._binding.bind_input, t.name, x)
        if graph_id not in self._run_options:
            self._run_options[graph_id] = _run_options(graph_id if self._session_graphs else None,
                                                       ordered=self._stream is not None)
        outputs = {}
        for t in self._outputs:
            shape = tuple(self._size(d, tokens, rows) for d in t.shape)
            out = self._buffers[t.name][: math.prod(shape)].view(shape)
            self._bind(self._binding.bind_output, t.name, out)
            outputs[t.name] = out
        caller = torch.cuda.current_stream(self.device) if self._stream is not None else None
        if caller is not None:
            self._stream.wait_stream(caller)          # ORT reads what the caller's stream wrote
        try:
            self.session.run_with_iobinding(self._binding, self._run_options[graph_id])
        except Exception as e:   # ORT raises its own pybind exception types; one line with the cause kept
            if graph_id == _NO_GRAPH:
                raise EngineError(f"{self.path.name}: ONNX Runtime failed: {str(e).splitlines()[0]}") from e
            # a capture that fails turns the graphs off; the step is idempotent, so it simply runs again
            self.graph_fallback, self.graphs_enabled = f"capture failed: {str(e).splitlines()[0]}", False
            return self.run(**inputs)
        finally:
            if caller is not None:
                caller.wait_stream(self._stream)      # the caller reads what ORT's stream wrote
        return outputs

    def _graph_id(self, tokens: int, rows: int, keys: int) -> str:
        """ORT's gpu_graph_id for a step of this shape: one graph per (tokens, rows, mask_keys), none for
        long steps (the static input buffers hold GRAPH_MAX_TOKENS of each)."""
        if not (self.graphs_enabled and self.cuda_graphs) or max(tokens, rows, keys) > GRAPH_MAX_TOKENS:
            return _NO_GRAPH
        return self._graph_ids.setdefault((tokens, rows, keys), str(len(self._graph_ids)))

    def _dynamic(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        """This call's (tokens, rows, mask_keys); mask_keys is tokens where the graph has no such axis."""
        size = {}
        for t in self._inputs:
            for axis, dim in enumerate(t.shape):
                if dim in DYNAMIC_DIMS:
                    size[dim] = inputs[t.name].shape[axis]
        tokens = size.get("tokens", 0)
        return tokens, size.get("rows", 0), size.get("mask_keys", tokens)

    def close(self) -> None:
        super().close()
        self._binding.clear_binding_inputs()
        self._binding.clear_binding_outputs()
        self.session = None


def _session(path: Path, device: torch.device, options, cuda_graphs: bool = False, stream: int = 0):
    import onnxruntime as ort

    if not path.is_file():
        raise EngineError(f"{path}: ONNX graph not found; export it with `xcompile export`")
    # errors only unless -v (runtime/common/logs.py): ORT warns about every unfoldable CastLike and about
    # shape nodes it places on the CPU, a stream of lines per session. A session asked for CUDA graphs
    # logs an error when ORT refuses them (shape nodes on the CPU provider: seen with our graphs on the
    # H200, 2026-12-01); that refusal is ours to report (graph_fallback), so only fatal lines then.
    level = logs.library_levels().onnxruntime
    ort.set_default_logger_severity(4 if cuda_graphs else level)        # the environment's, before a session's
    if options is None:
        options = ort.SessionOptions()
        # the session's own logger prints the refusal too (inference_session.cc, H200 2026-12-01)
        options.log_severity_level = 4 if cuda_graphs else level
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise EngineError("ONNX Runtime has no CUDA provider here; install onnxruntime-gpu (pip install "
                              "'xcompile[gpu]', after pip uninstall onnxruntime) or run on cpu")
        preload_cuda_libraries()
        # use_tf32 0: fp32 graphs multiply in fp32, as the torch reference does (ORT's CUDA provider
        # defaults to TF32, 1e-2 off on the logits of the fp32 test models; bf16/fp16 graphs are unaffected)
        cuda = {"device_id": device.index or 0, "use_tf32": "0"}
        if stream:
            cuda["user_compute_stream"] = str(stream)
        if cuda_graphs:
            cuda["enable_cuda_graph"] = "1"
        providers = [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as e:   # ORT raises its own pybind exception types
        raise EngineError(f"{path}: ONNX Runtime cannot load it: {str(e).splitlines()[0]}") from e
    finally:
        ort.set_default_logger_severity(level)
    if device.type == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
        # ORT falls back to the CPU provider (with a log line we silence) when the CUDA one cannot start
        raise EngineError(f"{path}: ONNX Runtime could not start its CUDA provider (its CUDA 13 / cuDNN 9 "
                          f"libraries did not load; searched {', '.join(map(str, cuda_library_dirs())) or 'nothing'}); "
                          "put the nvidia/*/lib folders of the torch wheels on LD_LIBRARY_PATH (DEVELOPERS.md)")
    return session


def _run_options(graph_id: str | None, ordered: bool):
    """Options of one run; ``graph_id``: ORT's gpu_graph_id, for sessions made with CUDA graphs;
    ``ordered``: ORT's kernels run on a stream the caller's is ordered with (OrtEngine.run)."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = logs.library_levels().onnxruntime
    if graph_id is not None:
        options.add_run_config_entry("gpu_graph_id", graph_id)
    if ordered:
        # the caller's stream waits for ORT's after the run, so the host sync ORT adds after each run
        # (and after each graph replay) would only cost latency
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return options


def cuda_library_dirs() -> list[Path]:
    """The ``site-packages/nvidia/*/lib`` folders (nvidia-cuda-runtime, -cublas, -cudnn-cu13, ... as the
    torch wheels install them), in search-path order."""
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return sorted({lib for root in roots for lib in root.glob("*/lib") if lib.is_dir()})


@cache
def preload_cuda_libraries() -> list[str]:
    """Load the CUDA libraries ORT's CUDA provider links, from ``cuda_library_dirs()``, with RTLD_GLOBAL:
    the provider's dlopen then finds them already in the process. Returns the files loaded. A library
    that does not load here is left to the dynamic loader (LD_LIBRARY_PATH), whose failure
    ``_session`` reports."""
    loaded = []
    dirs = cuda_library_dirs()
    for pattern in _CUDA_LIBRARIES:
        for lib in sorted(f for d in dirs for f in d.glob(pattern) if ".so." in f.name and not f.is_symlink()):
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                loaded.append(lib.name)
            except OSError:
                continue
    return loaded


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
