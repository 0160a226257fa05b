"""Open an engine dir on a backend and make the drafter a request asks for.

Backends: ``trt`` (the built TensorRT engines), ``ort`` (the ONNX graphs on ONNX Runtime), ``torch``
(the PyTorch reference modules, through the ``xcompile.torch_models`` entry point, i.e. when the
compile side is installed), ``fast`` (the reference modules' weights on fused Triton kernels,
runtime/backends/fast.py). ``auto`` picks trt when engines were built and TensorRT imports on a
CUDA device, else fast on CUDA when triton imports, else torch on CUDA, else ort on the CPU
(fp32/fp16 graphs), else torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

import torch

from xcompile.runtime.contract import DRAFT, EAGLE3, EAGLE3_FC, TARGET
from xcompile.runtime.drafters import (
    DraftModelDrafter, Drafter, Eagle3ChainDrafter, Eagle3TreeDrafter, NoDrafter,
)
from xcompile.runtime.engine import Engine
from xcompile.runtime.errors import EngineError
from xcompile.runtime.manifest import D2T_FILE, Manifest

BACKENDS = ("auto", "trt", "ort", "torch", "fast")
DRAFTERS = ("auto", "none", "draft-model", "eagle3")

# EAGLE3 defaults: chain of 4 when no tree is asked for; tree shape as SGLang runs Qwen3-8B heads
# (reference/perf_anchors.md: steps 6, top-k 10, 32 draft tokens)
DEFAULT_GAMMA = 4
DEFAULT_TREE = dict(topk=10, depth=6, total_tokens=32)


@dataclass
class EngineSet:
    """The engines of one engine dir on one backend (+ the EAGLE3 d2t map), as ``open_engine_dir`` opens them."""

    directory: Path | None
    manifest: Manifest
    backend: str
    engines: dict[str, Engine]
    d2t: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.engines[TARGET].device

    def close(self) -> None:
        for e in self.engines.values():
            e.close()


def torch_models():
    """The compile side's model provider (module ``xcompile.compile.reference``), or a clear error."""
    found = entry_points(group="xcompile.torch_models")
    if not found:
        raise EngineError("the torch backend needs the reference model code (pip install xcompile with its "
                          "compile side); use --backend trt or ort")
    return next(iter(found)).load()


def pick_backend(manifest: Manifest, backend: str, device: torch.device) -> str:
    """The backend ``auto`` stands for (module docstring); an explicit backend is returned as is."""
    if backend not in BACKENDS:
        raise EngineError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if device.type == "cuda" and manifest.engines:
        try:
            from xcompile.runtime.backends.trt import import_trt

            import_trt(next(iter(manifest.engines.values())).flavor)
            return "trt"
        except EngineError:
            pass
    if device.type == "cuda":
        from xcompile.runtime import kernels

        return "fast" if kernels.available() else "torch"
    if manifest.dtype != "bf16":
        return "ort"
    return "torch"


def _ort_engines(directory: Path, manifest: Manifest, device: torch.device, max_tokens: int,
                 cuda_graphs: bool, verify: bool) -> dict[str, Engine]:
    from xcompile.runtime.backends import ort

    # the target's buffers follow its KV capacity (max_tokens None); the drafts' may be asked for more.
    # cuda_graphs: ORT's own CUDA graphs (runtime/backends/ort.py), on CUDA only
    graphs = cuda_graphs and device.type == "cuda"
    return {graph: ort.load(directory, graph, device, manifest=manifest, max_rows=max_tokens, cuda_graphs=graphs,
                            verify=verify,
                            max_tokens=max_tokens if graph != TARGET else None) for graph in manifest.graphs}


def open_engine_dir(directory: Path | str, backend: str = "auto", device: str = "cpu", *,
                    cuda_graphs: bool = True, max_draft_tokens: int = 64, verify: bool = False) -> EngineSet:
    """Every graph of the dir as an Engine on ``backend``; d2t loaded when an EAGLE3 head is there.
    Every file used is checked against the manifest's sizes and hashes first: sampled blocks, or
    every byte with ``verify`` (runtime/integrity.py).

    ``cuda_graphs`` applies to TensorRT engines, which record graphs of their own launches, and to ORT on
    CUDA (its ``enable_cuda_graph``); torch-backend steps are recorded by the Generator
    (``Generator(cuda_graphs=...)``, runtime/graphs.py)."""
    directory = Path(directory)
    manifest = Manifest.load(directory)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    backend = pick_backend(manifest, backend, dev)
    if backend == "trt" and dev.type != "cuda":
        raise EngineError("--backend trt: TensorRT engines run on a CUDA GPU, not on the CPU; use --device cuda on a "
                          "machine with an NVIDIA GPU, or --backend ort/torch here")
    manifest.verify(directory, ([D2T_FILE] if EAGLE3 in manifest.graphs else []) + manifest.tokenizer_files, verify)
    if backend == "torch":
        engines = torch_models().load_torch_models(manifest, dev, verify=verify)
    elif backend == "fast":
        engines = fast_engines(manifest, torch_models().load_torch_models(manifest, dev, verify=verify))
    elif backend == "ort":
        engines = _ort_engines(directory, manifest, dev, max(max_draft_tokens, manifest.max_seq_len), cuda_graphs,
                               verify)
    else:                                   # "trt": pick_backend has checked the name
        from xcompile.runtime.backends import trt

        if TARGET not in manifest.engines:
            raise EngineError(f"{directory}: holds no TensorRT engines; build them with `xcompile build`, or use "
                              "--backend ort/torch")
        # each TensorRT engine replays CUDA graphs of its own launches (never wrapped in GraphedEngine)
        engines = {g: trt.load(directory, g, dev, cuda_graphs=cuda_graphs, manifest=manifest, verify=verify)
                   for g in manifest.engines}
    d2t = None
    if EAGLE3 in engines:
        d2t = load_d2t(directory / D2T_FILE, dev)
    return EngineSet(directory, manifest, backend, engines, d2t)


def fast_engines(manifest: Manifest, engines: dict[str, Engine]) -> dict[str, Engine]:
    """The torch backend's engines of ``manifest`` on the fused kernels (runtime/backends/fast.py)."""
    from xcompile.runtime.backends import fast

    fast.check_device(engines[TARGET].device)
    models = manifest.models
    configs = {g: models[EAGLE3 if g == EAGLE3_FC else g].config for g in engines}
    return fast.wrap(engines, configs, list(models[TARGET].extra.get("taps") or ()))


def load_d2t(path: Path, device: torch.device) -> torch.Tensor:
    """The EAGLE3 draft->target id offsets of an engine dir (``d2t.safetensors``)."""
    if not path.is_file():
        raise EngineError(f"{path}: missing; the EAGLE3 head needs its draft->target map (re-export the dir)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))["d2t"].to(device)
    except (SafetensorError, KeyError, OSError) as e:
        raise EngineError(f"{path}: unreadable ({e}); re-export the engine dir") from None


def make_drafter(es: EngineSet, drafter: str = "auto", gamma: int | None = None, tree: dict | None = None) -> Drafter:
    """The drafter a request asks for, from what the engine dir holds. ``tree`` (topk/depth/total_tokens)
    selects the EAGLE3 tree; otherwise EAGLE3 drafts a chain of ``gamma`` tokens."""
    if drafter not in DRAFTERS:
        raise EngineError(f"--drafter {drafter!r}: expected one of {', '.join(DRAFTERS)}")
    have = es.engines
    if drafter == "auto":
        drafter = "eagle3" if EAGLE3 in have else "draft-model" if DRAFT in have else "none"
    where = es.directory or es.manifest.name
    if drafter == "none":
        return NoDrafter()
    if drafter == "draft-model":
        if DRAFT not in have:
            raise EngineError(f"{where}: holds no draft model; rebuild with --draft-model, or use --drafter "
                              f"{'eagle3' if EAGLE3 in have else 'none'}")
        return DraftModelDrafter(have[DRAFT], gamma or DEFAULT_GAMMA)
    if EAGLE3 not in have or EAGLE3_FC not in have:
        raise EngineError(f"{where}: holds no EAGLE3 head; rebuild with --eagle3, or use --drafter "
                          f"{'draft-model' if DRAFT in have else 'none'}")
    if tree:
        return Eagle3TreeDrafter(have[EAGLE3], have[EAGLE3_FC], es.d2t, **{**DEFAULT_TREE, **tree})
    return Eagle3ChainDrafter(have[EAGLE3], have[EAGLE3_FC], es.d2t, gamma or DEFAULT_GAMMA)
