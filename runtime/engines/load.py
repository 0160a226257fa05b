"""Open an engine dir on a backend: the backend registry.

``BACKENDS`` maps a backend name to how it opens a dir's graphs and when ``auto`` takes it; ``auto``
takes the first entry, in registry order, that can run the dir on the device: trt when engines were
built and TensorRT imports on a CUDA device, else fast (the reference modules' weights on fused Triton
kernels, runtime/engines/fast.py) on CUDA when triton imports, else ort on the CPU for fp32/fp16
graphs, else torch (the PyTorch reference modules, through the ``xcompile.torch_models`` entry point,
i.e. when the compile side is installed). Adding a backend is one entry; the CLI's choices are its keys.

The CLIs read the registry for their option choices, so this module imports torch and the backends only
inside functions: ``xrun --help`` stays instant (tests/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import EAGLE3, EAGLE3_FC, MTP, TARGET
from xcompile.runtime.engines.run_checks import check_row_invariant, check_trt_device, resolve_device

if TYPE_CHECKING:
    import torch

    from xcompile.runtime.enginedir.manifest import Manifest
    from xcompile.runtime.engines.base import Engine
    from xcompile.runtime.engines.kernels.config import KernelConfig

AUTO = "auto"


# --------------------------------------------------------------------------------------------
# the engine set and its lifecycle


@dataclass
class EngineSet:
    """The engines of one engine dir on one backend (+ the d2t maps of an EAGLE3 head and of an MTP module with
    a draft vocabulary), as ``open_engine_dir`` opens them. A context manager: ``with open_engine_dir(d) as es: ...`` closes every engine on the way out."""

    directory: Path | None
    manifest: Manifest
    backend: str
    engines: dict[str, Engine]
    d2t: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)
    mtp_d2t: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.engines[TARGET].device

    def close(self) -> None:
        for e in self.engines.values():
            e.close()

    def __enter__(self) -> EngineSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class OpenOptions:
    """What a backend's loader may need beyond the dir and the device."""

    cuda_graphs: bool = True        # TensorRT engines record graphs of their own launches; ORT on CUDA its own
    max_draft_tokens: int = 64      # rows the drafts' step buffers hold (ORT)
    verify: bool = False            # hash every byte of each file a loader reads (runtime/enginedir/integrity.py)
    kernels: KernelConfig | None = None     # the fast backend's open kernel choices (None: the defaults)


# --------------------------------------------------------------------------------------------
# backends


@dataclass(frozen=True)
class Backend:
    """How a backend opens an engine dir: ``load(directory, manifest, device, options)`` -> engines by
    graph; ``auto(manifest, device)`` says whether ``--backend auto`` may take it."""

    load: Callable[[Path, Manifest, torch.device, OpenOptions], dict[str, Engine]]
    auto: Callable[[Manifest, torch.device], bool]
    help: str


def _load_each(graphs, load: Callable[[str], Engine]) -> dict[str, Engine]:
    """``load(graph)`` for each graph; the ones already open are closed if a later one fails."""
    engines: dict[str, Engine] = {}
    try:
        for g in graphs:
            engines[g] = load(g)
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines


def _trt_load(directory, manifest, device, options):
    from xcompile.runtime.engines import trt

    if TARGET not in manifest.engines:
        raise EngineError(f"{directory}: holds no TensorRT engines; build them with `xcompile build`, or use "
                          "--backend ort/torch")
    # each TensorRT engine replays CUDA graphs of its own launches (never wrapped in GraphedEngine)
    return _load_each(manifest.engines, lambda g: trt.load(directory, g, device, cuda_graphs=options.cuda_graphs,
                                                            manifest=manifest, verify=options.verify))


def _trt_auto(manifest, device) -> bool:
    if device.type != "cuda" or not manifest.engines:
        return False
    from xcompile.runtime.engines.trt_flavor import import_trt

    try:
        import_trt(next(iter(manifest.engines.values())).flavor)
        return True
    except EngineError:
        return False


def _ort_load(directory, manifest, device, options):
    from xcompile.runtime.engines import ort

    # the target's buffers follow its KV capacity (max_tokens None); the drafts' may be asked for more.
    # cuda_graphs: ORT's own CUDA graphs (enable_cuda_graph, runtime/engines/ort.py), on CUDA only
    rows = max(options.max_draft_tokens, manifest.max_seq_len)
    graphs = options.cuda_graphs and device.type == "cuda"
    return _load_each(manifest.graphs, lambda g: ort.load(directory, g, device, manifest=manifest, max_rows=rows,
                                                           max_tokens=rows if g != TARGET else None,
                                                           cuda_graphs=graphs, verify=options.verify))


def _torch_load(directory, manifest, device, options):
    return torch_models().load_torch_models(manifest, device, verify=options.verify)


def _fast_load(directory, manifest, device, options):
    # a quantized checkpoint's modules keep its codes too, for the quantized kernels (kernels/qlinear.py)
    engines = torch_models().load_torch_models(manifest, device, verify=options.verify, quantized=True)
    return fast_engines(manifest, engines, options.kernels)


def _fast_auto(manifest, device) -> bool:
    if device.type != "cuda":
        return False
    from xcompile.runtime.common.gpu import available

    return available()


def fast_engines(manifest: Manifest, engines: dict[str, Engine], kernels: KernelConfig | None = None
                 ) -> dict[str, Engine]:
    """The torch backend's engines of ``manifest`` on the fused kernels (runtime/engines/fast.py), with the
    kernel choices ``kernels`` (None: the defaults)."""
    from xcompile.runtime.engines import fast
    from xcompile.runtime.engines.kernels.config import DEFAULT

    fast.check_device(engines[TARGET].device)
    models = manifest.models
    configs = {g: models[EAGLE3 if g == EAGLE3_FC else g].config for g in engines}
    return fast.wrap(engines, configs, list(models[TARGET].extra.get("taps") or ()), kernels or DEFAULT)


# order is auto's preference (module docstring)
BACKENDS: dict[str, Backend] = {
    "trt": Backend(_trt_load, _trt_auto, "TensorRT engines built by `xcompile build` (CUDA)"),
    "fast": Backend(_fast_load, _fast_auto, "the reference modules' weights on fused Triton kernels (CUDA)"),
    "ort": Backend(_ort_load, lambda m, d: d.type == "cpu" and m.dtype != "bf16",
                   "the ONNX graphs on ONNX Runtime (CPU; CUDA with onnxruntime-gpu)"),
    "torch": Backend(_torch_load, lambda m, d: True, "the PyTorch reference modules (needs the compile side)"),
}
BACKEND_CHOICES = (AUTO, *BACKENDS)


def torch_models():
    """The compile side's model provider (module ``xcompile.compile.reference``), or a clear error."""
    found = entry_points(group="xcompile.torch_models")
    if not found:
        raise EngineError("the torch backend needs the reference model code (pip install xcompile with its "
                          "compile side); use --backend trt or ort")
    return next(iter(found)).load()


def pick_backend(manifest: Manifest, backend: str, device: torch.device) -> str:
    """The backend ``auto`` stands for (module docstring); an explicit backend is returned as is."""
    if backend != AUTO and backend not in BACKENDS:
        raise EngineError(f"--backend {backend!r}: expected one of {', '.join(BACKEND_CHOICES)}")
    if backend != AUTO:
        return backend
    return next(name for name, b in BACKENDS.items() if b.auto(manifest, device))


def open_engine_dir(directory: Path | str, backend: str = AUTO, device: str = "cpu", *,
                    cuda_graphs: bool = True, max_draft_tokens: int = 64, verify: bool = False,
                    kernels: KernelConfig | None = None) -> EngineSet:
    """Every graph of the dir as an Engine on ``backend``; the d2t maps loaded (EngineSet).
    Use it as a context manager (``with open_engine_dir(...) as es:``) or close it in a ``finally``.
    Every file used is checked against the manifest's sizes and hashes first: sampled blocks, or
    every byte with ``verify`` (runtime/enginedir/integrity.py).

    ``cuda_graphs`` applies to TensorRT engines, which record graphs of their own launches, and to ORT on
    CUDA (its ``enable_cuda_graph``); torch- and fast-backend rounds are recorded by the generation loop
    (``LoopOptions(cuda_graphs=...)``, runtime/decoding/rounds.py)."""
    from xcompile.runtime.enginedir.manifest import Manifest

    directory = Path(directory)
    manifest = Manifest.load(directory)
    dev = resolve_device(device)
    backend = pick_backend(manifest, backend, dev)
    check_row_invariant(kernels, backend)
    check_trt_device(backend, dev)
    d2t_files = manifest.d2t_files()
    manifest.verify(directory, list(d2t_files.values()) + manifest.tokenizer_files, verify)
    engines = BACKENDS[backend].load(directory, manifest, dev, OpenOptions(cuda_graphs, max_draft_tokens, verify,
                                                                                kernels))
    es = EngineSet(directory, manifest, backend, engines)
    try:
        if EAGLE3 in d2t_files:
            es.d2t = load_d2t(directory / d2t_files[EAGLE3], dev)
        if MTP in d2t_files:
            es.mtp_d2t = load_d2t(directory / d2t_files[MTP], dev)
    except BaseException:
        es.close()
        raise
    return es


def load_d2t(path: Path, device: torch.device) -> torch.Tensor:
    """The draft->target id offsets of an engine dir (``d2t.safetensors``: the EAGLE3 head's;
    ``mtp_d2t.safetensors``: the MTP module's)."""
    if not path.is_file():
        raise EngineError(f"{path}: missing; the draft vocabulary needs its draft->target map (re-export the dir)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))["d2t"].to(device)
    except (SafetensorError, KeyError, OSError) as e:
        raise EngineError(f"{path}: unreadable ({e}); re-export the engine dir") from None
