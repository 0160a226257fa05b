"""What a run's options may ask of the engines, checked before any weight loads: the device, the backend's needs,
the target's KV cache dtype, CUDA graphs and the row-invariant kernels. Each refusal is one line naming the option
(OptionError: exit 2). Like load.py, this imports torch only inside functions (``xrun --help``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xcompile.runtime.common.errors import EngineError, OptionError
from xcompile.runtime.enginedir.contract import TARGET

if TYPE_CHECKING:
    import torch

    from xcompile.runtime.engines.kernels.config import KernelConfig
    from xcompile.runtime.engines.load import EngineSet


# --kv-cache-dtype: the torch dtype of the target's KV cache (None: the engines' own)
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn"}


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise EngineError(f"--kv-cache-dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")


def check_backend_options(backend: str, device, kv_cache_dtype: str) -> None:
    """Before any weight loads: OptionError for the fast backend or TensorRT engines off CUDA, or an FP8 KV cache on a
    backend whose graphs read full-precision caches (what opening the engines and set_kv_cache_dtype would say
    later)."""
    check_kv_cache_dtype(kv_cache_dtype)
    check_trt_device(backend, device)
    if backend == "fast":
        from xcompile.runtime.engines.fast import check_device

        check_device(device)
    if KV_CACHE_DTYPES[kv_cache_dtype] is not None and backend not in ("fast", "torch"):
        raise _no_fp8_cache(kv_cache_dtype, backend)


def _no_fp8_cache(name: str, backend: str) -> OptionError:
    return OptionError(f"--kv-cache-dtype {name}: the {backend} backend holds the KV cache in the engines' dtype; an "
                       "FP8 cache runs on --backend fast or torch (the ONNX / TensorRT graphs read full-precision "
                       "caches for now)")


def set_kv_cache_dtype(es: EngineSet, name: str) -> None:
    """The target's KV cache of engine set ``es`` in --kv-cache-dtype ``name``, before any KV is bound; EngineError
    (one line) where its backend cannot hold it."""
    check_kv_cache_dtype(name)
    if KV_CACHE_DTYPES[name] is None:
        return
    import torch

    target, dtype = es.engines[TARGET], getattr(torch, KV_CACHE_DTYPES[name])
    if dtype not in target.kv_dtypes:
        raise _no_fp8_cache(name, es.backend)
    target.set_kv_dtype(dtype)


def resolve_device(device: str | None) -> torch.device:
    """``device`` as given, else the GPU where torch sees one, else the CPU (every command's default); OptionError
    for a CUDA device where torch sees none."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise OptionError("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    return dev


def check_cuda_graphs(cuda_graphs: bool, device: str | None) -> None:
    """OptionError for --no-cuda-graphs where it would change nothing: a CPU's steps always run eagerly."""
    if not cuda_graphs and resolve_device(device).type == "cpu":
        raise OptionError("--no-cuda-graphs: steps on the CPU always run eagerly (CUDA graphs are recorded on CUDA "
                          "devices only), so it would change nothing; drop it")


def check_trt_device(backend: str, device: torch.device) -> None:
    """OptionError for TensorRT engines on a device that is not a CUDA GPU."""
    if backend == "trt" and device.type != "cuda":
        raise OptionError("--backend trt: TensorRT engines run on a CUDA GPU, not on the CPU; use --device cuda on a "
                          "machine with an NVIDIA GPU, or --backend ort/torch here")


def check_row_invariant(kernels: KernelConfig | None, backend: str) -> None:
    """EngineError when row-invariant kernels are asked of a backend other than fast (whose kernels they are)."""
    if kernels is not None and kernels.row_invariant and backend != "fast":
        raise OptionError(f"--row-invariant chooses the fast backend's kernels, and this run takes the {backend} "
                          "backend; add --backend fast (a CUDA GPU)")
