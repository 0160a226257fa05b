"""``xrun bench``: plain and speculative decoding speed against the bandwidth floor, in one run.

What one run measures (docs/performance.md has today's figures):
  - the device's copy bandwidth (bytes read + written per second) and, from the target's weight
    bytes per token, the decode floor;
  - plain greedy decode ms/token at each context length (the Generator with no drafter);
  - step costs at the first context: one draft step (EAGLE3 head, MTP module, draft model), the EAGLE3 fc,
    verifying k+1 tokens (k = 1..8), a tree verify — each with and without CUDA graphs; and the
    sampler's share of a round at the target's vocabulary (drawing a token, accepting a chain or a
    tree) with the bench's sampling parameters (greedy: the argmax paths);
  - whole speculative rounds at the first context (the others run plain decoding only; the report
    says so): the Generator with each drafter (EAGLE3 and MTP chains per gamma, trees, draft model) -> ms/round,
    measured acceptance length tau, tokens/s and speedup over plain, greedy or (``sampling``)
    speculative sampling with a fixed seed;
    and, beside them, the speedup a given tau would give (tau * decode / round), which is what
    synthetic weights can say (random heads accept nothing);
  - optionally a peer: Hugging Face ``generate()`` with a static cache on the same weights;
  - the prefill of the longest context's prompt (TTFT) against the matmul rate measured in the run;
  - the three drafting paradigms side by side (paradigms.py: alpha, gamma, draft / verify cost, tau, speedup).
Timings use CUDA events (or the host clock on the CPU), after warm-up, median of repeats. report.py writes the
report as text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from xcompile.runtime.bench.costs import (
    copy_bandwidth,
    kv_bytes,
    prefill_cost,
    sampler_costs,
    step_costs,
    step_sizes,
    weight_bytes,
)
from xcompile.runtime.bench.paradigms import paradigm_rows
from xcompile.runtime.common import logs
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.registry import DRAFTERS, DrafterSpec, TreeShape, make_drafter
from xcompile.runtime.decoding.sampling import GREEDY, SamplingParams
from xcompile.runtime.enginedir.contract import EAGLE3, MTP, TARGET
from xcompile.runtime.engines.load import EngineSet

_log = logs.logger("bench")
PUBLISHED_TAU = 3.7     # AngelSlim/Qwen3-8B_eagle3, mean acceptance length (docs/eagle3.md §7)


@dataclass
class BenchOptions:
    contexts: tuple[int, ...] = (128, 1024, 4096)
    gammas: tuple[int, ...] = (1, 2, 4, 6, 8)
    tree: TreeShape | None = field(default_factory=TreeShape)
    new_tokens: int = 64            # per generation
    repeats: int = 20               # per step timing
    peer: bool = False
    num_prompts: int = 2
    text_tokens: list[int] | None = None    # real text (e.g. held-out data): prompts are windows of it
    text_source: str = "the text"           # where text_tokens came from (a file), for the report
    taus: tuple[float, ...] = (2.0, 3.0, PUBLISHED_TAU)
    sampling: SamplingParams = GREEDY       # prompt i is sample i of the seed (give one: runs repeat)


def drafters(es: EngineSet, opts: BenchOptions) -> list[tuple[str, Callable[[], object]]]:
    """(label, make) of plain decoding and each drafter the dir holds: every chain of ``opts.gammas``,
    and the tree for drafters that draft trees."""
    specs = [DrafterSpec("none")]
    for name, kind in DRAFTERS.items():
        if kind.graphs and kind.holds(es):
            specs += [DrafterSpec(name, g) for g in opts.gammas]
            if kind.tree and opts.tree:
                specs.append(DrafterSpec(name, tree=opts.tree))
    return [(s.label, lambda s=s: make_drafter(es, s)) for s in specs]


def generation_rows(es: EngineSet, ctx: int, opts: BenchOptions, cuda_graphs: bool, prompts: list[list[int]],
                    which: list[tuple[str, Callable]], tick: Callable[[str], None] = lambda _: None) -> list[dict]:
    """One row per drafter of ``which``: whole generations over ``prompts``; ``tick(name)`` after each."""
    rows = []
    max_seq_len = es.manifest.max_seq_len
    if es.backend == "ort":                     # ORT's own CUDA graphs follow the row's mode (engines/ort.py)
        for engine in es.engines.values():
            engine.cuda_graphs = cuda_graphs
    for name, make in which:
        gen = Generator(es.engines[TARGET], make(), es.manifest.eos_token_ids and [], max_seq_len, options=LoopOptions(cuda_graphs=cuda_graphs))
        gen.generate(prompts[0], 4, sampling=opts.sampling)             # warm-up, graph capture
        decode_s = tokens = rounds = drafted = accepted = 0
        accepted_at = [0] * gen.drafter.max_depth
        for i, p in enumerate(prompts):
            r = gen.generate(p, opts.new_tokens, sampling=opts.sampling, index=i)
            s = r.stats
            decode_s += s.decode_s
            tokens += s.new_tokens - 1                  # the rounds' tokens: tau's numerator (Stats)
            rounds += s.rounds
            drafted += s.drafted
            accepted += s.accepted
            accepted_at = [a + b for a, b in zip(accepted_at, s.accepted_at)]
        rows.append({"context": ctx, "drafter": name, "paradigm": gen.drafter.name,
                     "block_size": gen.drafter.block_size, "cuda_graphs": cuda_graphs,
                     "ms_per_round": 1e3 * decode_s / max(rounds, 1), "ms_per_token": 1e3 * decode_s / max(tokens, 1),
                     "tokens_per_s": tokens / decode_s if decode_s else 0.0,
                     "tau": tokens / rounds if rounds else 0.0, "drafted": drafted, "accepted": accepted,
                     "acceptance_by_position": [a / rounds for a in accepted_at] if rounds else []})
        tick(name)
    return rows


def run_bench(es: EngineSet, opts: BenchOptions, log: Callable[[str], None] = print,
              peer: Callable[[list[int], int], float] | None = None) -> dict:
    dev = es.device
    s = opts.sampling
    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "dtype": es.manifest.dtype, "backend": es.backend, "model": es.manifest.name,
                    "max_seq_len": es.manifest.max_seq_len,
                    "quantization": es.manifest.models[TARGET].extra.get("quantization"),
                    "sampling": "greedy" if s.greedy else f"temperature {s.temperature} top_k {s.top_k} top_p {s.top_p} "
                                                          f"min_p {s.min_p} seed {s.seed}"}
    log("measuring copy bandwidth ...")
    bw = copy_bandwidth(dev)
    report["copy_bandwidth_gbs"] = bw / 1e9
    # the fast engines count the bytes they read (quantized projections as stored); else the dtype's
    wb = es.engines[TARGET].weight_bytes() or weight_bytes(es.manifest.models[TARGET].config, es.manifest.dtype)
    report["weight_bytes_per_token"] = wb
    report["floor_ms_per_token"] = 1e3 * wb / bw
    # per context, the floor counting the KV bytes a decode step reads too
    kv_dtype = es.engines[TARGET].kv_dtype
    report["kv_cache_dtype"] = str(kv_dtype).removeprefix("torch.")
    kv = {str(c): kv_bytes(es.manifest.models[TARGET].config, kv_dtype.itemsize, c) for c in opts.contexts}
    report["kv_bytes_per_token"] = kv
    report["floor_ms_by_context"] = {c: 1e3 * (wb + b) / bw for c, b in kv.items()}
    g = torch.Generator().manual_seed(0)
    vocab = es.manifest.models[TARGET].config["vocab_size"]
    graphs = dev.type == "cuda"
    tree_tokens = opts.tree.total_tokens if opts.tree and (EAGLE3 in es.engines or MTP in es.engines) else None
    report["steps"] = []
    report["generation"] = []
    with logs.progress("bench", _measurements(es, opts, graphs, tree_tokens, peer is not None), "measurements") as bar:
        _measure(es, opts, report, graphs, tree_tokens, g, vocab, log, peer, bar)
    if es.backend == "ort" and dev.type == "cuda":
        report["ort_cuda_graphs"] = {g: e.graph_fallback or ("used" if e.graphs_enabled else "off")
                                     for g, e in es.engines.items()}
        log(f"ORT CUDA graphs: {report['ort_cuda_graphs']}")
    if dev.type == "cuda":          # what the run needed at its peak: weights, KV buffers, graph pools, the prefill
        report["peak_memory_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
    if not report["generation"]:
        raise EngineError(f"nothing measured: no context of {list(opts.contexts)} fits the engine "
                          f"({es.manifest.max_seq_len} tokens) and the prompt text; give shorter --contexts")
    _derive(report, opts)
    report["paradigms"] = paradigm_rows(report)
    report["prompts"], report["notes"] = _caveats(es, opts, report)
    return report


def _caveats(es: EngineSet, opts: BenchOptions, report: dict) -> tuple[str, list[str]]:
    """What the prompts were, and what the figures do not cover, said plainly (report and JSON)."""
    if opts.text_tokens is not None:
        prompts = f"windows of {opts.text_source} ({len(opts.text_tokens)} tokens)"
    elif es.directory is None:
        prompts = ("random token ids on synthetic weights (their tau says nothing about real acceptance; the "
                   "x@tau columns give the speedup at a real tau)")
    else:
        prompts = "random token ids (tau on random ids says nothing about real acceptance; give --prompts FILE)"
    notes = []
    spec = report["speculation_context"]
    plain_only = sorted({r["context"] for r in report["generation"]} - {spec})
    if plain_only:
        notes.append(f"speculative decoding and step costs measured at context {spec} only; context"
                     f"{'s' if len(plain_only) > 1 else ''} {', '.join(map(str, plain_only))} ran plain decoding only")
    return prompts, notes


def _measurements(es: EngineSet, opts: BenchOptions, graphs: bool, tree_tokens: int | None, peer: bool) -> int:
    """How many measurements ``_measure`` makes, for the progress bar: every drafter (in both graph
    modes on CUDA), the step costs and the peer at the first context that fits; plain decoding at
    the others."""
    room = round_room(opts.gammas, opts.tree)
    fits = sum(context_fits(c, opts.new_tokens, es.manifest.max_seq_len, room) for c in opts.contexts)
    first = len(drafters(es, opts)) * (2 if graphs else 1) + sum(map(len, step_sizes(es, opts, tree_tokens).values()))
    return (first + peer + fits - 1 + 1) if fits else 0        # + 1: the prefill


def _measure(es: EngineSet, opts: BenchOptions, report: dict, graphs: bool, tree_tokens: int | None,
             g: torch.Generator, vocab: int, log: Callable[[str], None], peer, bar) -> None:
    """The measurements of ``run_bench`` into ``report``; the first context that fits gets them all, the
    longest one that fits a prefill."""
    first, longest = True, 0
    for ctx in opts.contexts:
        if not context_fits(ctx, opts.new_tokens, es.manifest.max_seq_len, round_room(opts.gammas, opts.tree)):
            log(f"context {ctx}: skipped, the engine holds {es.manifest.max_seq_len} tokens")
            continue
        prompts = _prompts(opts, ctx, vocab, g)
        if prompts is None:
            log(f"context {ctx}: skipped, the text holds fewer than {opts.num_prompts} windows of {ctx} tokens")
            continue
        which = drafters(es, opts) if first else drafters(es, opts)[:1]       # later contexts: plain only
        if first:
            report["speculation_context"] = ctx
        for use_graphs in ([True, False] if graphs and first else [graphs]):
            log(f"context {ctx}: generation ({'CUDA graphs' if use_graphs else 'eager'}) ...")
            report["generation"] += generation_rows(es, ctx, opts, use_graphs, prompts, which,
                                                    tick=lambda name: _tick(bar, f"{ctx}: {name}"))
        if first:
            log(f"context {ctx}: step costs ...")
            report["steps"] += [{"context": ctx, **r} for r in step_costs(
                es, ctx, opts, tree_tokens, tick=lambda step: _tick(bar, f"{ctx}: step {step}"))]
            report["steps"] += [{"context": ctx, **r} for r in sampler_costs(es, opts, tree_tokens)]
        if peer is not None and first:
            log(f"context {ctx}: peer (transformers generate, static cache) ...")
            report["peer_ms_per_token"] = peer(prompts[0], opts.new_tokens)
            _tick(bar, f"{ctx}: peer")
        first = False
        longest = max(longest, ctx)
    if longest:
        log(f"prefill of {longest} tokens ...")
        report["prefill"] = prefill_cost(es, longest)
        _tick(bar, f"prefill {longest}")


def _tick(bar, what: str) -> None:
    """One measurement done: the bar advances (a terminal), a debug line says which (-v, any output)."""
    bar.advance(note=what)
    _log.debug(f"measured {what}")


def round_room(gammas: Sequence[int], tree: TreeShape | None) -> int:
    """KV slots the widest round of ``gammas`` / ``tree`` writes past the text (64 at least)."""
    return max([64, *(g + 1 for g in gammas), tree.lookahead if tree else 0])


def context_fits(ctx: int, new_tokens: int, max_seq_len: int, room: int = 64) -> bool:
    """Whether a context of ``ctx`` tokens leaves an engine of ``max_seq_len`` room for the generation
    (at least 64 tokens) and a round's lookahead (``room``, from round_room)."""
    return ctx + max(64, new_tokens) + room <= max_seq_len


def _prompts(opts: BenchOptions, ctx: int, vocab: int, g: torch.Generator) -> list[list[int]] | None:
    """``num_prompts`` prompts of ``ctx`` tokens: consecutive windows of the text, else random ids."""
    if opts.text_tokens is None:
        return [torch.randint(0, vocab, (ctx,), generator=g).tolist() for _ in range(opts.num_prompts)]
    t = opts.text_tokens
    if len(t) < opts.num_prompts * ctx:
        return None
    return [t[i * ctx:(i + 1) * ctx] for i in range(opts.num_prompts)]


def _derive(report: dict, opts: BenchOptions) -> None:
    """Speedups over plain decoding at the same context and graph mode, measured and at given taus."""
    plain = {(r["context"], r["cuda_graphs"]): r for r in report["generation"] if r["drafter"] == "plain"}
    for r in report["generation"]:
        base = plain.get((r["context"], r["cuda_graphs"]))
        if base is None:
            continue
        r["speedup_e2e"] = base["ms_per_token"] / r["ms_per_token"] if r["ms_per_token"] else 0.0
        r["round_over_decode"] = r["ms_per_round"] / base["ms_per_token"] if base["ms_per_token"] else 0.0
        if r["drafter"] != "plain":
            r["speedup_at_tau"] = {str(t): t / r["round_over_decode"] for t in opts.taus if r["round_over_decode"]}
    if "floor_ms_per_token" in report:
        by_context = report.get("floor_ms_by_context", {})
        for r in report["generation"]:
            if r["drafter"] == "plain":
                floor = by_context.get(str(r["context"]), report["floor_ms_per_token"])
                r["fraction_of_floor"] = floor / r["ms_per_token"]
