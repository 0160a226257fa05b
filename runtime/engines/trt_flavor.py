"""Which TensorRT runs an engine dir and what it says: the two flavors (full TensorRT, TensorRT-RTX) and their
import, a logger that keeps TensorRT's errors, what a failed deserialization means (no usable GPU, another
TensorRT or GPU, or unknown) and how a deserialized engine's I/O differs from the contract. Shared by the trt
backend (trt.py), ``xcompile build`` and ``xcompile inspect``.
"""

from __future__ import annotations

import importlib
import sys

from xcompile.runtime.common import logs
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import MODEL_DTYPE, GraphSpec, KVShape
from xcompile.runtime.enginedir.manifest import EngineEntry

# flavor -> import name (both expose the same Python API for what this backend uses)
FLAVOR_MODULES = {"tensorrt": "tensorrt", "rtx": "tensorrt_rtx"}
FLAVOR_NAMES = {"tensorrt": "TensorRT", "rtx": "TensorRT-RTX"}
INSTALL_HINT = ("install TensorRT-RTX with `pip install tensorrt-rtx-cu13` (RTX-class GPUs, CPU-only builds), "
                "or full TensorRT >= 10.15 with `pip install tensorrt-cu13` (data-center GPUs such as the H200)")


def import_trt(flavor: str):
    """The TensorRT Python module of ``flavor`` ("tensorrt" or "rtx"); EngineError with the pip command if absent."""
    if flavor not in FLAVOR_MODULES:
        raise EngineError(f"unknown TensorRT flavor {flavor!r}; expected one of {sorted(FLAVOR_MODULES)}")
    try:
        return importlib.import_module(FLAVOR_MODULES[flavor])
    except ImportError as e:
        raise EngineError(f"{FLAVOR_NAMES[flavor]} is not installed ({e}); {INSTALL_HINT}") from None


def resolve_flavor(requested: str) -> str:
    """``auto`` -> "tensorrt" when full TensorRT imports, else "rtx"; explicit flavors must import."""
    if requested != "auto":
        import_trt(requested)
        return requested
    for flavor in ("tensorrt", "rtx"):
        try:
            import_trt(flavor)
            return flavor
        except EngineError:
            continue
    raise EngineError(f"no TensorRT flavor is installed; {INSTALL_HINT}")


def trt_dtype_names(trt) -> dict:
    """trt.DataType -> contract dtype name."""
    d = trt.DataType
    return {d.FLOAT: "float32", d.HALF: "float16", d.BF16: "bfloat16", d.INT32: "int32", d.INT64: "int64",
            d.BOOL: "bool"}


def collecting_logger(trt):
    """A trt.ILogger that keeps the errors (to explain a failed deserialization) and prints, on stderr,
    the other messages as severe as the level in force (runtime/common/logs.py: -v shows all)."""
    severity = trt.ILogger.Severity
    shown = int(logs.trt_severity(trt))         # severities are ordered: INTERNAL_ERROR 0 ... VERBOSE 4

    class Collect(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, level, msg):
            if level in (severity.ERROR, severity.INTERNAL_ERROR):
                self.errors.append(msg)
            elif int(level) <= shown:
                print(f"[TensorRT] {msg}", file=sys.stderr)

    return Collect()


# what TensorRT logs when the machine cannot run any engine (cudaError 35: insufficient driver, 100: no
# device), and when the engine is from another TensorRT or GPU (serialization header, device checks)
_NO_DEVICE = ("cudaError 35", "cudaError 100", "CUDA driver version is insufficient", "no CUDA-capable device")
_FOREIGN = ("magicTag", "serialization version", "Version tag", "incompatible device", "expecting compute",
            "compute capability")


def deserialize_error(source: str, entry: EngineEntry, trt, errors: list[str]) -> EngineError:
    """Why TensorRT could not deserialize an engine whose file matches the manifest (so it is as built):
    no usable GPU/driver here (rebuilding would not help), another TensorRT or GPU, or unknown."""
    name = f"{FLAVOR_NAMES[entry.flavor]} {trt.__version__}"
    said = "; ".join(dict.fromkeys(" ".join(e.split()) for e in errors))[:400] or "no error logged"
    built = (f"built with {entry.trt_version} for compute capabilities "
             f"{entry.compute_capabilities or 'of the build GPU'}")
    if any(m in e for e in errors for m in _NO_DEVICE):
        return EngineError(f"{source}: {name} cannot run any engine here: no usable CUDA device or driver ({said}); "
                           "the engine itself is fine (do not rebuild): run it on a machine with an NVIDIA GPU and "
                           "driver, or use --backend ort/torch")
    if any(m in e for e in errors for m in _FOREIGN):
        return EngineError(f"{source}: {name} refuses it as an engine of another TensorRT version or GPU ({built}; "
                           f"{said}); rebuild it on this machine with `xcompile build ... --force`")
    return EngineError(f"{source}: {name} could not deserialize it ({built}; {said}); the file matches the "
                       "manifest's hashes, so it is as built: rebuild it on this machine with `xcompile build ... "
                       "--force`")


def check_engine(engine, spec: GraphSpec, model_dtype: str, kv: KVShape | None, trt) -> list[str]:
    """Differences between a deserialized engine's I/O and the contract (empty when it matches)."""
    problems = []
    names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
    want = set(spec.input_names) | set(spec.output_names)
    if names != want:
        if want - names:
            problems.append(f"missing tensors {sorted(want - names)}")
        if names - want:
            problems.append(f"unexpected tensors {sorted(names - want)}")
    dtype_of = trt_dtype_names(trt)
    for mode, tensors in ((trt.TensorIOMode.INPUT, spec.inputs), (trt.TensorIOMode.OUTPUT, spec.outputs)):
        for t in tensors:
            if t.name not in names:
                continue
            if engine.get_tensor_mode(t.name) != mode:
                problems.append(f"{t.name} is not an engine {mode.name.lower()}")
            want_dtype = model_dtype if t.dtype == MODEL_DTYPE else t.dtype
            got = dtype_of.get(engine.get_tensor_dtype(t.name), str(engine.get_tensor_dtype(t.name)))
            if got != want_dtype:
                problems.append(f"{t.name} is {got}, expected {want_dtype}")
    for present, past in spec.aliases().items():
        if present in names and (engine.get_aliased_input_tensor(present) or None) != past:
            problems.append(f"{present} is not aliased to {past} (got {engine.get_aliased_input_tensor(present)!r}); "
                            "the KV cache would not be updated in place")
        if kv is not None and past in names and tuple(engine.get_tensor_shape(past)) != kv.shape:
            problems.append(f"{past} has static shape {tuple(engine.get_tensor_shape(past))}, expected {kv.shape}")
    return problems
