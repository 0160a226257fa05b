"""Greedy agreement of the fast backend (or ONNX Runtime's CUDA provider) with the reference path on a real
trained model (the demo pair).

    xcompile export --model demo --eagle3 [--mtp] [--draft-model demo] --out /tmp/demo-bf16 --dtype bf16 --max-seq-len 1024
    python benchmarks/fast_agreement.py /tmp/demo-bf16 [--prompts data/corpus.heldout.txt] [--num-prompts 16]
        [--against fast|ort] [--gemv-all 4,64,4]
    python benchmarks/fast_agreement.py --synthetic qwen3-8b --num-prompts 8 --new-tokens 512
        [--fast-only] [--mtp] [--draft-model qwen3-0.6b] [--drafters eagle3,mtp,draft-model]

``--synthetic NAME`` takes seeded synthetic weights in a known shape instead of a dir (``xrun bench --synthetic``'s,
with an EAGLE3 head, and ``--mtp`` / ``--draft-model NAME`` as there; two copies, one for each backend, a minute each
to draw on the CPU) and random token prompts:
random heads accept next to nothing, so every speculative token is a verify block's bonus, computed as a row of a
block where plain decoding computes it alone (issue 38's row invariance, at the real shapes).

1. Teacher-forced: the reference's greedy tokens are fed one decode step at a time into both the torch
   backend and the other backend; at every position the two argmaxes are compared. Each disagreement is
   reported with the reference's top-2 logit gap there (a near tie when small).
2. Free-running on the other backend: plain greedy against the EAGLE3 chains (--gammas, default 4 and 6) and
   trees (--tree, default 10/6/32), the same of the MTP module and the draft model's chains where the dir holds them, with
   whole-round CUDA graphs where the backend allows them: identical outputs, or the first divergence with its
   gap. The measured tau of each is printed too.

``--gemv-all BN,BK,WARPS[,AHEAD]`` runs every one-row projection of the fast engines on the Triton GEMV with that
tile (where BK divides K; a KernelConfig whose ``gemv`` table lists every weight shape of the engines): the
numerics the Qwen3-8B shapes get from the shipped tables, tried on the demo's trained weights, whose own shapes
have none. ``--cuda-all COLS,WARPS,STAGES`` does the same with gemv.cu's CUDA C++ kernel (its ``cuda`` table).
``--row-invariant`` runs the fast target with KernelConfig.row_invariant (one-row calls on the verify paths), under
which every speculative output should equal plain greedy's. ``--gammas 1,2,3,4,5,6,7,8`` and ``--tree 16,8,64``
(repeatable) choose the chains and trees counted (default: chains of 4 and 6, the 10/6/32 tree); ``--drafters``
which of the drafters the dir holds (default: all).
``--fast-only`` counts on the fast backend alone: no torch reference, so no teacher-forced pass, no torch tau and one
copy of the weights. At the 8B shape the reference is what costs: its pass and its drafters' runs did not fit 540 s
with three drafters at 512 tokens (2026-12-06, H100).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.drafters import NoDrafter, causal, prompt_inputs
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.registry import DRAFTERS, DrafterSpec, TreeShape, make_drafter
from xcompile.runtime.enginedir.text import Text
from xcompile.runtime.engines.fast import FastEagle3Engine, FastFCEngine, FastQwen3Engine
from xcompile.runtime.engines.kernels.config import CudaGemv, Gemv, KernelConfig, shipped_tiles
from xcompile.runtime.engines.load import EngineSet, fast_engines, open_engine_dir

COUNTED = ("eagle3", "mtp", "draft-model")       # the drafters whose outputs are counted against plain greedy


def step(engine, token: int, pos: int) -> torch.Tensor:
    dev = engine.device
    i64 = dict(dtype=torch.int64, device=dev)
    return engine.run(input_ids=torch.tensor([[token]], **i64), position_ids=torch.tensor([[pos]], **i64),
                      write_index=torch.tensor([pos], **i64), tree_mask=causal(1, dev),
                      logit_rows=torch.zeros(1, 1, **i64))["logits"][0, 0].float()


def prefill(engine, prompt: list[int]) -> None:
    engine.run(**prompt_inputs(torch.tensor([prompt], device=engine.device)))


def gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def graphed(es, drafter):
    """A Generator over the engine set's target that records whole rounds as CUDA graphs where the backend allows."""
    return Generator(es.engines["target"], drafter, [], es.manifest.max_seq_len, options=LoopOptions(cuda_graphs=True))


def synthetic_set(args, backend: str) -> EngineSet:
    """``args.synthetic``'s seeded weights (bf16, an EAGLE3 head) as an engine set on the torch or fast backend."""
    from xcompile.compile.reference import open_synthetic

    max_seq_len = args.prompt_len + args.new_tokens + 64
    manifest, engines, d2t = open_synthetic(args.synthetic, max_seq_len, "bf16", args.device, draft=args.draft_model,
                                            mtp=args.mtp)
    if backend == "fast":
        engines = fast_engines(manifest, engines)
    return EngineSet(None, manifest, backend, engines, d2t=d2t.get("eagle3"), mtp_d2t=d2t.get("mtp"))


def weight_shapes(engines: dict) -> set[tuple[int, int]]:
    """(N_OUT, K) of every projection of the fast engines (gate/up: N_OUT is half its rows), as the tile tables
    key them."""
    shapes = set()
    for e in engines.values():
        layers, others = [], []
        if isinstance(e, FastQwen3Engine):
            layers, others = e.layers, [e.lm_head]
        elif isinstance(e, FastEagle3Engine):
            layers, others = [e.layer], [e.lm_head]
        elif isinstance(e, FastFCEngine):
            others = [e.fc]
        for layer in layers:
            n2, k = layer.gate_up.shape
            shapes |= {tuple(layer.qkv.shape), tuple(layer.o.shape), (n2 // 2, k), tuple(layer.down.shape)}
        shapes |= {tuple(w.shape) for w in others}
    return shapes


def every_shape_on(engines: dict, gemv: Gemv | None, cuda: CudaGemv | None) -> KernelConfig:
    """The shipped kernel configuration with every projection shape of ``engines`` in the gemv (and / or cuda)
    table on one tile."""
    shapes = weight_shapes(engines)
    tiles = shipped_tiles().replace(gemv={s: gemv for s in shapes} if gemv else {},
                                    cuda={s: cuda for s in shapes} if cuda else {})
    return KernelConfig(tiles=tiles)


def tile_arg(kind: type, text: str, option: str):
    """A tile of ``kind`` from 'a,b,c[,d]' (SystemExit naming the option if malformed)."""
    try:
        tile = kind(*map(int, text.split(",")))
        assert min(tile) >= 0 and min(tile[:3]) > 0 and (kind is not Gemv or 1 <= tile.ahead <= 4)
        return tile
    except (ValueError, TypeError, AssertionError):
        fields = ",".join(kind._fields).upper()
        raise SystemExit(f"{option} {text!r}: expected {fields} (positive integers, the last optional"
                         + ("; AHEAD 1-4)" if kind is Gemv else ")")) from None


def shapes(gammas: str, trees: list[str]) -> tuple[list[int], list[TreeShape]]:
    """--gammas and --tree as chain lengths and tree shapes (SystemExit naming the option if malformed)."""
    try:
        lengths = [int(g) for g in gammas.split(",")]
        if min(lengths) < 1:
            raise ValueError(gammas)
    except ValueError:
        raise SystemExit(f"--gammas {gammas!r}: expected chain lengths >= 1, comma-separated") from None
    trees_out = []
    for t in trees:
        try:
            parts = [int(v) for v in t.split(",")]
            if len(parts) != 3:
                raise ValueError(t)
            trees_out.append(TreeShape(*parts))
        except (ValueError, EngineError):
            raise SystemExit(f"--tree {t!r}: expected TOPK,DEPTH,TOKENS (integers >= 1)") from None
    return lengths, trees_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine_dir", nargs="?")
    ap.add_argument("--synthetic", help="a known shape's seeded synthetic weights instead of a dir (qwen3-8b)")
    ap.add_argument("--prompts", default="data/corpus.heldout.txt")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--against", choices=("fast", "ort"), default="fast",
                    help="the backend compared with the torch reference (ort: ONNX Runtime's CUDA provider)")
    ap.add_argument("--device", default="cuda", help="cpu for a dry run of the flow (--against ort only)")
    ap.add_argument("--max-gap", type=float, help="exit 1 unless every disagreement and divergence is at a near tie: "
                    "a top-2 logit gap <= this (0.0625: one bf16 step at the demo's logit scale)")
    ap.add_argument("--gemv-all", help="BN,BK,WARPS[,AHEAD]: every one-row projection on this GEMV tile (docstring)")
    ap.add_argument("--cuda-all", help="COLS,WARPS,STAGES: every one-row projection on gemv.cu's kernel (docstring)")
    ap.add_argument("--row-invariant", action="store_true", help="the fast target's one-row calls on its verify paths")
    ap.add_argument("--gammas", default="4,6", help="chain lengths counted, each drafter the dir holds (1,2,...,8 say)")
    ap.add_argument("--tree", action="append", metavar="TOPK,DEPTH,TOKENS",
                    help="a tree shape counted for EAGLE3 and MTP (repeatable; default 10,6,32)")
    ap.add_argument("--drafters", default=",".join(COUNTED), help="which drafters to count, of those held")
    ap.add_argument("--fast-only", action="store_true", help="count on the fast backend alone (no torch reference)")
    ap.add_argument("--mtp", action="store_true", help="--synthetic: an MTP module too")
    ap.add_argument("--draft-model", help="--synthetic: a draft model of this shape too (qwen3-0.6b)")
    args = ap.parse_args()
    args.gammas, args.tree = shapes(args.gammas, args.tree or ["10,6,32"])
    if (args.engine_dir is None) == (args.synthetic is None):
        ap.error("give an ENGINE_DIR or --synthetic NAME, not both")
    if (args.mtp or args.draft_model) and not args.synthetic:
        ap.error("--mtp / --draft-model add drafters to --synthetic weights; an engine dir holds its own")
    args.drafters = args.drafters.split(",")
    if bad := [d for d in args.drafters if d not in COUNTED]:
        ap.error(f"--drafters {bad[0]!r}: expected some of {','.join(COUNTED)}, comma-separated")
    if args.fast_only and args.against != "fast":
        ap.error("--fast-only counts on the fast backend: use it with --against fast")
    gemv = tile_arg(Gemv, args.gemv_all, "--gemv-all") if args.gemv_all else None
    cuda = tile_arg(CudaGemv, args.cuda_all, "--cuda-all") if args.cuda_all else None
    if (gemv or cuda or args.row_invariant) and args.against != "fast":
        raise SystemExit("--gemv-all / --cuda-all / --row-invariant choose the fast backend's kernels: use them with "
                         "--against fast")
    try:
        # ORT records no graphs the Generator can capture; its own CUDA graphs are refused for target/eagle3
        if args.synthetic and args.against != "fast":
            raise EngineError("--synthetic has no ONNX graphs: use it with --against fast")
        opened = [synthetic_set(args, "fast")] if args.synthetic else [
            open_engine_dir(args.engine_dir, args.against, args.device, cuda_graphs=args.against != "ort")]
        if not args.fast_only:
            opened.insert(0, synthetic_set(args, "torch") if args.synthetic else
                          open_engine_dir(args.engine_dir, "torch", args.device))
        with contextlib.ExitStack() as stack:
            *ref, fast_es = [stack.enter_context(es) for es in opened]
            if gemv or cuda:
                kernels = every_shape_on(fast_es.engines, gemv, cuda)
                for e in fast_es.engines.values():
                    e.kernels = kernels
                print(f"every one-row projection of {sorted(weight_shapes(fast_es.engines))} on"
                      + (f" gemv.cu {tuple(cuda)} where it runs, else" if cuda else "")
                      + (f" the Triton GEMV {tuple(gemv)}" if gemv else " the shipped tables' kernels"))
            if args.row_invariant:
                target = fast_es.engines["target"]
                target.kernels = dataclasses.replace(target.kernels, row_invariant=True)
                print("the fast target row-invariant: its one-row calls take the verify blocks' kernels")
            gaps = run(args, ref[0] if ref else None, fast_es)
    except EngineError as e:
        raise SystemExit(f"fast_agreement.py: {e}") from None
    if args.max_gap is not None:
        wide = [g for g in gaps if g > args.max_gap]
        print(f"near ties (top-2 gap <= {args.max_gap}): {len(gaps) - len(wide)} of {len(gaps)} partings"
              + (f"; wider gaps: {wide}" if wide else ""))
        raise SystemExit(1 if wide else 0)


def run(args, ref_es, fast_es) -> list[float]:
    """Prints both checks (the teacher-forced one only with a reference ``ref_es``); returns the top-2 gap at every
    disagreement and first divergence."""
    n = args.prompt_len
    if args.synthetic:
        vocab = fast_es.manifest.models["target"].config["vocab_size"]
        prompts = torch.randint(0, vocab, (args.num_prompts, n), generator=torch.Generator().manual_seed(0)).tolist()
    else:
        ids = Text(Path(args.engine_dir)).encode(Path(args.prompts).read_text())
        prompts = [ids[i * n:(i + 1) * n] for i in range(args.num_prompts)]
    with torch.inference_mode():
        gaps = teacher_forced(args, prompts, ref_es, fast_es) if ref_es else []
        return gaps + count(args, prompts, ref_es, fast_es)


def teacher_forced(args, prompts, ref_es, fast_es) -> list[float]:
    """Check 1: the reference's greedy tokens fed to both backends; the gap at each disagreement."""
    ref_t, fast_t = ref_es.engines["target"], fast_es.engines["target"]
    ref_gen = graphed(ref_es, NoDrafter())
    positions = disagreements = 0
    gaps, all_gaps = [], []
    for p in prompts:
        want = ref_gen.generate(p, args.new_tokens).tokens
        for e in (ref_t, fast_t):
            e.new_kv()
            prefill(e, p)
        seq = p + want
        for i in range(len(p), len(seq) - 1):
            a, b = step(ref_t, seq[i], i), step(fast_t, seq[i], i)
            positions += 1
            all_gaps.append(gap(a))
            if int(a.argmax()) != int(b.argmax()):
                disagreements += 1
                gaps.append(gap(a))
    eps = max(gaps) if gaps else 0.0
    near = sum(g <= eps for g in all_gaps) if gaps else 0
    print(f"teacher-forced: {positions - disagreements}/{positions} positions agree "
          f"({100 * (positions - disagreements) / positions:.2f} %); {disagreements} disagreements, reference top-2 "
          f"gaps there: {[round(g, 4) for g in sorted(gaps)]}; positions with a gap <= {eps:.4f}: {near}")
    return gaps


def count(args, prompts, ref_es, fast_es) -> list[float]:
    """Check 2: each drafter's free-running output on the fast (or ORT) backend against its plain greedy; tau on
    both backends (the fast one alone without ``ref_es``). Returns the gap at each first divergence."""
    fast_t, other = fast_es.engines["target"], fast_es.backend
    fast_plain = graphed(fast_es, NoDrafter())
    wants = [fast_plain.generate(p, args.new_tokens).tokens for p in prompts]
    held = [d for d in args.drafters if DRAFTERS[d].holds(fast_es)]
    specs = [s for name in held for s in [DrafterSpec(name, g) for g in args.gammas]
             + ([DrafterSpec(name, tree=t) for t in args.tree] if DRAFTERS[name].tree else [])]
    gaps = []
    for spec in specs:
        taus = {}
        for label, es in ((("torch", ref_es),) if ref_es else ()) + ((other, fast_es),):
            gen = graphed(es, make_drafter(es, spec))
            runs = [gen.generate(p, args.new_tokens) for p in prompts]
            # tau as Stats.acceptance_length defines it: tokens the rounds emitted, over the rounds
            taus[label] = sum(r.stats.new_tokens - 1 for r in runs) / sum(r.stats.rounds for r in runs)
        same, diverged = 0, []
        for p, r, want in zip(prompts, runs, wants):        # the other backend's runs against its plain greedy
            if r.tokens == want:
                same += 1
                continue
            k = next(i for i, (x, y) in enumerate(zip(r.tokens, want)) if x != y)
            fast_t.new_kv()
            prefill(fast_t, p + want[:k])
            logits = step(fast_t, (p + want)[len(p) + k - 1], len(p) + k - 1)
            diverged.append((k, round(gap(logits), 4)))
        tau = "".join(f"{taus[b]:.2f} on the {b} backend" + (", " if b != other else "") for b in taus)
        print(f"{spec.label}: tau {tau}; {other}: {same}/{len(prompts)} outputs identical to plain greedy on the "
              f"{other} path; first divergences (token index, top-2 gap): {diverged}", flush=True)
        gaps += [g for _, g in diverged]
    return gaps


if __name__ == "__main__":
    main()
