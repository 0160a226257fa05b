"""Where a graphed step's time goes, kernel by kernel, on a GPU (the Qwen3-8B shape, random weights).

    python benchmarks/step_timeline.py [--layers N] [--contexts 128,4096] [--tokens 1,32] [--max-seq-len 4352]
                                       [--pdl 0|1] [--cuda-gemv 0|1] [--tiles FILE] [--row-invariant]
    python benchmarks/step_timeline.py --eagle3 [--contexts 128] [--tokens 1,10]     # the EAGLE3 draft step
    python benchmarks/step_timeline.py --reference [--layers 4]                     # the reference modules' step
    python benchmarks/step_timeline.py --quantize fp8|int4 [--tokens 1,7]           # quantized decoder linears
    python benchmarks/step_timeline.py --model qwen3-0.6b --tokens 1               # the draft model's step

The kernel records (CUPTI, through torch.profiler) of a few replays of the graphed step. With programmatic
dependent launch the kernels overlap, so each is charged its share of the step's critical path: from the
previous kernel's end to its own end. Printed per kernel (a name launched several times a layer numbered
by its order there: the one-row GEMVs #0 qkv, #1 o, #2 gate/up, #3 down): launches a step, mean duration (start to
end), critical µs a step, and how long before the previous kernel's end it started (its early launch).
The step's span under the profiler is printed beside the graphed time without it. Weights are random,
drawn on the GPU as in benchmarks/fast_decode.py. The fast engine runs under the shipped KernelConfig, or
with PDL / the CUDA GEMV off (``--pdl 0``, ``--cuda-gemv 0``), another tile tables file (``--tiles``), or
KernelConfig.row_invariant (``--row-invariant``).
``--eagle3``: the step of an EAGLE3 head of the 8B target's shape instead (one layer: every launch its own
row). ``--reference``: the reference modules' step (cuBLAS, SDPA) instead of the fast engine's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile

import torch
from fast_decode import DEV, graphed_ms, head_pairs, int_list, qwen3_8b, step_inputs, target_pair
from torch.profiler import ProfilerActivity, profile

from xcompile.compile.config import KNOWN_MODELS
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.engines.graphs import CudaGraphCapture
from xcompile.runtime.engines.kernels.config import KernelConfig, Tiles


def kernel_records(replay, reps: int) -> list[list[dict]]:
    """The kernels of ``reps`` replays, each replay's in launch order: [{name, start, end}] in µs."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    ks = sorted(({"name": e["name"], "start": e["ts"], "end": e["ts"] + e["dur"]} for e in events
                 if e.get("cat") == "kernel"), key=lambda e: e["start"])
    n = len(ks) // reps
    assert n * reps == len(ks), f"{len(ks)} kernel records from {reps} replays"
    return [ks[i * n:(i + 1) * n] for i in range(reps)]


def labels(names: list[str], layers: int) -> list[str]:
    """A step's kernel names, those launched k > 1 times a layer told apart by their order within the layer:
    name#0 .. name#k-1 (one row: the GEMVs #0 qkv, #1 o, #2 gate/up, #3 down; several rows: the tile kernel's
    launches in the same order). Launches past k a layer are taken to follow the layers (Qwen3's lm_head and
    final norm): name#after."""
    counts = collections.Counter(names)
    seen = collections.Counter()
    out = []
    for n in names:
        k = counts[n] // layers
        out.append(n if k < 2 else f"{n}#{seen[n] % k}" if seen[n] < k * layers else f"{n}#after")
        seen[n] += 1
    return out


def table(steps: list[list[dict]], layers: int) -> tuple[list[tuple], float]:
    """Per kernel label: (label, launches a step, mean µs, critical µs a step, mean early start µs), span µs."""
    per = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    spans = []
    for ks in steps:
        spans.append(max(k["end"] for k in ks) - ks[0]["start"])
        prev_end = ks[0]["start"]
        for k, label in zip(ks, labels([k["name"] for k in ks], layers)):
            row = per[label]
            row[0] += 1
            row[1] += k["end"] - k["start"]
            row[2] += max(0.0, k["end"] - prev_end)                     # ended inside another: none
            row[3] += max(0.0, prev_end - k["start"])
            prev_end = max(prev_end, k["end"])
    r = len(steps)
    rows = sorted(((name, n / r, t / n, c / r, e / n) for name, (n, t, c, e) in per.items()), key=lambda x: -x[3])
    return rows, sum(spans) / r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("qwen3-8b", "qwen3-0.6b"), default="qwen3-8b",
                    help="the shape (qwen3-0.6b: the draft model's step, --layers 28)")
    ap.add_argument("--layers", type=int, help="layers of the shape (default: all of them)")
    ap.add_argument("--contexts", type=int_list, default=[128, 4096])
    ap.add_argument("--tokens", type=int_list, default=[1, 32])
    ap.add_argument("--max-seq-len", type=int, default=4352)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pdl", type=int, choices=(0, 1), default=1, help="programmatic dependent launch")
    ap.add_argument("--cuda-gemv", type=int, choices=(0, 1), default=1, help="one-row calls on gemv.cu's kernel")
    ap.add_argument("--tiles", help="a tile tables file (tiles.json's format) instead of the shipped tables")
    ap.add_argument("--eagle3", action="store_true", help="the EAGLE3 head's draft step, not the target's")
    ap.add_argument("--reference", action="store_true", help="the reference modules' step, not the fast engine's")
    ap.add_argument("--quantize", choices=("fp8", "int4"), help="the target's decoder linears quantized")
    ap.add_argument("--row-invariant", action="store_true", help="KernelConfig.row_invariant (one-row calls on the "
                    "tile kernels, attention's packed layout)")
    args = ap.parse_args()
    longest = max(args.contexts) + max(args.tokens)
    if longest > args.max_seq_len:
        raise SystemExit(f"--max-seq-len {args.max_seq_len} is shorter than the longest step's end ({longest}); "
                         "raise it or lower --contexts / --tokens")
    try:
        tiles = Tiles.load(args.tiles) if args.tiles else None
    except EngineError as e:
        raise SystemExit(f"--tiles: {e}") from None
    if not torch.cuda.is_available():
        raise SystemExit("step_timeline.py profiles CUDA graphs: no CUDA device is visible here")
    kernels = KernelConfig(pdl=bool(args.pdl), cuda_gemv=bool(args.cuda_gemv), row_invariant=args.row_invariant,
                           **({"tiles": tiles} if tiles is not None else {}))
    torch.manual_seed(0)
    args.layers = args.layers or KNOWN_MODELS[args.model].config.num_hidden_layers
    cfg, taps = qwen3_8b(args.layers, args.model)
    if args.eagle3:
        (ref, fast), _ = head_pairs(cfg, args.max_seq_len)
        layers, what = 1, "EAGLE3 step"
    else:
        ref, fast, _ = target_pair(cfg, taps, args.max_seq_len, args.quantize)
        layers, what = args.layers, f"{args.layers} layers"
    fast.kernels = kernels
    engine = ref if args.reference else fast
    what += ", reference modules" if args.reference else f", pdl={args.pdl} cuda_gemv={args.cuda_gemv}" + (
        " row_invariant" if args.row_invariant else "") + (
        f" tiles={args.tiles}" if args.tiles else "")
    for ctx in args.contexts:
        for tokens in args.tokens:
            inputs = step_inputs(tokens, ctx, cfg.vocab_size)
            if args.eagle3:
                inputs["hidden_states"] = torch.randn(1, tokens, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
            ms = graphed_ms(engine.run, inputs)
            replay, _ = CudaGraphCapture(warmup=2)(lambda: engine.run(**inputs), DEV)
            rows, span = table(kernel_records(replay, args.reps), layers)
            print(f"\n== context {ctx}, {tokens} token(s), {what}, {args.max_seq_len}-slot cache: graphed {ms:.3f} ms, "
                  f"span under the profiler {span / 1e3:.3f} ms")
            print(f"{'kernel':<44}{'a step':>7}{'mean us':>9}{'crit us':>10}{'early us':>10}")
            for kname, n, mean, crit, early in rows:
                print(f"{kname[:43]:<44}{n:>7.0f}{mean:>9.2f}{crit:>10.1f}{early:>10.2f}")


if __name__ == "__main__":
    main()
