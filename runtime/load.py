"""Open an engine dir on a backend and make the drafter a request asks for: the two registries.

``BACKENDS`` maps a backend name to how it opens a dir's graphs and when ``auto`` takes it; ``auto``
takes the first entry, in registry order, that can run the dir on the device: trt when engines were
built and TensorRT imports on a CUDA device, else fast (the reference modules' weights on fused Triton
kernels, runtime/backends/fast.py) on CUDA when triton imports, else ort on the CPU for fp32/fp16
graphs, else torch (the PyTorch reference modules, through the ``xcompile.torch_models`` entry point,
i.e. when the compile side is installed). ``DRAFTERS`` maps a drafter name to the graphs it needs and how it is made from a
``DrafterSpec`` (a chain of gamma tokens, or an EAGLE3 tree); ``auto`` takes the first the dir holds.
Adding a backend or a drafter is one entry; the CLI's choices are these keys.

The CLIs read the registries for their option choices, so this module imports torch, the backends
and the drafters only inside functions: ``xrun --help`` stays instant (tests/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

from xcompile.runtime.contract import DRAFT, EAGLE3, EAGLE3_FC, TARGET
from xcompile.runtime.errors import EngineError

if TYPE_CHECKING:
    import torch

    from xcompile.runtime.drafters import Drafter
    from xcompile.runtime.engine import Engine
    from xcompile.runtime.manifest import Manifest

AUTO = "auto"

DEFAULT_GAMMA = 4       # draft tokens per chain round when none is asked for


# --------------------------------------------------------------------------------------------
# the engine set and its lifecycle


@dataclass
class EngineSet:
    """The engines of one engine dir on one backend (+ the EAGLE3 d2t map), as ``open_engine_dir`` opens
    them. A context manager: ``with open_engine_dir(d) as es: ...`` closes every engine on the way out."""

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

    def __enter__(self) -> EngineSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class OpenOptions:
    """What a backend's loader may need beyond the dir and the device."""

    cuda_graphs: bool = True        # TensorRT engines record graphs of their own launches; ORT on CUDA its own
    max_draft_tokens: int = 64      # rows the drafts' step buffers hold (ORT)
    verify: bool = False            # hash every byte of each file a loader reads (runtime/integrity.py)


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
    from xcompile.runtime.backends import trt

    if TARGET not in manifest.engines:
        raise EngineError(f"{directory}: holds no TensorRT engines; build them with `xcompile build`, or use "
                          "--backend ort/torch")
    # each TensorRT engine replays CUDA graphs of its own launches (never wrapped in GraphedEngine)
    return _load_each(manifest.engines, lambda g: trt.load(directory, g, device, cuda_graphs=options.cuda_graphs,
                                                            manifest=manifest, verify=options.verify))


def _trt_auto(manifest, device) -> bool:
    if device.type != "cuda" or not manifest.engines:
        return False
    from xcompile.runtime.backends.trt import import_trt

    try:
        import_trt(next(iter(manifest.engines.values())).flavor)
        return True
    except EngineError:
        return False


def _ort_load(directory, manifest, device, options):
    from xcompile.runtime.backends import ort

    # the target's buffers follow its KV capacity (max_tokens None); the drafts' may be asked for more.
    # cuda_graphs: ORT's own CUDA graphs (enable_cuda_graph, runtime/backends/ort.py), on CUDA only
    rows = max(options.max_draft_tokens, manifest.max_seq_len)
    graphs = options.cuda_graphs and device.type == "cuda"
    return _load_each(manifest.graphs, lambda g: ort.load(directory, g, device, manifest=manifest, max_rows=rows,
                                                           max_tokens=rows if g != TARGET else None,
                                                           cuda_graphs=graphs, verify=options.verify))


def _torch_load(directory, manifest, device, options):
    return torch_models().load_torch_models(manifest, device, verify=options.verify)


def _fast_load(directory, manifest, device, options):
    return fast_engines(manifest, _torch_load(directory, manifest, device, options))


def _fast_auto(manifest, device) -> bool:
    if device.type != "cuda":
        return False
    from xcompile.runtime import kernels

    return kernels.available()


def fast_engines(manifest: Manifest, engines: dict[str, Engine]) -> dict[str, Engine]:
    """The torch backend's engines of ``manifest`` on the fused kernels (runtime/backends/fast.py)."""
    from xcompile.runtime.backends import fast

    fast.check_device(engines[TARGET].device)
    models = manifest.models
    configs = {g: models[EAGLE3 if g == EAGLE3_FC else g].config for g in engines}
    return fast.wrap(engines, configs, list(models[TARGET].extra.get("taps") or ()))


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
                    cuda_graphs: bool = True, max_draft_tokens: int = 64, verify: bool = False) -> EngineSet:
    """Every graph of the dir as an Engine on ``backend``; d2t loaded when an EAGLE3 head is there.
    Use it as a context manager (``with open_engine_dir(...) as es:``) or close it in a ``finally``.
    Every file used is checked against the manifest's sizes and hashes first: sampled blocks, or
    every byte with ``verify`` (runtime/integrity.py).

    ``cuda_graphs`` applies to TensorRT engines, which record graphs of their own launches, and to ORT on
    CUDA (its ``enable_cuda_graph``); torch- and fast-backend steps are recorded by the Generator
    (``Generator(cuda_graphs=...)``, runtime/graphs.py)."""
    import torch

    from xcompile.runtime.manifest import D2T_FILE, Manifest

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
    engines = BACKENDS[backend].load(directory, manifest, dev, OpenOptions(cuda_graphs, max_draft_tokens, verify))
    es = EngineSet(directory, manifest, backend, engines)
    try:
        if EAGLE3 in engines:
            es.d2t = load_d2t(directory / D2T_FILE, dev)
    except BaseException:
        es.close()
        raise
    return es


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


# --------------------------------------------------------------------------------------------
# drafters


@dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 dynamic tree: ``topk`` children per expanded node, ``depth`` draft steps per round,
    ``total_tokens`` drafts verified per round. Defaults: SGLang's for Qwen3-8B heads
    (reference/perf_anchors.md: steps 6, top-k 10, 32 draft tokens)."""

    topk: int = 10
    depth: int = 6
    total_tokens: int = 32

    def __post_init__(self):
        for name, flag in (("topk", "--tree-topk"), ("depth", "--tree-depth"), ("total_tokens", "--tree-tokens")):
            if getattr(self, name) < 1:
                raise EngineError(f"{flag} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class DrafterSpec:
    """What drafts each round: ``name`` (a ``DRAFTERS`` key, or ``auto``: the first the dir holds) with a
    chain of ``gamma`` tokens, or, for a drafter that drafts trees (eagle3), the ``tree``."""

    name: str = AUTO
    gamma: int = DEFAULT_GAMMA
    tree: TreeShape | None = None

    def __post_init__(self):
        if self.name != AUTO and self.name not in DRAFTERS:
            raise EngineError(f"--drafter {self.name!r}: expected one of {', '.join(DRAFTER_CHOICES)}")
        if self.gamma < 1:
            raise EngineError(f"--gamma must be >= 1, got {self.gamma}")
        if self.tree is not None and self.name != AUTO and not DRAFTERS[self.name].tree:
            raise EngineError(f"--tree-* options: the {self.name} drafter drafts chains (use --gamma), only "
                              f"{', '.join(n for n, k in DRAFTERS.items() if k.tree)} drafts trees")

    @classmethod
    def from_options(cls, drafter: str = AUTO, gamma: int | None = None, tree_topk: int | None = None,
                     tree_depth: int | None = None, tree_tokens: int | None = None) -> DrafterSpec:
        """From CLI-style options: any tree option asks for a tree (the others take TreeShape's defaults)."""
        given = {k: v for k, v in (("topk", tree_topk), ("depth", tree_depth), ("total_tokens", tree_tokens))
                 if v is not None}
        if given and gamma is not None:
            raise EngineError("--gamma sets a chain, --tree-* a tree: give one or the other")
        return cls(drafter, DEFAULT_GAMMA if gamma is None else gamma, TreeShape(**given) if given else None)

    def resolve(self, es: EngineSet) -> DrafterSpec:
        """This spec with ``auto`` replaced by the first drafter the dir holds (one that drafts trees, if a
        tree is asked for); an explicit name is checked against what the dir holds."""
        name = self.name
        if name == AUTO:
            name = next(n for n, k in DRAFTERS.items() if k.holds(es))
            if self.tree is not None and not DRAFTERS[name].tree:
                raise EngineError(f"{es.directory or es.manifest.name}: --tree-* needs an EAGLE3 head, which the "
                                  "dir does not hold; rebuild with --eagle3, or use --gamma")
        kind = DRAFTERS[name]
        if not kind.holds(es):
            other = next(n for n, k in DRAFTERS.items() if k.holds(es))
            raise EngineError(f"{es.directory or es.manifest.name}: holds no {kind.what}; rebuild with "
                              f"{kind.rebuild}, or use --drafter {other}")
        return DrafterSpec(name, self.gamma, self.tree)

    @property
    def label(self) -> str:
        """``plain``, ``eagle3 chain g=4``, ``eagle3 tree 10/6/32``, ``draft-model g=2`` (bench rows); "chain"
        is said only for drafters that also draft trees."""
        if self.name == "none":
            return "plain"
        if self.tree is not None:
            return f"{self.name} tree {self.tree.topk}/{self.tree.depth}/{self.tree.total_tokens}"
        chain = "chain " if self.name in DRAFTERS and DRAFTERS[self.name].tree else ""
        return f"{self.name} {chain}g={self.gamma}"


@dataclass(frozen=True)
class DrafterKind:
    """A drafter: the graphs it runs (``what`` the dir must hold, added by the export option ``rebuild``),
    ``make(es, spec)`` building it, and whether it drafts trees."""

    graphs: tuple[str, ...]
    make: Callable[[EngineSet, DrafterSpec], Drafter]
    what: str = ""
    rebuild: str = ""
    tree: bool = False

    def holds(self, es: EngineSet) -> bool:
        return all(g in es.engines for g in self.graphs)


def _none(es: EngineSet, spec: DrafterSpec) -> Drafter:
    from xcompile.runtime.drafters import NoDrafter

    return NoDrafter()


def _draft_model(es: EngineSet, spec: DrafterSpec) -> Drafter:
    from xcompile.runtime.drafters import DraftModelDrafter

    return DraftModelDrafter(es.engines[DRAFT], spec.gamma)


def _eagle3(es: EngineSet, spec: DrafterSpec) -> Drafter:
    from xcompile.runtime.drafters import Eagle3ChainDrafter, Eagle3TreeDrafter

    e = es.engines
    if spec.tree is not None:
        t = spec.tree
        return Eagle3TreeDrafter(e[EAGLE3], e[EAGLE3_FC], es.d2t, topk=t.topk, depth=t.depth,
                                 total_tokens=t.total_tokens)
    return Eagle3ChainDrafter(e[EAGLE3], e[EAGLE3_FC], es.d2t, spec.gamma)


# order is auto's preference (module docstring); "none" holds always, so auto always finds one
DRAFTERS: dict[str, DrafterKind] = {
    "eagle3": DrafterKind((EAGLE3, EAGLE3_FC), _eagle3, "EAGLE3 head", "--eagle3", tree=True),
    "draft-model": DrafterKind((DRAFT,), _draft_model, "draft model", "--draft-model"),
    "none": DrafterKind((), _none),
}
DRAFTER_CHOICES = (AUTO, *DRAFTERS)


def make_drafter(es: EngineSet, spec: DrafterSpec | str = AUTO) -> Drafter:
    """The drafter ``spec`` asks for (a name alone: its default chain), from what the engine dir holds."""
    spec = (DrafterSpec(spec) if isinstance(spec, str) else spec).resolve(es)
    return DRAFTERS[spec.name].make(es, spec)
