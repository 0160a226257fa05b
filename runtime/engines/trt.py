"""The ``trt`` backend: a TensorRT or TensorRT-RTX engine run on preallocated torch buffers.

Load checks, in order (each failure is one EngineError that says to rebuild): manifest entry ->
TensorRT version of the manifest's flavor -> target GPU -> deserialize -> I/O contract (names,
directions, dtypes, static KV shape, every ``present_*`` aliased to its ``past_*``).

Binding: every non-KV tensor owns one flat buffer sized for the largest profile; a step views its
first ``numel`` elements in the step's shape, so tensor addresses never change and a fixed-shape
step can be replayed from a CUDA graph. The engine records those graphs itself, one per decode/verify
shape (``engines.graphs.CudaGraphCapture`` over one launch), so it is not ``graph_capturable``: the
generation loop never records it into a graph of its own. KV outputs are bound to their input's address (the engine's
KVCacheUpdate layers write in place). One execution context per optimization profile, all sharing
one user-managed scratch allocation (they never run concurrently: one stream).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from xcompile.plugins.registry import PluginError, load_plugins
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import GraphSpec, KVShape
from xcompile.runtime.enginedir.manifest import EngineEntry, Manifest
from xcompile.runtime.engines.base import DTYPE_NAMES, MODEL_TORCH_DTYPES, TORCH_DTYPES, Engine
from xcompile.runtime.engines.graphs import Capture, CudaGraphCapture, GraphUnavailable
from xcompile.runtime.engines.trt_flavor import (
    FLAVOR_NAMES,
    check_engine,
    collecting_logger,
    deserialize_error,
    import_trt,
    trt_dtype_names,
)


class TrtEngine(Engine):
    """One engine of an engine dir behind the Engine interface (see module docstring)."""

    def __init__(self, plan: bytes, entry: EngineEntry, spec: GraphSpec, kv: KVShape | None, dtype: torch.dtype,
                 device: torch.device | str, *, trt, source: str = "", graphs: Capture | None = None):
        """``graphs`` records repeated fixed-shape launches (None: every step launches eagerly)."""
        super().__init__(spec, kv, dtype, device)
        self.entry, self.trt, self.source, self.graphs = entry, trt, source or entry.file, graphs
        self._check_version()
        self._check_gpu()
        try:
            load_plugins(trt)
        except PluginError as e:
            raise EngineError(str(e)) from None
        logger = collecting_logger(trt)
        self.runtime = trt.Runtime(logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise deserialize_error(self.source, entry, trt, logger.errors)
        problems = check_engine(self.engine, spec, DTYPE_NAMES[dtype], kv, trt)
        if problems:
            raise EngineError(f"{self.source}: engine does not match the I/O contract: {'; '.join(problems)}; "
                              "rebuild with `xcompile build ... --force`")
        self._inputs = [t.name for t in spec.step_inputs]
        self._outputs = [t.name for t in spec.step_outputs]
        self._profiles = self._read_profiles()
        self._contexts = self._create_contexts()
        self._buffers = self._allocate_buffers()
        self._shapes: list[dict] = [{} for _ in self._contexts]      # last input shapes set per context
        # profiles from fewest to most tokens: a step takes the first that admits it (decode/verify before prefill)
        tokens = next(t for t in spec.inputs if "tokens" in t.shape)
        axis = tokens.shape.index("tokens")
        self._order = sorted(range(len(self._profiles)), key=lambda p: self._profiles[p][tokens.name][1][axis])
        self._graph_profile = self._order[0]        # CUDA graphs for the fixed-shape decode/verify steps only
        self._replays: dict[tuple, Callable[[], None] | None] = {}  # step key -> graph replay (None: uncapturable)
        self._warm: set[tuple] = set()

    # ---------------------------------------------------------------- load-time checks

    def _check_version(self) -> None:
        if self.entry.trt_version != self.trt.__version__:
            raise EngineError(f"{self.source}: built with {FLAVOR_NAMES[self.entry.flavor]} {self.entry.trt_version}, "
                              f"this runtime has {self.trt.__version__}; engines only load in the version that built "
                              "them: rebuild with `xcompile build ... --force`")

    def _check_gpu(self) -> None:
        if self.device.type != "cuda" or not self.entry.compute_capabilities:
            return
        major, minor = torch.cuda.get_device_capability(self.device)
        if f"{major}.{minor}" not in self.entry.compute_capabilities:
            raise EngineError(f"{self.source}: built for compute capabilities {self.entry.compute_capabilities}, "
                              f"this GPU ({torch.cuda.get_device_name(self.device)}) is {major}.{minor}; rebuild with "
                              f"`xcompile build ... --force` on this GPU (TensorRT-RTX: --compute-capability "
                              f"{major}.{minor})")

    def _read_profiles(self) -> list[dict[str, tuple]]:
        """Per profile: input name -> (min shape, max shape), read from the engine itself."""
        profiles = []
        for p in range(self.engine.num_optimization_profiles):
            shapes = {}
            for name in self._inputs:
                lo, _, hi = self.engine.get_tensor_profile_shape(name, p)
                shapes[name] = (tuple(lo), tuple(hi))
            profiles.append(shapes)
        if not profiles:
            raise EngineError(f"{self.source}: engine has no optimization profile; rebuild with `xcompile build --force`")
        return profiles

    def _create_contexts(self) -> list:
        # all contexts share one scratch buffer sized for the hungriest profile (one stream: never concurrent)
        trt, engine = self.trt, self.engine
        size = max(engine.get_device_memory_size_for_profile_v2(p) for p in range(len(self._profiles)))
        self._scratch = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
        stream = self._stream()
        contexts = []
        for p in range(len(self._profiles)):
            ctx = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if ctx is None:
                raise EngineError(f"{self.source}: could not create an execution context (out of GPU memory?)")
            ctx.set_device_memory(self._scratch.data_ptr(), size)
            if not ctx.set_optimization_profile_async(p, stream):
                raise EngineError(f"{self.source}: could not select optimization profile {p}")
            contexts.append(ctx)
        return contexts

    def _allocate_buffers(self) -> dict[str, torch.Tensor]:
        """Flat buffers for every non-KV tensor, sized by the largest shape any profile allows."""
        trt_dtype = trt_dtype_names(self.trt)
        numel: dict[str, int] = {}
        for p, ctx in enumerate(self._contexts):
            for name in self._inputs:
                hi = self._profiles[p][name][1]
                ctx.set_input_shape(name, hi)
                numel[name] = max(numel.get(name, 0), math.prod(hi))
            for name in self._outputs:
                numel[name] = max(numel.get(name, 0), math.prod(tuple(ctx.get_tensor_shape(name))))
        buffers = {}
        for name, n in numel.items():
            dtype = TORCH_DTYPES[trt_dtype[self.engine.get_tensor_dtype(name)]]
            buffers[name] = torch.zeros(n, dtype=dtype, device=self.device)
            for ctx in self._contexts:
                ctx.set_tensor_address(name, buffers[name].data_ptr())
        return buffers

    # ---------------------------------------------------------------- lifecycle

    def bind_kv(self, buffers: Sequence[torch.Tensor]) -> None:
        super().bind_kv(buffers)
        for i, past in enumerate(self.spec.input_names[len(self._inputs):]):
            present = self.spec.output_names[len(self._outputs) + i]
            for ctx in self._contexts:
                # KVCacheUpdate is in place: the output must live at its aliased input's address
                ctx.set_tensor_address(past, self.kv[i].data_ptr())
                ctx.set_tensor_address(present, self.kv[i].data_ptr())
        self._replays.clear()       # captured graphs hold the old addresses
        self._warm.clear()
        if isinstance(self.graphs, CudaGraphCapture):
            self.graphs.new_pool()

    def run(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """One step. Outputs are views of preallocated buffers, valid until the next ``run``."""
        if len(self.kv) != 2 * self.spec.num_layers:
            raise EngineError(f"{self.source}: bind KV buffers (bind_kv/new_kv) before run")
        if set(inputs) != set(self._inputs):
            raise EngineError(f"{self.source}: run() takes {self._inputs}, got {sorted(inputs)}")
        shapes = {name: tuple(inputs[name].shape) for name in self._inputs}
        profile = self._profile_for(shapes)
        ctx = self._contexts[profile]
        for name in self._inputs:
            x = inputs[name]
            if x.device != self.device:
                raise EngineError(f"{self.source}: input {name} is on {x.device}, the engine runs on {self.device}")
            self._view(name, shapes[name]).copy_(x)
            if self._shapes[profile].get(name) != shapes[name]:
                if not ctx.set_input_shape(name, shapes[name]):
                    raise EngineError(f"{self.source}: engine rejected shape {shapes[name]} for {name}")
                self._shapes[profile][name] = shapes[name]
        self._launch(ctx, (profile, tuple(shapes.values())))
        return {name: self._view(name, tuple(ctx.get_tensor_shape(name))) for name in self._outputs}

    def close(self) -> None:
        # contexts before the engine before the runtime (TensorRT's ownership order)
        self._replays.clear()
        self._contexts = []
        self.engine = None
        self.runtime = None
        super().close()

    # ---------------------------------------------------------------- internals

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    def _view(self, name: str, shape: tuple) -> torch.Tensor:
        return self._buffers[name][: math.prod(shape)].view(shape)

    def _profile_for(self, shapes: dict[str, tuple]) -> int:
        """The first profile (fewest tokens first) whose [min, max] range admits every input shape."""
        def admits(p: int) -> bool:
            for name, shape in shapes.items():
                lo, hi = self._profiles[p][name]
                if len(shape) != len(lo) or not all(a <= d <= b for a, d, b in zip(lo, shape, hi)):
                    return False
            return True

        for p in self._order:
            if admits(p):
                return p
        allowed = {n: self._profiles[self._order[-1]][n] for n in shapes}
        raise EngineError(f"{self.source}: input shapes {shapes} fit no optimization profile (largest admits "
                          f"{allowed}); rebuild with a larger --max-seq-len / --max-draft-tokens")

    def _launch(self, ctx, key: tuple) -> None:
        """Execute on the current stream; replay a CUDA graph for repeated fixed-shape decode/verify steps."""
        capturable = self.graphs is not None and key[0] == self._graph_profile
        if capturable and self._replays.get(key) is not None:
            self._replays[key]()
            return
        if capturable and key in self._warm and key not in self._replays:
            replay = self._capture(ctx)
            self._replays[key] = replay
            if replay is not None:
                replay()        # capture records without executing
                return
            warnings.warn(f"{self.source}: CUDA-graph capture failed for step shape {key[1]}; running it uncaptured",
                          RuntimeWarning, stacklevel=3)
        if not ctx.execute_async_v3(self._stream()):
            raise EngineError(f"{self.source}: execute_async_v3 failed (see the TensorRT log above)")
        self._warm.add(key)

    def _capture(self, ctx) -> Callable[[], None] | None:
        """A graph of one launch of ``ctx`` (its inputs already set), or None where it cannot be captured."""
        if self.entry.flavor == "rtx" and not ctx.is_stream_capturable(self._stream()):
            return None
        try:
            with warnings.catch_warnings():
                # a launch that failed under capture leaves an empty graph: it is discarded below
                warnings.filterwarnings("ignore", "The CUDA Graph is empty", UserWarning)
                # inside the capture the current stream is the capture stream
                replay, ok = self.graphs(lambda: ctx.execute_async_v3(self._stream()), self.device)
        except (GraphUnavailable, RuntimeError):
            return None
        return replay if ok else None


def load(directory: Path, graph: str, device: torch.device | str = "cuda", *, cuda_graphs: bool = True,
         trt=None, manifest: Manifest | None = None, verify: bool = False) -> TrtEngine:
    """The TensorRT engine of ``graph`` in an engine dir, checked against manifest and contract.

    ``trt`` overrides the TensorRT module (tests pass a stand-in); by default the manifest's flavor
    is imported. ``cuda_graphs`` replays repeated fixed-shape decode/verify steps from CUDA graphs.
    ``manifest``: the dir's, when the caller has read it already; ``verify``: hash every byte of the
    engine file, not only sampled blocks.
    """
    directory = Path(directory)
    manifest = manifest if manifest is not None else Manifest.load(directory)
    if graph not in manifest.engines:
        raise EngineError(f"{directory}: no {graph!r} engine in the manifest (has {sorted(manifest.engines)}); "
                          "run `xcompile build` first")
    entry = manifest.engines[graph]
    trt = trt if trt is not None else import_trt(entry.flavor)
    path = directory / entry.file
    if not path.is_file():
        raise EngineError(f"{path}: engine file missing; run `xcompile build` again")
    manifest.verify(directory, [entry.file], full=verify)
    device = torch.device(device)
    # no warm-up runs: a shape's first step runs uncaptured (TrtEngine._launch) before its capture
    graphs = CudaGraphCapture(warmup=0, error_mode="thread_local") if cuda_graphs and device.type == "cuda" else None
    return TrtEngine(path.read_bytes(), entry, manifest.graph_spec(graph), manifest.kv_shape(graph),
                     MODEL_TORCH_DTYPES[manifest.dtype], device, trt=trt, source=str(path), graphs=graphs)
