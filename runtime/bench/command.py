"""``xrun bench`` as a function: open the engines (engine dir or synthetic), run, print, save."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from xcompile.runtime.bench.measure import BenchOptions, context_fits, round_room, run_bench
from xcompile.runtime.bench.report import format_report
from xcompile.runtime.common import files, logs
from xcompile.runtime.common.errors import EngineError, OptionError
from xcompile.runtime.decoding.registry import DRAFTERS, TreeShape, held
from xcompile.runtime.decoding.sampling import GREEDY, SamplingParams
from xcompile.runtime.enginedir.contract import EAGLE3, MTP
from xcompile.runtime.enginedir.manifest import Manifest
from xcompile.runtime.enginedir.text import Text
from xcompile.runtime.engines.load import EngineSet, fast_engines, open_engine_dir, pick_backend, torch_models
from xcompile.runtime.engines.run_checks import (
    check_backend_options,
    check_row_invariant,
    resolve_device,
    set_kv_cache_dtype,
)

log = logs.logger("bench")


@dataclass
class BenchRequest:
    engine_dir: str | None
    synthetic: str | None
    draft_model: str | None
    backend: str
    device: str | None
    dtype: str
    gammas: tuple[int, ...]
    tree: TreeShape | None
    contexts: tuple[int, ...]
    new_tokens: int
    repeats: int
    peer: bool
    json_path: str | None
    plot: str | None
    prompts: str | None = None
    num_prompts: int = 2
    verify: bool = False
    sampling: SamplingParams = GREEDY
    quantize: str | None = None         # --synthetic: the target's linears in fp8 or int4 (compile/reference.py)
    mtp: bool = False                   # --synthetic: an MTP module too
    kv_cache_dtype: str = "auto"        # or fp8: the target's KV cache in e4m3 (load.KV_CACHE_DTYPES)
    row_invariant: bool = False         # the fast target's KernelConfig.row_invariant
    yarn: float | None = None           # --synthetic: the target's RoPE stretched by YaRN (compile/reference.py)
    given: frozenset = frozenset()      # of gammas, tree: those set on the command line (refused where unused)

    def kernels(self):
        """The fast backend's KernelConfig asked for (None: the defaults)."""
        from xcompile.runtime.engines.kernels.config import KernelConfig
        return KernelConfig(row_invariant=True) if self.row_invariant else None


def _room(req: BenchRequest) -> int:
    """KV slots a synthetic bench needs: the longest context, its new tokens and one round's lookahead."""
    need = max(req.contexts) + max(64, req.new_tokens) + round_room(req.gammas, req.tree)     # context_fits
    return -(-need // 256) * 256


def open_engines(req: BenchRequest, device: torch.device, backend: str | None) -> EngineSet:
    """The engines to time; ``backend``: an engine dir's, from check_backend."""
    if req.engine_dir:
        return open_engine_dir(req.engine_dir, backend, str(device), verify=req.verify, kernels=req.kernels())
    if req.backend not in ("auto", "torch", "fast"):
        raise OptionError("--synthetic runs the torch or fast backend (no engine dir to load TensorRT or ONNX from)")
    if req.backend == "torch" or (req.backend == "auto" and device.type != "cuda"):
        check_row_invariant(req.kernels(), "torch")             # before the weights are drawn
    if req.backend != "auto":                                   # auto: torch or fast, whatever they hold
        check_backend_options(req.backend, device, req.kv_cache_dtype)
    provider = torch_models()
    manifest, engines, d2t = provider.open_synthetic(req.synthetic, _room(req), req.dtype, device,
                                                     eagle3=True, draft=req.draft_model, quantize=req.quantize,
                                                     mtp=req.mtp, yarn=req.yarn)
    backend = "torch" if req.backend == "auto" and device.type != "cuda" else req.backend
    if backend == "auto":
        backend = pick_backend(manifest, "auto", device)
    check_row_invariant(req.kernels(), backend)
    if backend == "fast":
        engines = fast_engines(manifest, engines, req.kernels())
    return EngineSet(None, manifest, backend, engines, d2t.get(EAGLE3), {"provider": provider}, d2t.get(MTP))


def check_backend(req: BenchRequest, manifest: Manifest, device: torch.device) -> str:
    """The backend the bench of an engine dir (its ``manifest``) runs on, after OptionError for one that cannot run
    what was asked."""
    backend = pick_backend(manifest, req.backend, device)
    check_row_invariant(req.kernels(), backend)
    check_backend_options(backend, device, req.kv_cache_dtype)
    if req.peer and backend not in ("torch", "fast"):
        raise OptionError(f"--peer compares on the reference modules' weights, and --backend {req.backend} runs "
                          f"{backend} here; add --backend torch or fast")
    if manifest.max_batch > 1 and backend in ("ort", "trt"):
        picked = f"--backend {backend}" if req.backend == backend else f"--backend auto (here {backend})"
        raise OptionError(f"{picked}: {req.engine_dir}'s graphs fix the batch at {manifest.max_batch} sequences "
                          "(exported with --max-batch), and xrun bench times one; use --backend torch or fast, or a "
                          "dir exported with --max-batch 1")
    drafters = [kind for kind in DRAFTERS.values() if kind.graphs and held(kind, manifest)]
    if "tree" in req.given and req.tree and not any(kind.tree for kind in drafters):
        raise OptionError(f"--tree: {req.engine_dir} holds no EAGLE3 head or MTP module, the drafters that draft "
                          "trees; drop --tree (or give --tree '') or export with --eagle3 or --mtp")
    if "gammas" in req.given and req.gammas and not drafters:
        raise OptionError(f"--gammas: {req.engine_dir} holds no drafter, so only plain decoding is timed; drop "
                          "--gammas (or give --gammas '') or export with --eagle3, --mtp or --draft-model")
    return backend


def check_contexts(req: BenchRequest, max_seq_len: int) -> None:
    """OptionError unless a round, --new-tokens and some context fit an engine dir of ``max_seq_len`` (a synthetic
    bench is sized for them all)."""
    room = round_room(req.gammas, req.tree)
    if room + 2 > max_seq_len:                      # a round beside a prompt of one token and one new token
        t = req.tree
        option = f"--tree {t.topk},{t.depth},{t.total_tokens}" if t and t.lookahead == room else \
            f"--gammas {max(req.gammas)}" if max(req.gammas, default=0) + 1 == room else None
        if option:
            raise OptionError(f"{option}: a round writes {room} KV slots, which leaves no room for a prompt in "
                              f"{req.engine_dir}'s max_seq_len {max_seq_len}; draft fewer")
        raise EngineError(f"{req.engine_dir}: max_seq_len {max_seq_len} is too short to bench (it needs "
                          f"{room + 2}); re-export with a larger --max-seq-len")
    if not context_fits(1, req.new_tokens, max_seq_len, room):
        raise OptionError(f"--new-tokens {req.new_tokens}: with a round's {room} KV slots that leaves no room for "
                          f"a context in {req.engine_dir}'s max_seq_len {max_seq_len}; give fewer")
    if not any(context_fits(c, req.new_tokens, max_seq_len, room) for c in req.contexts):
        raise OptionError(f"--contexts {','.join(map(str, req.contexts))}: none fits {req.engine_dir}, which holds "
                          f"{max_seq_len} tokens (a context needs room for --new-tokens and a round too); give "
                          "shorter contexts or rebuild with a larger --max-seq-len")


def check_synthetic_contexts(req: BenchRequest) -> None:
    """OptionError when the KV slots a synthetic bench needs (``_room``) pass the positions its model covers, or
    its --synthetic / --draft-model names no synthetic shape."""
    positions, source = torch_models().synthetic_positions(req.synthetic, req.yarn, req.draft_model)
    if (need := _room(req)) > positions:
        raise OptionError(f"--contexts {max(req.contexts)}: with --new-tokens and a round it needs {need} KV "
                          f"slots, past the synthetic {req.synthetic}'s {source}; give shorter --contexts"
                          + ("" if req.yarn else ", or --yarn 4 (131,072 positions, as Qwen3's model card sets)"))


def run(req: BenchRequest, echo: Callable[[str], None] = print) -> dict:
    """Open, measure (progress to the log), ``echo`` the report, then write --json / --plot."""
    device = resolve_device(req.device)
    backend = None
    if req.engine_dir:
        manifest = Manifest.load(req.engine_dir)
        backend = check_backend(req, manifest, device)
        check_contexts(req, manifest.max_seq_len)
    else:
        check_synthetic_contexts(req)
    inputs = (req.engine_dir, req.prompts)
    with contextlib.ExitStack() as outputs:
        # --json / --plot are staged (runtime/common/files.py) before anything is measured: an output that
        # cannot be written fails now, not after the whole run; an interrupted run leaves no file
        json_tmp, plot_tmp = (outputs.enter_context(files.staged_file(path, "xrun bench", inputs=inputs, option=opt))
                              if path else None for path, opt in ((req.json_path, "--json"), (req.plot, "--plot")))
        start = time.perf_counter()
        es = outputs.enter_context(open_engines(req, device, backend))
        set_kv_cache_dtype(es, req.kv_cache_dtype)
        log.info(f"# [{time.perf_counter() - start:7.1f} s] loaded {es.manifest.name} ({es.backend} on {es.device})")
        report = _measure(req, es, echo)
        echo(format_report(report))
        if json_tmp:
            json_tmp.write_text(json.dumps(report, indent=2))
        if plot_tmp:
            plot(report, plot_tmp, format=Path(req.plot).suffix.lstrip(".") or "png")
    return report


def _measure(req: BenchRequest, es: EngineSet, echo: Callable[[str], None]) -> dict:
    peer = None
    if req.peer:
        provider = es.extras.get("provider") or torch_models()
        # the fast engines' reference modules hold the very weights they run (re-pointed, not copied)
        engines = {g: e.reference for g, e in es.engines.items()} if es.backend == "fast" else es.engines
        peer = provider.hf_peer(engines)
    text_tokens = None
    if req.prompts:
        if es.directory is None:
            raise OptionError("--prompts needs an engine dir with a tokenizer (synthetic weights have none)")
        text_tokens = Text(es.directory).encode(Path(req.prompts).read_text())
    opts = BenchOptions(contexts=req.contexts, gammas=req.gammas, tree=req.tree, new_tokens=req.new_tokens,
                        repeats=req.repeats, peer=req.peer, num_prompts=req.num_prompts, text_tokens=text_tokens,
                        text_source=str(req.prompts), sampling=req.sampling)
    start = time.perf_counter()
    return run_bench(es, opts, log=lambda m: log.info(f"# [{time.perf_counter() - start:7.1f} s] {m}"), peer=peer)


def plot(report: dict, path: str | Path, format: str = "png") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EngineError("--plot needs matplotlib (pip install matplotlib)") from None
    rows = [r for r in report["generation"] if r["cuda_graphs"] == any(x["cuda_graphs"] for x in report["generation"])]
    paradigms = report.get("paradigms") or []
    fig, axes = plt.subplots(1, 2 if paradigms else 1, figsize=(15 if paradigms else 9, 4), squeeze=False)
    ax = axes[0][0]
    labels = [f"{r['drafter']} @{r['context']}" for r in rows]
    ax.barh(labels, [r["tokens_per_s"] for r in rows])
    if "floor_ms_per_token" in report:
        ax.axvline(1e3 / report["floor_ms_per_token"], color="k", linestyle="--", label="bandwidth floor (plain)")
        ax.legend()
    ax.set_xlabel("tokens/s")
    ax.set_title(f"{report['model']} on {report['device']} ({report['backend']}, {report['dtype']})")
    if paradigms:                       # the three paradigms: tau against the draft cost per verify (c)
        ax = axes[0][1]
        for p in paradigms:
            if p["draft_over_verify"] is not None:
                ax.scatter(p["draft_over_verify"], p["tau"], label=p["drafter"])
        ax.set_xlabel("c = draft cost / verify cost")
        ax.set_ylabel("tau (tokens per round)")
        ax.set_title("three paradigms")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format=format)
