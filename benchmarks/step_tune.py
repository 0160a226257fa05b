"""Tune the one-row launches per projection inside a graphed decode step on a GPU (random weights).

    python benchmarks/step_tune.py [--model qwen3-8b|qwen3-0.6b] [--quantize fp8,int4] [--layers N]
                                   [--context 128] [--passes 1] [--out FILE] [--json FILE]

benchmarks/kernels.py and qlinear_tiles.py time each projection alone, in a graph of calls of that one shape. In
the step a launch requests its first weights before it waits for the kernel before it (programmatic dependent
launch) and shares the SMs with that kernel's tail, so what is fastest alone need not be fastest there. Here:
the step graphed at the shipped tile tables; then, for each one-row projection in turn (``CALLS``: qkv, o,
gate/up, down and, in bf16, the lm_head), every candidate with the other projections at their best so far;
--passes repeats the round. A candidate is what a one-row call of that shape runs:

    bf16        the tile kernel at the shape's shipped tile (no ``gemv`` or ``cuda`` entry), a Triton GEMV
                (a ``gemv`` entry: kernels.GEMV) or gemv.cu (a ``cuda`` entry: ``STEP_CUDA``)
    --quantize  qgemv.cu's launches (a ``qgemv_fp8`` / ``qgemv_int4`` entry: ``qgemv_candidates``,
                deduplicated by what cuda_qgemv.fit makes of them at that shape); one run per kind

Each candidate is first checked in one call of its shape against the reference (linear_reference or
qlinear_reference, relative error under 2e-2; a random step's logits part from the reference's by ~8e-2 at
any launch, so they cannot tell), else dropped and said so. The three fastest of a projection and its best so
far are timed again, interleaved, and the fastest median wins. Printed: every candidate's step ms, each
projection's winner, the step at the shipped tables against the tuned ones. --out writes the shipped tile
tables with the winners (the file fast_decode.py, step_timeline.py --tiles and KernelConfig take), its
provenance naming the GPU, the date and this command.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys

import torch
from fast_decode import DEV, graphed_ms, qwen3_8b, step_inputs, target_pair
from kernels import GEMV

from xcompile.compile.config import KNOWN_MODELS
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.engines.kernels import cuda_gemv
from xcompile.runtime.engines.kernels import cuda_qgemv as C
from xcompile.runtime.engines.kernels.config import CudaGemv, KernelConfig, QGemv, Tiles, shipped_tiles
from xcompile.runtime.engines.kernels.linear import linear, linear_reference
from xcompile.runtime.engines.kernels.qlinear import QLinear, qlinear_reference
from xcompile.runtime.engines.qweight import FP8, INT4, quantize

BLOCKS = {FP8: (128, 128), INT4: (1, 128)}                 # as Qwen/Qwen3-8B-FP8 and -AWQ store them
# (name, N_OUT, K, gated, norm, residual): a layer's one-row calls in launch order, then the lm_head (bf16 only)
CALLS = {"qwen3-8b": [("qkv", 6144, 4096, False, True, False), ("o", 4096, 4096, False, False, True),
                      ("gate_up", 12288, 4096, True, True, False), ("down", 4096, 12288, False, False, True),
                      ("lm_head", 151936, 4096, False, True, False)],
         "qwen3-0.6b": [("qkv", 4096, 1024, False, True, False), ("o", 1024, 2048, False, False, True),
                        ("gate_up", 3072, 1024, True, True, False), ("down", 1024, 3072, False, False, True),
                        ("lm_head", 151936, 1024, False, True, False)]}
RETIME, TOL = 3, 2e-2
# gemv.cu in the step: up to 8 stages and a cap on blocks a SM too (0: as many as fit), so a small model's
# projection may request all of its weights before its PDL wait and still leave the SM room for the next launch
STEP_CUDA = [CudaGemv(*t) for t in itertools.product((1, 2), (4, 8), (2, 4, 8), (0, 1, 2))]
BF16 = torch.bfloat16


def qgemv_candidates(sms: int) -> list[QGemv]:
    """(warps, bytes of a row a stage, stages, grid): every block count that fits, or one block an SM."""
    return [QGemv(*t) for t in itertools.product((4, 8, 16), (1024, 2048, 4096), (2, 3, 4, 6), (0, sms))]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def with_entries(tiles: Tiles, shape: tuple[int, int], entries: dict) -> Tiles:
    """``tiles`` with ``shape``'s entry of each table in ``entries`` set (None: removed), as Tiles.replace does."""
    return tiles.replace(**{table: {shape: entry} for table, entry in entries.items()})


def candidates(call: tuple, kind: str | None, sms: int) -> list[dict]:
    """The one-row launches of a call (module docstring) that run and match the reference in one call, each as
    the table entries that select it."""
    name, n, k, gated, norm, residual = call
    limit = cuda_gemv.smem_limit(DEV.index or 0)
    rows = 2 * n if gated else n
    x = torch.randn(1, k, device=DEV).to(BF16)
    g = torch.rand(k, device=DEV).to(BF16) + 0.5 if norm else None
    res = torch.randn(1, n, device=DEV).to(BF16) if residual else None
    if kind:
        qws = [quantize(torch.randn(n, k, device=DEV) * k ** -0.5, kind, BLOCKS[kind]) for _ in range(1 + gated)]
        w = QLinear.pack(qws)
        want = qlinear_reference(x, qws, norm=g, gated=gated, residual=res)
        fitted = dict.fromkeys(t for c in qgemv_candidates(sms) if (t := C.fit(w, c, gated, limit)) is not None)
        tries = [{C.TABLE[kind]: t} for t in fitted]
    else:
        w = torch.randn(rows, k, device=DEV).to(BF16) / k ** 0.5
        want = linear_reference(x, w, norm=g, gated=gated, residual=res)
        tries = [{"gemv": None, "cuda": None}] + [{"gemv": t, "cuda": None} for t in GEMV if k % t.block_k == 0]
        for t in STEP_CUDA:
            try:
                tries.append({"gemv": None, "cuda": cuda_gemv.check(t, n, k, gated, limit)})
            except EngineError:
                pass                                        # more shared memory than the device has
    kept = []
    for entries in tries:
        out = res.clone() if residual else torch.empty(1, n, device=DEV, dtype=BF16)
        if kind:
            got = C.qgemv(x, w, out, norm=g, eps=1e-6, gated=gated, residual=out if residual else None,
                          extra_out=None, tile=entries[C.TABLE[kind]])
        else:
            cfg = KernelConfig(tiles=with_entries(shipped_tiles(), (n, k), entries))
            got = linear(x, w, norm=g, gated=gated, residual=out if residual else None, out=out, cfg=cfg)
            if entries["cuda"] is not None and (n, k, entries["cuda"]) in cuda_gemv.REFUSED:
                got = None                                  # the Triton GEMV ran instead
        err = rel(out, want) if got is not None else float("nan")
        label = label_of(entries)
        if got is None or not err < TOL:
            print(f"{name} {label}: dropped ({'not launched, ' if got is None else ''}relative error {err:.2e})",
                  flush=True)
            continue
        kept.append(entries)
    return kept


def label_of(entries: dict) -> str:
    """What runs: 'cuda (...)', 'gemv (...)', 'qgemv_fp8 (...)' or 'tile kernel'."""
    for table, entry in entries.items():
        if entry is not None:
            return f"{table} {tuple(entry)}"
    return "tile kernel"


def tune(kind: str | None, args, sms: int) -> tuple[Tiles, dict]:
    """(the tables with each call's winner, figures) of one kind (module docstring)."""
    torch.manual_seed(0)
    cfg, taps = qwen3_8b(args.layers, args.model)
    ref, fast, _ = target_pair(cfg, taps, args.context + 8, kind)
    inputs = step_inputs(1, args.context, cfg.vocab_size)
    calls = [c for c in CALLS[args.model] if not (kind and c[0] == "lm_head")]      # the lm_head stays bf16
    shipped = best = shipped_tiles()
    tables = [C.TABLE[kind]] if kind else ["gemv", "cuda"]

    def step_ms(tiles: Tiles, reps: int = 30) -> float:
        fast.kernels = KernelConfig(tiles=tiles)
        return graphed_ms(fast.run, inputs, reps)

    what = kind or "bf16"
    figures = {"shipped_ms": step_ms(shipped, 60), "calls": {}}
    print(f"\n== {args.model} {what}: the step at the shipped tables {figures['shipped_ms']:.3f} ms", flush=True)
    for p in range(args.passes):
        for call in calls:
            name, shape = call[0], (call[1], call[2])
            current = {t: getattr(best, t).get(shape) for t in tables}
            if kind:                                        # no entry: the kind's default launch, named
                current = {C.TABLE[kind]: C.tile_for(kind, *shape, KernelConfig(tiles=best))}
            timed = {}
            for entries in candidates(call, kind, sms):
                key = tuple(entries.items())
                timed[key] = step_ms(with_entries(best, shape, entries))
                print(f"{what} {name:8} {label_of(entries):36} step {timed[key]:.3f} ms", flush=True)
            finalists = list(dict.fromkeys([*sorted(timed, key=timed.get)[:RETIME], tuple(current.items())]))
            again = {f: [] for f in finalists}
            for _ in range(3):                              # interleaved, so a drifting clock hits every finalist
                for f in finalists:
                    again[f].append(step_ms(with_entries(best, shape, dict(f)), 60))
            medians = {f: sorted(v)[1] for f, v in again.items()}
            won = min(medians, key=medians.get)
            best = with_entries(best, shape, dict(won))
            was = tuple(current.items())
            figures["calls"][f"{name} pass {p + 1}"] = {
                "shape": list(shape), "was": label_of(current), "won": label_of(dict(won)),
                "retimed_ms": {label_of(dict(f)): m for f, m in medians.items()}}
            print(f"WON {what} {name} pass {p + 1}: {label_of(dict(won))} {medians[won]:.3f} ms "
                  f"(was {label_of(current)} {medians[was]:.3f} ms)", flush=True)
    shipped_again, tuned = step_ms(shipped, 100), step_ms(best, 100)
    figures.update(shipped_again_ms=shipped_again, tuned_ms=tuned)
    print(f"STEP {args.model} {what}: shipped tables {shipped_again:.3f} ms, tuned {tuned:.3f} ms "
          f"({100 * (1 - tuned / shipped_again):+.1f} %)", flush=True)
    return best, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(CALLS), default="qwen3-8b")
    ap.add_argument("--quantize", help="fp8 and/or int4: tune qgemv.cu's launches of those kinds (default: bf16)")
    ap.add_argument("--layers", type=int, help="layers of the shape (default: all of them)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--passes", type=int, default=1, help="rounds over the projections")
    ap.add_argument("--out", help="write the shipped tile tables with the winners here")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    kinds = args.quantize.split(",") if args.quantize else [None]
    if any(k is not None and k not in C.TABLE for k in kinds):
        raise SystemExit(f"step_tune.py: --quantize {args.quantize!r}: expected fp8 and/or int4")
    args.layers = args.layers or KNOWN_MODELS[args.model].config.num_hidden_layers
    if args.passes < 1 or args.layers < 1 or args.context < 1:
        raise SystemExit("step_tune.py: --passes, --layers and --context must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("step_tune.py times CUDA graphs: no CUDA device is visible here")
    if cuda_gemv.library(0) is None:
        raise SystemExit("step_tune.py: gemv.cu / qgemv.cu are not built here (nvcc and an sm_90+ GPU; the log says why)")
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    tiles, figures = shipped_tiles(), {}
    for kind in kinds:
        won, figures[kind or "bf16"] = tune(kind, args, sms)
        torch.cuda.empty_cache()                            # the kind's model is gone with tune's frame
        changed = [C.TABLE[kind]] if kind else ["gemv", "cuda"]
        tiles = dataclasses.replace(tiles, **{t: getattr(won, t) for t in changed})
        write(args, tiles, figures)                         # after each kind: a run cut short keeps what it tuned


def write(args, tiles: Tiles, figures: dict) -> None:
    """--json: the figures so far; --out: the shipped tables with the winners so far, their provenance naming
    the GPU, the date and this command."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    if args.out:
        gpu, day = torch.cuda.get_device_name(DEV), datetime.date.today().isoformat()
        tiles = dataclasses.replace(tiles, provenance=f"{tiles.provenance}. {gpu}, {day}: python "
                                                      f"benchmarks/step_tune.py {' '.join(sys.argv[1:])}")
        with open(args.out, "w") as f:
            json.dump(tiles.to_json(), f, indent=2)
            f.write("\n")
        print(f"tile tables with the winners: {args.out}")


if __name__ == "__main__":
    main()
