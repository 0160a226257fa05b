"""``xcompile diff``: an engine dir against the PyTorch reference, teacher-forced, through Polygraphy.

    reference pass  the torch reference runs prefill, ``steps`` greedy decode steps and an EAGLE3
                    draft pass (fc, prompt pass, ``draft_steps`` draft steps), and the same draft pass of
                    an MTP module over the target's last layer output; its tokens and hidden states
                    become every step's feed, so a near-tie flip cannot desync the engine
    Comparator.run  per graph, two Polygraphy runners over those feeds: the reference and the engine
                    (our ORT or TensorRT backend; the KV cache stays in place across iterations)
    compare         per step and output, scale-aware (compile/compare.py): hidden states by their
                    max error relative to the reference's max |value| and the least cosine similarity
                    of their rows; logits by max abs error and top-1/top-5 agreement

``save`` writes (staged, runtime/common/files.py), per graph, ``<graph>.inputs.json`` (complete graph
inputs: the reference's KV before each step included) and ``<graph>.reference.json`` (reference
RunResults), so ``polygraphy run <dir>/<graph>.onnx --onnxrt --load-inputs ... --load-outputs ...``
re-checks every step statelessly; ``<graph>.results.json`` holds both runners' outputs. Polygraphy is imported
here and in compile/diff_runners.py (the runners and the reference recorder), and these modules only by the
``diff`` command.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from polygraphy.comparator import Comparator, RunResults
from polygraphy.json import save_json
from polygraphy.logger import G_LOGGER

from xcompile.compile.compare import DEFAULT_ATOL, DEFAULT_RTOL, MIN_COSINE, StepResult, compare, tolerances
from xcompile.compile.diff_runners import EngineRunner, Graph, Recorder, greedy, load_graphs, step_feed
from xcompile.compile.errors import CompileError, CompileOptionError
from xcompile.runtime.common import files, logs
from xcompile.runtime.common.errors import XcompileError
from xcompile.runtime.enginedir.contract import DRAFT, EAGLE3, EAGLE3_FC, MTP, TARGET
from xcompile.runtime.enginedir.manifest import Manifest
from xcompile.runtime.engines.torch_module import TorchEngine

REFERENCE, ENGINE = "reference", "engine"
DEFAULT_PROMPT_LEN = 8


@dataclass(frozen=True)
class DiffOptions:
    """What ``xcompile diff`` asks for (see the CLI options)."""

    backend: str = "ort"                        # "ort" | "trt"
    device: str | None = None                   # default: cpu for ort, cuda for trt
    prompt: str | None = None                   # text, tokenized with the dir's tokenizer
    prompt_ids: tuple[int, ...] | None = None
    steps: int = 4                              # greedy decode steps after the prefill
    draft_steps: int = 3                        # EAGLE3 draft steps after its prompt pass
    atol: dict[str, float] = field(default_factory=dict)    # output -> max abs error; "" = every output
    rtol: dict[str, float] = field(default_factory=dict)    # output -> max error / max |reference|
    save: Path | None = None
    unquantized: Path | None = None             # the target's unquantized checkpoint: agreement reported too


# the target's config fields that fix every weight shape: an unquantized checkpoint must have the same
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings")


@dataclass
class DiffReport:
    """Every StepResult of a diff, with its settings; ``table`` and ``to_json`` render it."""

    engine_dir: str
    backend: str
    dtype: str
    prompt_ids: list[int]
    atol: dict[str, float]
    rtol: dict[str, float]
    results: list[StepResult] = field(default_factory=list)
    reproduce: list[str] = field(default_factory=list)     # polygraphy commands re-checking saved files
    # with --unquantized: the target engine's logits against the unquantized model's on the same feeds (reported,
    # not judged: the difference is the quantization's error): checkpoint, rows, top1, max_abs
    unquantized: dict | None = None

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "passed": self.passed}, indent=2) + "\n"

    def table(self) -> str:
        lines = [f"{'graph':<10} {'step':<9} {'output':<14} {'max_abs':>10} {'max_rel':>10} {'cosine':>9} "
                 f"{'top1':>5} {'top5':>5}"]
        for r in self.results:
            t1, t5 = ("" if t is None else f"{t:.2f}" for t in (r.top1, r.top5))
            lines.append(f"{r.graph:<10} {r.step:<9} {r.output:<14} {r.max_abs:>10.3g} {r.max_rel:>10.3g} "
                         f"{r.cosine:>9.6f} {t1:>5} {t5:>5}  {'ok' if r.passed else 'FAIL ' + r.why}")
        if self.reproduce:
            lines += ["re-check the saved files with:", *self.reproduce]
        if self.unquantized is not None:
            u = self.unquantized
            lines.append(f"target vs the unquantized model ({u['checkpoint']}): top-1 agreement {u['top1']:.3f} over "
                         f"{u['rows']} logit rows, max |logit difference| {u['max_abs']:.3g} (reported, not judged)")
        failed = sum(not r.passed for r in self.results)
        lines.append("PASSED" if not failed else f"FAILED: {failed} of {len(self.results)} checks exceed the tolerances "
                     f"(atol {self.atol}, rtol {self.rtol}, min cosine {MIN_COSINE[self.dtype]}; {self.backend} vs "
                     f"torch, {self.dtype})")
        return "\n".join(lines)


def _reference_pass(graphs: dict[str, Graph], prompt: list[int], opts: DiffOptions, manifest: Manifest,
                    d2t: dict[str, torch.Tensor]) -> dict[str, Recorder]:
    batch = manifest.max_batch
    keep = opts.save is not None
    ids = torch.tensor([prompt] * batch, dtype=torch.int64)
    n = len(prompt)
    runs = {}
    prefill: dict = {}                  # the target's prompt pass, which the EAGLE3 head reads (a dir always has one)
    for name in (TARGET, DRAFT):
        if name in graphs:
            rec = runs[name] = Recorder(graphs[name], keep)
            out = rec("prefill", step_feed(ids, 0, [n - 1]))
            if name == TARGET:
                prefill = out
            for i in range(opts.steps):
                out = rec(f"decode{i + 1}", step_feed(greedy(out["logits"]), n + i, [0]))
    # pairing: draft position t reads target feature t and token t+1 (docs/eagle3.md §3.1)
    shifted = torch.cat([ids[:, 1:], greedy(prefill["logits"])], dim=1)
    for graph in (EAGLE3, MTP):
        if graph not in graphs:
            continue
        taps = prefill["hidden_taps"]
        cols = manifest.tap_columns(graph)
        taps = taps if cols is None else taps[..., cols].contiguous()
        if graph == EAGLE3:
            fc = runs[EAGLE3_FC] = Recorder(graphs[EAGLE3_FC], keep)
            taps = fc("fc", {"hidden_taps": taps})["hidden_states"]
        head = runs[graph] = Recorder(graphs[graph], keep)
        out = head("prompt", step_feed(shifted, 0, [n - 1], taps))
        for j in range(opts.draft_steps):
            draft = greedy(out["logits"])
            if graph in d2t:
                draft = draft + d2t[graph][draft]                            # target = draft + d2t[draft]
            out = head(f"draft{j + 1}", step_feed(draft, n + j, [0], out["hidden_out"][:, -1:]))
    return runs


# --------------------------------------------------------------------------------------------
# against the unquantized model


def check_unquantized(directory: Path, checkpoint: Path, manifest: Manifest | None = None) -> None:
    """Raise where ``--unquantized checkpoint`` cannot be compared with ``directory``'s target: the target is
    not quantized, or the checkpoint is quantized or of another shape (its config's SHAPE_FIELDS)."""
    from xcompile.compile.hf_config import read_json

    manifest = manifest or Manifest.load(directory)
    record = manifest.models[TARGET].extra.get("quantization")
    if record is None or record.get("loaded_as") != "quantized":
        raise CompileError(f"--unquantized: {directory}'s target holds no quantized weights (its manifest records no "
                           "models.target.extra.quantization with loaded_as quantized); it applies to the export of a "
                           "quantized checkpoint")
    config = Path(checkpoint) / "config.json"
    if not config.is_file():
        raise CompileError(f"--unquantized: {config} not found; give the unquantized checkpoint's directory")
    data = read_json(config)
    if "quantization_config" in data:
        raise CompileError(f"--unquantized: {config} has a quantization_config; give the checkpoint the quantized "
                           "one was made from (its float weights)")
    want = manifest.models[TARGET].config
    differ = [f"{k} {data.get(k)} (the target's {want.get(k)})" for k in SHAPE_FIELDS if data.get(k) != want.get(k)]
    if differ:
        raise CompileError(f"--unquantized: {config} is not the target's shape: {', '.join(differ)}; give the "
                           "checkpoint the quantized one was made from")


@torch.inference_mode()
def unquantized_agreement(checkpoint: Path, graph: Graph, rec: Recorder, engine_logits: list[torch.Tensor],
                          device: str) -> dict:
    """The unquantized model run on the target's teacher-forced feeds, its logits against the engine's:
    top-1 agreement over every logit row, and the max absolute difference."""
    from xcompile.compile.checkpoint import load_qwen3

    module = load_qwen3(Path(checkpoint), graph.module.max_seq_len, dtype=graph.engine.dtype, device=device)
    engine = TorchEngine(module, graph.spec, graph.kv, graph.engine.dtype, graph.engine.device)
    engine.new_kv()
    agree = rows = 0
    max_abs = 0.0
    for feed, got in zip(rec.feeds, engine_logits):
        want = engine.run(**{k: v.to(engine.device) for k, v in feed.items()})["logits"].float().cpu()
        got = torch.as_tensor(got).float()
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        rows += want[..., 0].numel()
        max_abs = max(max_abs, float((want - got).abs().max()))
    engine.close()
    return {"checkpoint": str(checkpoint), "rows": rows, "top1": agree / rows, "max_abs": max_abs}


# --------------------------------------------------------------------------------------------
# compare


def run_diff(directory: Path, opts: DiffOptions = DiffOptions()) -> DiffReport:
    """Compare every graph of ``directory`` with the PyTorch reference; see the module docstring."""
    if opts.backend not in ("ort", "trt"):
        raise CompileOptionError(f"--backend {opts.backend!r}: expected ort or trt")
    directory = Path(directory)
    manifest = Manifest.load(directory)
    device = opts.device or ("cuda" if opts.backend == "trt" else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise CompileOptionError(f"--backend {opts.backend} on {device}: no CUDA device here; the engine is not runnable "
                           "on this machine (use --backend ort on cpu)")
    if opts.unquantized is not None:
        check_unquantized(directory, opts.unquantized, manifest)
    prompt = _prompt(directory, manifest, opts)
    save = files.staged_dir(opts.save, "xcompile diff", inputs=[directory], replace=True, option="--save",
                            same_only=True) \
        if opts.save is not None else contextlib.nullcontext()
    with save as save_dir:
        graphs = load_graphs(directory, manifest, opts.backend, device)
        # the draft vocabularies' maps: an EAGLE3 head's, an MTP module's when it has one
        d2t = {g: graphs[g].module.d2t.cpu() for g in (EAGLE3, MTP)
               if g in graphs and hasattr(graphs[g].module, "d2t")}
        runs = _reference_pass(graphs, prompt, opts, manifest, d2t)
        report = DiffReport(str(directory), opts.backend, manifest.dtype, prompt,
                            {"": DEFAULT_ATOL[manifest.dtype], **opts.atol}, {"": DEFAULT_RTOL[manifest.dtype],
                                                                               **opts.rtol})
        # Polygraphy's per-iteration chatter (and its logging of failures this report tabulates) only at -v,
        # and to stderr: stdout holds the report
        logs.bind_polygraphy(G_LOGGER)
        chatter = G_LOGGER.EXTRA_VERBOSE if logs.level() <= logging.DEBUG else G_LOGGER.CRITICAL
        for name, rec in logs.each(runs.items(), "diff", "graphs", note=lambda item: item[0]):
            g = graphs[name]
            runners = [EngineRunner(g.reference, g.spec, g.dims, REFERENCE),
                       EngineRunner(lambda e=g.engine: e, g.spec, g.dims, ENGINE)]
            with G_LOGGER.verbosity(chatter):
                try:
                    results = Comparator.run(runners, data_loader=rec.feeds)
                except XcompileError:
                    raise
                except Exception as e:   # Polygraphy raises PolygraphyException, ...: one line, cause kept
                    raise CompileError(f"{name}: comparison failed: {str(e).splitlines()[0]}") from e
            rows = [compare(name, label, output, results[REFERENCE][i][output], results[ENGINE][i][output],
                            tolerances(output, manifest.dtype, opts.atol, opts.rtol))
                    for i, label in enumerate(rec.labels) for output in results[REFERENCE][i]]
            report.results += rows
            if name == TARGET and opts.unquantized is not None:
                report.unquantized = unquantized_agreement(
                    opts.unquantized, g, rec, [results[ENGINE][i]["logits"] for i in range(len(rec.labels))], device)
            if save_dir is not None:
                with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
                    report.reproduce.append(_save(save_dir, opts.save, directory, manifest, name, rec, results, rows,
                                                  opts))
        if save_dir is not None:
            (save_dir / "report.json").write_text(report.to_json())
    return report


def _save(save: Path, shown: Path, directory: Path, manifest: Manifest, graph: str, rec: Recorder,
          results: RunResults, rows: list[StepResult], opts: DiffOptions) -> str:
    """Write the graph's Polygraphy files into ``save`` (to be renamed to ``shown``); returns the
    ``polygraphy run`` command that re-checks them (ONNX Runtime: fp32/fp16 graphs; bf16 feeds need
    ``--trt``). Polygraphy compares element-wise, so each output's bound is this run's own criterion
    as an absolute one: logits their atol, hidden states rtol x their largest reference |value|."""
    save_json(rec.full_feeds(), str(save / f"{graph}.inputs.json"))
    reference = RunResults()
    reference.append((REFERENCE, results[REFERENCE]))
    reference.save(str(save / f"{graph}.reference.json"))
    results.save(str(save / f"{graph}.results.json"))
    bounds: dict[str, float] = {}
    for r in rows:
        c = tolerances(r.output, manifest.dtype, opts.atol, opts.rtol)
        bound = c["atol"] if "atol" in c else c["rtol"] * (r.max_abs / r.max_rel if r.max_rel > 0 else 0.0)
        bounds[r.output] = max(bounds.get(r.output, 0.0), bound)
    atol = " ".join(f"{k}:{v:.3g}" for k, v in bounds.items())
    return (f"polygraphy run {directory / manifest.graphs[graph].onnx} --onnxrt "
            f"--load-inputs {shown / f'{graph}.inputs.json'} --load-outputs {shown / f'{graph}.reference.json'} "
            f"--atol {atol} --rtol 0 --check-error-stat max")


def _prompt(directory: Path, manifest: Manifest, opts: DiffOptions) -> list[int]:
    vocab = manifest.graphs[TARGET].dims["vocab"]
    if opts.prompt_ids is not None:
        ids = list(opts.prompt_ids)
    elif opts.prompt is not None:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise CompileError(f"{path}: not found, so --prompt cannot be tokenized; pass --prompt-ids")
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(path)).encode(opts.prompt, add_special_tokens=False).ids
    else:
        ids = [(7 * i + 3) % vocab for i in range(DEFAULT_PROMPT_LEN)]   # any fixed in-vocab ids
    given = "--prompt-ids" if opts.prompt_ids is not None else "--prompt" if opts.prompt is not None else None
    if len(ids) < 2:
        raise CompileOptionError(f"{given}: the prompt has {len(ids)} token(s); the EAGLE3 pass needs at least 2")
    if any(not 0 <= i < vocab for i in ids):
        raise CompileOptionError(f"{given}: prompt ids must lie in [0, {vocab}); got {ids}")
    need = len(ids) + max(opts.steps, opts.draft_steps) + 1
    if need > manifest.max_seq_len:
        steps = f"--steps {opts.steps}" if opts.steps >= opts.draft_steps else f"--draft-steps {opts.draft_steps}"
        raise CompileOptionError(f"{steps}: the prompt's {len(ids)} tokens and the steps need {need} cache rows; "
                                 f"{directory} holds {manifest.max_seq_len}; give fewer steps or a shorter prompt")
    return ids
