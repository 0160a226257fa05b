"""A stand-in for the parts of the TensorRT Python API that runtime/engines/trt.py uses.

An "engine file" is JSON: the graph's contract I/O, its concrete dims and profiles, the version
that "built" it. The fake really works through addresses, like TensorRT: ``execute_async_v3``
reads and writes the memory bound with ``set_tensor_address`` (CPU through ctypes, CUDA through
``__cuda_array_interface__``) on the given stream, and computes a checkable step in torch:

    KV layer i:   key[b, :, w+t, :] = input_ids[b, t] + i,  value[b, :, w+t, :] = position_ids[b, t]
                  (w = write_index[b]; written in place at the *present* address, which must equal
                  the past address, as TensorRT requires of aliased outputs)
    logits:       one-hot at (input_ids[b, logit_rows[b, r]] + 1) % vocab, plus the sum of the
                  first layer's key column over committed rows (so a wrong cache binding shows)
    hidden_taps / hidden_out:  input_ids[b, t] broadcast over the last axis
    hidden_states (eagle3_fc): the first ``hidden`` columns of hidden_taps, plus 1
"""

from __future__ import annotations

import ctypes
import enum
import json

import torch

from xcompile.runtime.enginedir.contract import MODEL_DTYPE


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    BF16 = 2
    INT32 = 3
    INT64 = 4
    BOOL = 5


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class ExecutionContextAllocationStrategy(enum.Enum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


_TRT = {"float32": DataType.FLOAT, "float16": DataType.HALF, "bfloat16": DataType.BF16, "int64": DataType.INT64,
        "bool": DataType.BOOL}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "bool": torch.bool}
_DYNAMIC = ("tokens", "rows")


def engine_bytes(io: dict, dims: dict, profiles: list[dict], dtype: str, version: str, **overrides) -> bytes:
    """A fake serialized engine. ``overrides``: {"aliases": {present: past-or-None}, "dtypes": {name: dtype},
    "drop": [names]} to build broken engines."""
    return json.dumps({"io": io, "dims": dims, "profiles": profiles, "dtype": dtype, "version": version,
                       **overrides}).encode()


def tensor_at(address: int, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor viewing ``address`` (what TensorRT does with a bound pointer)."""
    nbytes = max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    if device.type == "cpu":
        raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
    else:
        class Raw:
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}

        raw = torch.as_tensor(Raw(), device=device)
    return raw.view(dtype)[: torch.Size(shape).numel()].view(shape)


class Logger:
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = -1, 0, 1, 2, 3

    def __init__(self, severity=WARNING):
        self.severity = severity


class ILogger:
    class Severity(enum.Enum):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self):
        pass


class PluginRegistry:
    def __init__(self):
        self.libraries = []

    def get_creator(self, name, version, namespace=""):
        return None

    def load_library(self, path):
        self.libraries.append(path)
        return object()


class Engine:
    def __init__(self, data: dict, fake):
        self.fake, self.data = fake, data
        drop = set(data.get("drop", []))
        self.specs = {t["name"]: (t, TensorIOMode.INPUT) for t in data["io"]["inputs"] if t["name"] not in drop}
        self.specs |= {t["name"]: (t, TensorIOMode.OUTPUT) for t in data["io"]["outputs"] if t["name"] not in drop}
        self.names = list(self.specs)
        self.aliases = {t["name"]: t.get("aliases") for t in data["io"]["outputs"]} | data.get("aliases", {})
        self.contexts = []

    # ---- ICudaEngine
    @property
    def num_io_tensors(self):
        return len(self.names)

    @property
    def num_optimization_profiles(self):
        return len(self.data["profiles"])

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return self.specs[name][1]

    def dtype_name(self, name):
        t = self.specs[name][0]
        dtype = self.data["dtype"] if t["dtype"] == MODEL_DTYPE else t["dtype"]
        return self.data.get("dtypes", {}).get(name, dtype)

    def get_tensor_dtype(self, name):
        return _TRT[self.dtype_name(name)]

    def get_tensor_shape(self, name):
        return tuple(-1 if d in _DYNAMIC else self.data["dims"][d] for d in self.specs[name][0]["shape"])

    def get_aliased_input_tensor(self, name):
        return self.aliases.get(name) or ""

    def get_tensor_profile_shape(self, name, p):
        profile = self.data["profiles"][p]
        ranges = {"tokens": profile["tokens"], "rows": profile.get("rows", profile["tokens"])}
        return [tuple(ranges[d][k] if d in ranges else self.data["dims"][d] for d in self.specs[name][0]["shape"])
                for k in range(3)]

    def get_device_memory_size_for_profile_v2(self, p):
        return 1024 * (p + 1)

    def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC):
        ctx = Context(self, strategy)
        self.contexts.append(ctx)
        return ctx


class Context:
    def __init__(self, engine: Engine, strategy):
        self.engine, self.strategy = engine, strategy
        self.profile, self.shapes, self.addresses, self.device_memory = 0, {}, {}, None
        self.executions = 0

    def set_device_memory(self, address, size):
        self.device_memory = (address, size)

    def set_optimization_profile_async(self, p, stream):
        self.profile = p
        return True

    def set_input_shape(self, name, shape):
        lo, _, hi = self.engine.get_tensor_profile_shape(name, self.profile)
        if len(shape) != len(lo) or not all(a <= d <= b for a, d, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, address):
        self.addresses[name] = address
        return True

    def get_tensor_shape(self, name):
        t, mode = self.engine.specs[name]
        if mode == TensorIOMode.INPUT:
            return self.shapes.get(name, self.engine.get_tensor_shape(name))
        sizes = dict(self.engine.data["dims"])
        for i_name, shape in self.shapes.items():
            for d, n in zip(self.engine.specs[i_name][0]["shape"], shape):
                if d in _DYNAMIC:
                    sizes[d] = n
        return tuple(sizes[d] for d in t["shape"])

    def is_stream_capturable(self, stream):
        return self.engine.fake.capturable

    def execute_async_v3(self, stream):
        fake = self.engine.fake
        if fake.fail_execute:
            return False
        device = fake.device
        if device.type == "cuda":
            if not fake.capturable and torch.cuda.is_current_stream_capturing():
                return False        # what TensorRT does with non-capturable layers under capture
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
                return self._execute(device)
        return self._execute(device)

    def _tensor(self, name, device):
        return tensor_at(self.addresses[name], self.get_tensor_shape(name), _TORCH[self.engine.dtype_name(name)], device)

    def _execute(self, device) -> bool:
        e, fake = self.engine, self.engine.fake
        self.executions += 1
        fake.executions.append(self.profile)
        for name, (_, mode) in e.specs.items():
            if mode == TensorIOMode.INPUT and name not in self.addresses:
                return False
        x = {n: self._tensor(n, device) for n, (_, m) in e.specs.items() if m == TensorIOMode.INPUT}
        out = {n: self._tensor(n, device) for n, (_, m) in e.specs.items() if m == TensorIOMode.OUTPUT}
        for present, past in e.aliases.items():
            if past and self.addresses.get(present) != self.addresses.get(past):
                return False        # TensorRT: an aliased output must be bound at its input's address
        layer = 0
        for present, past in e.aliases.items():
            if not past:
                continue
            cache, step = out[present], x["input_ids"].shape[1]
            rows = x["write_index"][:, None] + torch.arange(step, device=device)          # [B, S]
            source = x["input_ids"] + layer // 2 if "key" in present else x["position_ids"]
            index = rows[:, None, :, None].expand(cache.shape[0], cache.shape[1], step, cache.shape[3])
            cache.scatter_(2, index, source[:, None, :, None].to(cache.dtype).expand_as(index))
            layer += 1
        for name, t in out.items():
            if name == "logits":
                ids = torch.gather(x["input_ids"], 1, x["logit_rows"])                  # [B, R]
                t.zero_()
                t.scatter_(2, ((ids + 1) % t.shape[-1])[:, :, None], 1.0)
                if "present_key_0" in out:
                    committed = torch.arange(out["present_key_0"].shape[2], device=device) < x["write_index"][:, None]
                    seen = (out["present_key_0"][:, 0, :, 0].float() * committed).sum(-1)       # [B]
                    t.add_(seen[:, None, None].to(t.dtype))
            elif name in ("hidden_taps", "hidden_out"):
                t.copy_(x["input_ids"][:, :, None].to(t.dtype).expand_as(t))
            elif name == "hidden_states":
                t.copy_(x["hidden_taps"][..., : t.shape[-1]] + 1)
        return True


class Runtime:
    def __init__(self, fake, logger):
        self.fake, self.logger = fake, logger

    def deserialize_cuda_engine(self, plan: bytes):
        try:
            data = json.loads(bytes(plan))
        except ValueError:
            data = {"version": None}
        if data["version"] != self.fake.__version__ or self.fake.refuse_engines:
            # TensorRT logs an error and returns None for foreign engines
            self.logger.log(ILogger.Severity.ERROR, self.fake.refusal)
            return None
        return Engine(data, self.fake)


class FakeTrt:
    """The module object: ``fake = FakeTrt(); load(dir, graph, trt=fake)``."""

    DataType, TensorIOMode, Logger, ILogger = DataType, TensorIOMode, Logger, ILogger
    ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy

    def __init__(self, version: str = "1.7.1.116", device: str = "cpu", name: str = "tensorrt_rtx"):
        self.__version__, self.__name__, self.device = version, name, torch.device(device)
        self.capturable, self.fail_execute, self.refuse_engines = True, False, False
        # what deserialize_cuda_engine logs when it refuses an engine (TensorRT-RTX 1.7's message for a header
        # of another version; tests set the ones for a missing driver or another GPU)
        self.refusal = ("IRuntime::deserializeCudaEngine: Error Code 1: Serialization (Serialization assertion "
                        "header.magicTag == kEXPECTED_MAGIC_TAG failed.Trying to load an engine created with "
                        "incompatible serialization version)")
        self.executions: list[int] = []         # profile of every execution, in order
        self.registry = PluginRegistry()

    def Runtime(self, logger):                  # noqa: N802 (TensorRT's spelling)
        return Runtime(self, logger)

    def get_plugin_registry(self):
        return self.registry
