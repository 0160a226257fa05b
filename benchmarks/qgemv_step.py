"""Tune qgemv.cu's quantized one-row launches inside the graphed decode step (the Qwen3-8B shape, random weights).

    python benchmarks/qgemv_step.py [--kinds fp8,int4] [--layers 36] [--context 128] [--passes 1] [--out FILE]

benchmarks/qlinear_tiles.py --cuda times each projection alone, in a graph of calls of that one shape. In the
step a launch requests its first stages before it waits for the kernel before it (programmatic dependent
launch) and shares the SMs with that kernel's tail, so what is fastest alone need not be fastest there. Here,
per kind: the step graphed at the shipped tables; then, for each decoder projection in turn (qkv, o, gate/up,
down), every candidate launch (``CANDIDATES``, deduplicated by what cuda_qgemv.fit makes of it at that shape)
with the other projections at their best so far; --passes repeats the round over the four. Each candidate is
checked first in one call of its shape against qlinear_reference (relative error under 2e-2; the step's
logits on random weights part from the reference's by ~8e-2 at any launch, so they cannot tell), else it is
dropped and said so. The three fastest of a projection and its best so far are timed again, interleaved, and
the fastest median of those wins. Printed: every candidate's step ms, each projection's winner, the step at
the shipped launches against the tuned ones. --out writes the shipped tile tables with the winners as
``qgemv_fp8`` / ``qgemv_int4`` entries (KernelConfig.tiles; the tables file fast_decode.py, step_timeline.py
--tiles and xrun bench take), its provenance naming the GPU, the date and this command.
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

from xcompile.runtime.engines.kernels import cuda_gemv
from xcompile.runtime.engines.kernels import cuda_qgemv as C
from xcompile.runtime.engines.kernels.config import KernelConfig, QGemv, shipped_tiles
from xcompile.runtime.engines.kernels.qlinear import QLinear, qlinear_reference
from xcompile.runtime.engines.qweight import FP8, INT4, quantize

BLOCKS = {FP8: (128, 128), INT4: (1, 128)}                 # as Qwen/Qwen3-8B-FP8 and -AWQ store them
# (name, N_OUT, K, gated): a decoder layer's one-row calls, in launch order
CALLS = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 12288, 4096, True),
         ("down", 4096, 12288, False)]
TABLE = {FP8: "qgemv_fp8", INT4: "qgemv_int4"}
RETIME, TOL = 3, 2e-2


def candidates(sms: int) -> list[QGemv]:
    """(warps, bytes of a row a stage, stages, grid): every block count that fits, or one block an SM."""
    return [QGemv(*t) for t in itertools.product((4, 8, 16), (1024, 2048, 4096), (2, 3, 4, 6), (0, sms))]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fitted(kind: str, n: int, k: int, gated: bool, sms: int) -> list[QGemv]:
    """The distinct launches the candidates make at this shape (cuda_qgemv.fit: what the kernel would run),
    each checked in one call against qlinear_reference (relative error under TOL), else dropped and said so."""
    qws = [quantize(torch.randn(n, k, device=DEV) * k ** -0.5, kind, BLOCKS[kind]) for _ in range(1 + gated)]
    w = QLinear.pack(qws)
    x = torch.randn(1, k, device=DEV).to(torch.bfloat16)
    want = qlinear_reference(x, qws, gated=gated)
    limit = cuda_gemv.smem_limit(DEV.index or 0)
    kept = []
    for tile in dict.fromkeys(t for c in candidates(sms) if (t := C.fit(w, c, gated, limit)) is not None):
        out = torch.empty(1, n, device=DEV, dtype=torch.bfloat16)
        got = C.qgemv(x, w, out, norm=None, eps=1e-6, gated=gated, residual=None, extra_out=None, tile=tile)
        err = rel(out, want) if got is not None else float("nan")
        if got is None or not err < TOL:
            print(f"{kind} {n}x{k} {tuple(tile)}: dropped ({'not launched' if got is None else ''} relative error "
                  f"{err:.2e})", flush=True)
            continue
        kept.append(tile)
    return kept


def tune(kind: str, args, sms: int) -> tuple[dict, dict]:
    """(the winning launch per call, figures) of one kind (module docstring)."""
    torch.manual_seed(0)
    cfg, taps = qwen3_8b(args.layers)
    ref, fast, _ = target_pair(cfg, taps, args.context + 8, kind)
    inputs = step_inputs(1, args.context, cfg.vocab_size)
    shipped = shipped_tiles()
    best = {(n, k): C.tile_for(kind, n, k) for _, n, k, _ in CALLS}

    def config(entries: dict) -> KernelConfig:
        return KernelConfig(tiles=shipped.replace(**{TABLE[kind]: entries}))

    def step_ms(entries: dict, reps: int = 30) -> float:
        fast.kernels = config(entries)
        return graphed_ms(fast.run, inputs, reps)

    figures = {"shipped_ms": step_ms(best, 60), "calls": {}}
    print(f"\n== {kind}: the step at the shipped launches {figures['shipped_ms']:.3f} ms", flush=True)
    for p in range(args.passes):
        for name, n, k, gated in CALLS:
            shape, timed = (n, k), {}
            for tile in fitted(kind, n, k, gated, sms):
                timed[tile] = step_ms({**best, shape: tile})
                print(f"{kind} {name:8} {str(tuple(tile)):22} step {timed[tile]:.3f} ms", flush=True)
            top = sorted(timed, key=timed.get)[:RETIME]
            finalists = list(dict.fromkeys([*top, best[shape]]))
            again = {t: [] for t in finalists}
            for _ in range(3):                              # interleaved, so a drifting clock hits every finalist
                for t in finalists:
                    again[t].append(step_ms({**best, shape: t}, 60))
            medians = {t: sorted(v)[1] for t, v in again.items()}
            was, best[shape] = best[shape], min(medians, key=medians.get)
            figures["calls"][f"{name} pass {p + 1}"] = {"shape": list(shape), "was": list(was), "won": list(best[shape]),
                                                        "retimed_ms": {str(tuple(t)): m for t, m in medians.items()}}
            print(f"WON {kind} {name} pass {p + 1}: {tuple(best[shape])} {medians[best[shape]]:.3f} ms "
                  f"(was {tuple(was)} {medians[was]:.3f} ms)", flush=True)
    shipped_again, tuned = step_ms({s: C.tile_for(kind, *s) for s in best}, 100), step_ms(best, 100)
    figures.update(shipped_again_ms=shipped_again, tuned_ms=tuned)
    print(f"STEP {kind}: shipped launches {shipped_again:.3f} ms, tuned {tuned:.3f} ms "
          f"({100 * (1 - tuned / shipped_again):+.1f} %)", flush=True)
    return best, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="fp8,int4", help="fp8 and/or int4")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--passes", type=int, default=1, help="rounds over the four projections")
    ap.add_argument("--out", help="write the shipped tile tables with the winners here")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if any(k not in TABLE for k in kinds):
        raise SystemExit(f"qgemv_step.py: --kinds {args.kinds!r}: expected fp8 and/or int4")
    if args.passes < 1 or args.layers < 1 or args.context < 1:
        raise SystemExit("qgemv_step.py: --passes, --layers and --context must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("qgemv_step.py times CUDA graphs: no CUDA device is visible here")
    if cuda_gemv.library(0) is None:
        raise SystemExit("qgemv_step.py: qgemv.cu is not built here (nvcc and an sm_90+ GPU; the log says why)")
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    won, figures = {}, {}
    for kind in kinds:
        won[kind], figures[kind] = tune(kind, args, sms)
        torch.cuda.empty_cache()                            # the kind's model is gone with tune's frame
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    if args.out:
        gpu, day = torch.cuda.get_device_name(DEV), datetime.date.today().isoformat()
        shipped = shipped_tiles()
        tiles = dataclasses.replace(shipped.replace(**{TABLE[kind]: won[kind] for kind in kinds}),
                                    provenance=f"{shipped.provenance}. {', '.join(TABLE[k] for k in kinds)}: {gpu}, "
                                               f"{day}: python benchmarks/qgemv_step.py {' '.join(sys.argv[1:])}")
        with open(args.out, "w") as f:
            json.dump(tiles.to_json(), f, indent=2)
            f.write("\n")
        print(f"tile tables with the winners: {args.out}")


if __name__ == "__main__":
    main()
