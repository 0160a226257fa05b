"""``xcompile build``'s engine step: the ONNX graphs of an engine dir -> TensorRT or TensorRT-RTX engines.

Composed from Polygraphy-style loaders (compile/trt_loaders.py: parse -> check -> config -> engine
file), one engine per graph, recorded in the manifest:

    target   two optimization profiles: prefill (tokens 1..max_seq_len) and decode/verify
             (tokens 1..max_draft_tokens+1); ``rows`` follows ``tokens``. One engine keeps one copy
             of the weights; the runtime picks the profile by the number of tokens.
    eagle3, eagle3_fc, mtp, draft   one engine each, same two profiles.

Strongly typed (the ONNX dtype is the engine's; TensorRT 11 and TRT-RTX know no other mode); fp32
graphs mark attention decomposable (no fused fp32 kernel). Quantized weights (DequantizeLinear over FP8 or INT4
codes, compile/qdq.py) need no builder flag either: in a strongly typed network the codes' types say it. Full TensorRT reuses a timing cache in
the engine dir; TRT-RTX ignores timing caches and builds ahead of time, on CPU-only machines too,
for the compute capabilities asked. An engine whose inputs (ONNX sha256, flavor, version, targets,
profiles) are unchanged is kept.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from xcompile.compile.errors import CompileError, CompileOptionError
from xcompile.compile.trt_loaders import (
    EngineFileFromNetwork,
    Progress,
    compute_capability,
    create_config,
    failure,
    inspect_network,
    polygraphy_backend,
    polygraphy_errors,
    profile_shapes,
    progress_monitor,
)
from xcompile.plugins.registry import PluginError, load_plugins
from xcompile.runtime.common import files, interrupts, logs
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import DTYPES, GraphSpec, dynamic_ranges, graph_spec
from xcompile.runtime.enginedir.manifest import EngineEntry, Manifest, kv_layers
from xcompile.runtime.engines.trt_flavor import FLAVOR_NAMES, import_trt, resolve_flavor

# decode/verify profile: up to 64 tokens, enough for the 60-node EAGLE trees of AngelSlim and
# TensorRT-Edge-LLM (--maxVerifyTreeSize 60) and for any chain up to 63 drafts
DEFAULT_MAX_DRAFT_TOKENS = 63
# prefill profile's opt point: a typical prompt (TensorRT tunes kernels for opt)
PREFILL_OPT_TOKENS = 512
# host memory a build takes per byte of weights: TRT-RTX 1.7 building Qwen3-0.6B bf16 (1.2 GB of
# weights, two profiles, SM 8.9) peaked at 4.06 GB RSS, parsing from file or from mmapped weights alike
BUILDER_RAM_PER_WEIGHT_BYTE = 3.1


@dataclass(frozen=True)
class ProfileSpec:
    """One optimization profile: (min, opt, max) of the contract's dynamic dims."""

    name: str
    tokens: tuple[int, int, int]
    rows: tuple[int, int, int]

    def as_dict(self) -> dict:
        return {"name": self.name, "tokens": list(self.tokens), "rows": list(self.rows)}


def default_profiles(max_seq_len: int, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS) -> list[ProfileSpec]:
    """Prefill (1..max_seq_len tokens, usually one logits row) and decode/verify (1..k+1 tokens and rows)."""
    k = min(max_draft_tokens + 1, max_seq_len)
    return [ProfileSpec("prefill", (1, min(PREFILL_OPT_TOKENS, max_seq_len), max_seq_len), (1, 1, max_seq_len)),
            ProfileSpec("decode", (1, k, k), (1, k, k))]


@dataclass(frozen=True)
class BuildOptions:
    """What ``xcompile build`` asks of the engine step."""

    flavor: str = "auto"                        # "auto" | "tensorrt" | "rtx"
    compute_capabilities: tuple[str, ...] = ()  # TRT-RTX targets ("8.9", "12.0"); () = its default set
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS
    force: bool = False                         # rebuild engines even when their inputs are unchanged
    # builder controls, as trtexec's --memPoolSize=workspace / --builderOptimizationLevel / --timingCacheFile
    workspace: int | None = None                # WORKSPACE memory pool limit, bytes (None: TensorRT's, the device's)
    optimization_level: int | None = None       # 0..5 (None: TensorRT's default, 3)
    timing_cache: Path | None = None            # full TensorRT only (None: <engine dir>/timing.cache)

    def builder(self) -> dict:
        """The controls that change the engine, as its manifest entry records them (unset ones omitted)."""
        return {k: v for k, v in (("workspace", self.workspace), ("optimization_level", self.optimization_level))
                if v is not None}


# --------------------------------------------------------------------------------------------
# one engine


def engine_entry(graph: str, flavor: str, trt, ccs: list[str], profiles: list[ProfileSpec], onnx_sha256: str,
                 builder: dict | None = None) -> EngineEntry:
    """The manifest entry an engine built with these inputs gets (compared to skip unchanged rebuilds)."""
    return EngineEntry(file=f"{graph}.engine", graph=graph, flavor=flavor, trt_version=trt.__version__,
                       compute_capabilities=list(ccs), profiles=[p.as_dict() for p in profiles],
                       onnx_sha256=onnx_sha256, builder=dict(builder or {}))


def build_engine(onnx: Path, engine: Path, spec: GraphSpec, dtype: str, profiles: list[ProfileSpec], *,
                 flavor: str, compute_capabilities: tuple[tuple[int, int], ...] = (), max_batch: int = 1,
                 timing_cache: Path | None = None, builder: dict | None = None, progress: Progress = print
                 ) -> dict:
    """Parse ``onnx``, check it against ``spec``, build and write ``engine``; returns the engine file's
    record (size and hashes, runtime/enginedir/integrity.py). ``dtype``: "fp32"|"fp16"|"bf16"; ``builder``:
    BuildOptions.builder() (workspace bytes, optimization level).

    SIGINT/SIGTERM cancel the build within a builder step: TensorRT calls the progress monitor
    between steps and swallows exceptions raised there, so the signal is held (runtime/common/interrupts.py),
    the monitor returns False (cancel) and the interrupt is raised once the builder has returned."""
    trt, poly = polygraphy_backend(flavor)
    try:
        load_plugins(trt)
    except PluginError as e:
        raise CompileError(str(e)) from None
    label = onnx.name
    with polygraphy_errors() as errors:
        start = time.monotonic()
        progress(f"  {label}: parsing with the {FLAVOR_NAMES[flavor]} {trt.__version__} ONNX parser")
        try:
            parsed = poly.NetworkFromOnnxPath(str(onnx), strongly_typed=True)()
        except Exception as e:          # Polygraphy raises PolygraphyException after logging the parser's errors
            raise failure(f"{onnx}: the {FLAVOR_NAMES[flavor]} parser rejected the graph", errors, e) from None
        report = inspect_network(parsed[1], spec, DTYPES[dtype], trt)
        if report.problems:
            raise CompileError(f"{onnx}: graph does not follow the I/O contract: {'; '.join(report.problems)}; "
                               "re-export it")
        progress(f"  {label}: parsed in {time.monotonic() - start:.1f}s ({report.attention} attention, "
                 f"{report.rope} RoPE, {len(report.kv_updates)} KV-cache-update layers)")
        shapes = [profile_shapes(parsed[1], spec, {**dynamic_ranges(p.tokens, p.rows), "batch": (1, 1, max_batch)})
                  for p in profiles]
        # the exporter's attention masks are additive floats: TRT-RTX 1.7 fails to build a boolean
        # mask shared by several attention layers ("Graph contains more than one op named <mask>_iota")
        network = parsed
        if dtype == "fp32":
            network = poly.SetDecomposableAttentions(network)      # no fused fp32 attention kernel
        start = time.monotonic()
        with interrupts.deferred() as interrupted:
            config = create_config(trt, poly, flavor, shapes, compute_capabilities, timing_cache,
                                   progress_monitor(trt, progress, label, cancel=interrupted), **(builder or {}))
            try:
                with warnings.catch_warnings():
                    # Polygraphy always attaches a timing cache; TRT-RTX deprecates them as no-ops
                    warnings.filterwarnings("ignore", "Use Deprecated in TensorRT-RTX", DeprecationWarning)
                    record = EngineFileFromNetwork(trt, network, config, engine, timing_cache)()
            except Exception as e:
                raise failure(f"{onnx}: {FLAVOR_NAMES[flavor]} could not build the engine", errors, e) from None
    progress(f"  {label}: built {engine.name} ({record['size'] / 2**20:.1f} MiB) in {time.monotonic() - start:.1f}s")
    return record


# --------------------------------------------------------------------------------------------
# an engine dir


def build(directory: Path, options: BuildOptions = BuildOptions(), progress: Progress = print) -> Manifest:
    """Build one engine per ONNX graph of an exported engine dir and record them in its manifest.

    Staged like every write (runtime/common/files.py): the dir's files are hard-linked into a staging dir,
    the engines built there, and the whole renamed onto ``directory`` at the end, so an interrupted
    or failed build leaves the dir as it was. Engines whose inputs are unchanged are kept
    (``options.force`` rebuilds them)."""
    directory = Path(directory)
    open_manifest(directory)                            # a clear error for a dir that is not an engine dir
    with files.staged_dir(directory, "xcompile build", replace=True, option="engine dir") as tmp:
        files.link_tree(directory, tmp)
        return build_into(tmp, options, progress, shown=directory)


def open_manifest(directory: Path) -> Manifest:
    """The dir's manifest, or a CompileError naming what is wrong with it."""
    try:
        return Manifest.load(directory)
    except EngineError as e:
        raise CompileError(str(e)) from None


def graph_digest(manifest: Manifest, graph: str) -> str:
    """One hash of everything a graph's engine is built from: its ONNX file and external data."""
    return hashlib.sha256(" ".join(manifest.files[f]["sha256"] for f in manifest.graph_files(graph)).encode()
                          ).hexdigest()


def check_draft_tokens(options: BuildOptions, max_seq_len: int, where) -> None:
    """CompileOptionError for a --max-draft-tokens that leaves a verify no room in ``where``'s ``max_seq_len``:
    asked for, it is refused rather than capped (the default is capped to the dir's context)."""
    if options.max_draft_tokens != DEFAULT_MAX_DRAFT_TOKENS and options.max_draft_tokens >= max_seq_len:
        raise CompileOptionError(f"--max-draft-tokens {options.max_draft_tokens}: a verify of that many drafts and "
                                 f"its root exceeds {where}'s max_seq_len {max_seq_len}; give at most "
                                 f"{max_seq_len - 1}")


def build_into(directory: Path, options: BuildOptions, progress: Progress = print, shown: Path | None = None,
               check_graphs: bool = True) -> Manifest:
    """``build``'s work inside the staging dir ``directory`` (``shown``: the path to report). The
    builder reads every byte of a graph anyway, so each is first checked in full against the export's
    record (``check_graphs``; the caller that just exported or checked them passes False)."""
    manifest = open_manifest(directory)
    flavor = check_options(options)
    if not manifest.graphs:
        raise CompileError(f"{shown or directory}: the manifest lists no ONNX graphs; run `xcompile export` first")
    check_draft_tokens(options, manifest.max_seq_len, shown or directory)
    trt, _ = polygraphy_backend(flavor)
    if flavor == "rtx":
        ccs = tuple(compute_capability(c, trt) for c in options.compute_capabilities)
        recorded = [f"{a}.{b}" for a, b in ccs]
    else:
        ccs, recorded = (), [_local_compute_capability()]
    timing_cache = (options.timing_cache or directory / "timing.cache") if flavor == "tensorrt" else None
    profiles = default_profiles(manifest.max_seq_len, options.max_draft_tokens)
    progress(f"building {len(manifest.graphs)} engine(s) in {shown or directory} with {FLAVOR_NAMES[flavor]} "
             f"{trt.__version__}" + (f" for compute capability {', '.join(recorded)}" if recorded else ""))
    for graph, g in logs.each(manifest.graphs.items(), "build", "engines", note=lambda item: item[0]):
        try:
            if check_graphs:
                manifest.verify(directory, manifest.graph_files(graph), full=True)
        except EngineError as e:
            raise CompileError(str(e).replace(str(directory), str(shown or directory))) from None
        entry = engine_entry(graph, flavor, trt, recorded, profiles, graph_digest(manifest, graph), options.builder())
        if not options.force and manifest.engines.get(graph) == entry and _intact(manifest, directory, entry.file):
            progress(f"  {entry.file}: up to date, kept")
            continue
        spec = graph_spec(graph, kv_layers(g.io))      # what this version expects, not what was recorded
        onnx = directory / g.onnx
        warn_if_short_of_memory(onnx, progress)
        manifest.files[entry.file] = build_engine(
            onnx, directory / entry.file, spec, manifest.dtype, profiles, flavor=flavor, compute_capabilities=ccs,
            max_batch=manifest.max_batch, timing_cache=timing_cache, builder=options.builder(), progress=progress)
        manifest.engines[graph] = entry
    manifest.save(directory)
    return manifest


def check_options(options: BuildOptions) -> str:
    """The flavor ``options`` build with, every option checked against it before anything is exported
    or parsed: that flavor is installed, compute capabilities are TensorRT-RTX's and known to it, full
    TensorRT has a GPU to build on, a timing cache is asked only of the flavor that uses one."""
    try:
        flavor = resolve_flavor(options.flavor)
    except EngineError as e:
        raise CompileError(str(e)) from None
    if flavor != "rtx" and options.compute_capabilities:
        raise CompileOptionError("--compute-capability applies to TensorRT-RTX only; full TensorRT builds for the GPU "
                           "it runs on")
    if flavor == "rtx" and options.timing_cache is not None:
        raise CompileOptionError("--timing-cache applies to full TensorRT only; TensorRT-RTX keeps no timing cache "
                           "(it deprecates them as no-ops)")
    if flavor == "rtx":
        trt = import_trt(flavor)
        for c in options.compute_capabilities:
            compute_capability(c, trt)
    else:
        _local_compute_capability()
    return flavor


def _intact(manifest: Manifest, directory: Path, name: str) -> bool:
    try:
        manifest.verify(directory, [name])
        return True
    except EngineError:
        return False


def warn_if_short_of_memory(onnx: Path, progress: Progress) -> None:
    """Say so before a build that will likely be killed for memory (it takes minutes to get there)."""
    weights = sum(p.stat().st_size for p in onnx.parent.glob(onnx.name + "*"))
    need = BUILDER_RAM_PER_WEIGHT_BYTE * weights
    available = available_memory()
    if available is not None and need > available:
        progress(f"  warning: building {onnx.name} ({weights / 2**30:.1f} GiB of weights) takes about "
                 f"{need / 2**30:.0f} GiB of host memory, {available / 2**30:.0f} GiB are available; it may be killed "
                 "(build on a machine with more memory)")


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _local_compute_capability() -> str:
    """Full TensorRT builds for the GPU it runs on; record that GPU's compute capability."""
    import torch

    if not torch.cuda.is_available():
        raise CompileError("full TensorRT builds engines on a CUDA GPU and none is visible; use "
                           "--trt rtx --compute-capability X.Y to build TensorRT-RTX engines without a GPU")
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"
