"""Polygraphy-style loaders and checks for building TensorRT / TensorRT-RTX engines from our ONNX.

Small composable pieces that ``compile/build.py`` chains (parse -> check -> config -> engine file):
binding Polygraphy to a TensorRT flavor, turning TensorRT's logged errors into one CompileError,
build progress, the network's contract check, optimization-profile shapes, compute-capability
targets, and a loader that streams the plan to disk.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from xcompile.compile.errors import CompileError, CompileOptionError
from xcompile.runtime.common import logs
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir import integrity
from xcompile.runtime.enginedir.contract import MODEL_DTYPE, GraphSpec
from xcompile.runtime.engines.trt_flavor import FLAVOR_NAMES, import_trt, trt_dtype_names

Progress = Callable[[str], None]

# --------------------------------------------------------------------------------------------
# flavor, Polygraphy binding, logging


def polygraphy_backend(flavor: str):
    """(trt module, polygraphy.backend.trt) for ``flavor``.

    Polygraphy binds tensorrt or tensorrt_rtx when ``polygraphy.backend.trt`` is first imported,
    from ``polygraphy.config.USE_TENSORRT_RTX`` (initialised from POLYGRAPHY_USE_TENSORRT_RTX), so
    one process builds one flavor.
    """
    try:
        trt = import_trt(flavor)
    except EngineError as e:
        raise CompileError(str(e)) from None
    from polygraphy import config
    from polygraphy.logger import G_LOGGER

    logs.bind_polygraphy(G_LOGGER)                  # its messages to stderr, at the -v/-q level, from the start
    previous, config.USE_TENSORRT_RTX = config.USE_TENSORRT_RTX, flavor == "rtx"
    from polygraphy.backend import trt as poly
    from polygraphy.backend.trt import loader

    bound = loader.trt.__name__          # resolves Polygraphy's lazy import
    if bound != trt.__name__:
        config.USE_TENSORRT_RTX = previous
        raise CompileError(f"Polygraphy already uses {bound} in this process; build {FLAVOR_NAMES[flavor]} engines "
                           "in a fresh process (one TensorRT flavor per process)")
    return trt, poly


@contextmanager
def polygraphy_errors():
    """Route Polygraphy's (and TensorRT's) log through Python logging for the duration and collect
    its errors, so a failed parse or build raises one CompileError quoting them (the ONNX parser's
    messages name the node); its other messages go to stderr at the level the CLI's -v/-q map to
    (runtime/common/logs.py: warnings by default)."""
    from polygraphy.logger import G_LOGGER

    errors: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            errors.append(record.getMessage().removeprefix("[E] ").removeprefix("[!] "))

    log = logging.getLogger("Polygraphy")
    previous = (G_LOGGER.use_python_logging_system, G_LOGGER.module_severity, log.propagate, log.level)
    logs.bind_polygraphy(G_LOGGER)
    collect, below_errors = Collect(logging.ERROR), logging.StreamHandler(sys.stderr)
    below_errors.addFilter(lambda record: record.levelno < logging.ERROR)
    log.propagate = False
    log.setLevel(logs.library_levels().polygraphy_python_level)
    log.addHandler(collect)
    log.addHandler(below_errors)
    try:
        yield errors
    finally:
        log.removeHandler(collect)
        log.removeHandler(below_errors)
        G_LOGGER.use_python_logging_system, G_LOGGER.module_severity, log.propagate, level = previous
        log.setLevel(level)


def failure(what: str, errors: list[str], exc: Exception) -> CompileError:
    """One CompileError from the logged errors: the parser's per-node errors ("In node N with name:
    ... and operator: ...") when there are any, else the last few, without Polygraphy's summaries."""
    nodes = [e for e in errors if e.startswith("In node ")]
    detail = nodes or [e for e in errors if not e.startswith(_POLYGRAPHY_SUMMARIES)][-3:] or [str(exc)]
    return CompileError(f"{what}: " + "; ".join(" ".join(d.split()) for d in detail))


# Polygraphy's closing messages after TensorRT logged the real error
_POLYGRAPHY_SUMMARIES = ("Could not parse ONNX correctly", "Invalid Engine", "Failed to parse ONNX model")


def progress_monitor(trt, progress: Progress, label: str, cancel: Callable[[], bool] = lambda: False):
    """A trt.IProgressMonitor that reports the builder's top two phase levels with elapsed time and
    cancels the build when ``cancel()`` says so (a held SIGINT/SIGTERM, runtime/common/interrupts.py)."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.start, self.depth = time.monotonic(), {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.depth[phase_name] = 0 if parent_phase is None else self.depth.get(parent_phase, 0) + 1
            if self.depth[phase_name] <= 1:
                progress(f"  {label}: {phase_name} ({time.monotonic() - self.start:.1f}s)")

        def step_complete(self, phase_name, step):
            return not cancel()         # False cancels the build

        def phase_finish(self, phase_name):
            pass

    return Monitor()


# --------------------------------------------------------------------------------------------
# network: contract check, mask rewrite, profiles


@dataclass
class NetworkReport:
    """What a parsed network holds, for checks and ``xcompile inspect``."""

    inputs: dict[str, str]          # name -> dtype name, in network order
    outputs: dict[str, str]
    kv_updates: dict[str, str]      # past input -> present output, wired through a KV-cache-update layer
    attention: int                  # IAttention layers
    rope: int                       # rotary-embedding layers
    problems: list[str]             # differences from the contract (empty when it matches)


def inspect_network(network, spec: GraphSpec, model_dtype: str, trt) -> NetworkReport:
    """Compare a parsed network's I/O (names, order, dtypes) and KV wiring with the contract."""
    dtype_of = trt_dtype_names(trt)
    inputs = {t.name: dtype_of.get(t.dtype, str(t.dtype)) for t in map(network.get_input, range(network.num_inputs))}
    outputs = {t.name: dtype_of.get(t.dtype, str(t.dtype)) for t in map(network.get_output, range(network.num_outputs))}
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    kv_updates = {layer.get_input(0).name: layer.get_output(0).name
                  for layer in layers if layer.type == trt.LayerType.KV_CACHE_UPDATE}
    problems = []
    for kind, got, tensors in (("inputs", inputs, spec.inputs), ("outputs", outputs, spec.outputs)):
        want = {t.name: model_dtype if t.dtype == MODEL_DTYPE else t.dtype for t in tensors}
        if list(got) != list(want):
            problems.append(f"{kind} {list(got)} differ from the contract's {list(want)}")
        problems += [f"{n} is {got[n]}, expected {d}" for n, d in want.items() if n in got and got[n] != d]
    for present, past in spec.aliases().items():
        if kv_updates.get(past) != present:
            problems.append(f"{past} does not feed a KV-cache-update layer whose output is {present} "
                            f"(got {kv_updates.get(past)!r}); export the cache write as TensorScatter (opset 24)")
    return NetworkReport(inputs, outputs, kv_updates,
                         sum(layer.type == trt.LayerType.ATTENTION_INPUT for layer in layers),
                         sum(layer.type == trt.LayerType.ROTARY_EMBEDDING for layer in layers), problems)


def profile_shapes(network, spec: GraphSpec, ranges: dict[str, tuple[int, int, int]]) -> dict[str, tuple]:
    """input name -> (min, opt, max) shapes: static dims as parsed, dynamic ones from ``ranges``
    (symbolic dim -> (min, opt, max), e.g. {"tokens": (1, 8, 8), "rows": ..., "batch": ...})."""
    symbols = {t.name: t.shape for t in spec.inputs}
    shapes = {}
    for t in map(network.get_input, range(network.num_inputs)):
        dims = tuple(t.shape)
        if -1 not in dims:
            continue
        per_dim = []
        for d, symbol in zip(dims, symbols[t.name]):
            if d >= 0:
                per_dim.append((d, d, d))
            elif symbol in ranges:
                per_dim.append(ranges[symbol])
            else:
                raise CompileError(f"{spec.graph}: input {t.name} has dynamic dim {symbol!r}; the contract allows only "
                                   f"{sorted(ranges)} to vary")
        shapes[t.name] = tuple(tuple(r[i] for r in per_dim) for i in range(3))
    return shapes


def compute_capability(text: str, trt) -> tuple[int, int]:
    """"8.9" -> (8, 9), checked against the TRT-RTX ``ComputeCapability`` enum (SM89)."""
    supported = [n for n in trt.ComputeCapability.__members__ if n.startswith("SM")]
    try:
        major, minor = (int(p) for p in text.split("."))
    except ValueError:
        major = minor = -1
    if f"SM{major}{minor}" not in supported:
        listed = ", ".join(f"{n[2:-1]}.{n[-1]}" for n in supported)
        raise CompileOptionError(f"--compute-capability {text}: TensorRT-RTX {trt.__version__} targets {listed}; "
                           "for other GPUs (e.g. the H200, 9.0) build with full TensorRT (--trt tensorrt)")
    return major, minor


class EngineFileFromNetwork:
    """Polygraphy-style loader: build ``network`` with ``config`` straight into the file ``path``
    (``build_serialized_network_to_stream``), so an 8B plan never sits in host memory next to the
    parsed weights as it would with EngineBytesFromNetwork. Writes a new file and renames it onto
    ``path`` (never into an existing file: a staged build hard-links the previous one there); saves
    the timing cache (full TensorRT) like EngineBytesFromNetwork(save_timing_cache=...). Returns the
    written file's record (size and hashes, computed as the plan streams: runtime/enginedir/integrity.py)."""

    def __init__(self, trt, network, config, path: Path, timing_cache: Path | None = None):
        self.trt, self.network, self.config, self.path, self.timing_cache = trt, network, config, path, timing_cache

    def __call__(self) -> int:
        from polygraphy import util

        trt = self.trt

        class FileWriter(trt.IStreamWriter):
            def __init__(self, f):
                trt.IStreamWriter.__init__(self)
                self.f, self.digest = f, integrity.Digest()

            def write(self, data):
                self.f.write(data)
                self.digest.update(data)
                return len(data)

        built, _ = util.invoke_if_callable(self.network)
        builder, network = built[0], built[1]
        config, _ = util.invoke_if_callable(self.config, builder, network)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        try:
            with open(tmp, "wb") as f:
                writer = FileWriter(f)
                ok = builder.build_serialized_network_to_stream(network, config, writer)
            if not ok or writer.digest.size == 0:
                raise CompileError("the builder produced no engine (see the errors above)")
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        if self.timing_cache is not None:
            cache = config.get_timing_cache()         # loaded from the file by CreateConfig, now extended
            with cache.serialize() as data:
                part = self.timing_cache.with_suffix(".tmp")
                part.write_bytes(bytes(data))
                os.replace(part, self.timing_cache)
        return writer.digest.record()


def create_config(trt, poly, flavor: str, shapes: list[dict], ccs: tuple[tuple[int, int], ...],
                  timing_cache: Path | None, monitor, workspace: int | None = None,
                  optimization_level: int | None = None):
    """Builder config loader: one optimization profile per ``shapes`` entry (input -> (min, opt, max));
    full TensorRT loads ``timing_cache``; TRT-RTX targets ``ccs`` and requires user allocation. Both
    take the WORKSPACE pool limit (bytes) and the builder optimization level (0..5) when given."""
    profiles = []
    for per_input in shapes:
        profile = poly.Profile()
        for name, (lo, opt, hi) in per_input.items():
            profile.add(name, lo, opt, hi)
        profiles.append(profile)
    controls = dict(progress_monitor=monitor, builder_optimization_level=optimization_level,
                    memory_pool_limits=None if workspace is None else {trt.MemoryPoolType.WORKSPACE: workspace})
    if flavor == "tensorrt":
        return poly.CreateConfig(profiles=profiles, load_timing_cache=timing_cache, **controls)
    from polygraphy.backend.tensorrt_rtx import CreateConfigRTX

    config = CreateConfigRTX(profiles=profiles, compute_capabilities=list(ccs) or None, **controls)

    def user_allocation(builder, network, config):
        # TRT-RTX engines may be stream-captured (CUDA graphs) only with application-provided memory
        # (TensorRT-RTX 1.2 release notes: kREQUIRE_USER_ALLOCATION)
        config.set_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)

    return poly.PostprocessConfig(config, user_allocation)
