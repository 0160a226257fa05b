"""Where a graphed fast-backend step's time goes, kernel by kernel, on a GPU (the Qwen3-8B shape).

    python benchmarks/step_timeline.py [--layers 36] [--contexts 128,4096] [--tokens 1,32] [--variants "chunk=64"]
    python benchmarks/step_timeline.py --eagle3 [--contexts 128] [--tokens 1,10]     # the EAGLE3 draft step

The kernel records (CUPTI, through torch.profiler) of a few replays of the graphed step. With programmatic
dependent launch the kernels overlap, so each is charged its share of the step's critical path: from the
previous kernel's end to its own end. Printed per kernel (a name launched several times a layer numbered
by its order there: the one-row GEMVs #0 qkv, #1 o, #2 gate/up, #3 down): launches a step, mean duration (start to
end), critical µs a step, and how long before the previous kernel's end it started (its early launch).
The step's span under the profiler is printed beside the graphed time without it. Weights are random,
drawn on the GPU as in benchmarks/fast_decode.py; ``--variants`` takes fast_decode.py's variants.
``--eagle3``: the step of an EAGLE3 head of the 8B target's shape instead (one layer: every launch its own row).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import tempfile

import torch
from fast_decode import (
    DEV,
    graphed_ms,
    parse_variants,
    random_,
    step_inputs,
    variant_gemv,
    variant_name,
    variant_schedule,
)
from torch.profiler import ProfilerActivity, profile

from xcompile.compile.config import KNOWN_MODELS, synthetic_eagle3_config
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.compile.reference import eagle3_engines, qwen3_engine
from xcompile.runtime.engines import kernels
from xcompile.runtime.engines.fast import FastEagle3Engine, FastQwen3Engine
from xcompile.runtime.engines.graphs import CudaGraphCapture
from xcompile.runtime.engines.kernels import cuda_gemv as C
from xcompile.runtime.engines.kernels import gemv as G
from xcompile.runtime.engines.kernels import linear as L


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
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--contexts", default="128,4096")
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--max-seq-len", type=int, default=4352)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="", help="benchmarks/fast_decode.py's --variants")
    ap.add_argument("--eagle3", action="store_true", help="the EAGLE3 head's draft step, not the target's")
    args = ap.parse_args()
    longest = max(map(int, args.contexts.split(","))) + max(map(int, args.tokens.split(",")))
    if longest > args.max_seq_len:
        raise SystemExit(f"--max-seq-len {args.max_seq_len} is shorter than the longest step's end ({longest}); "
                         "raise it or lower --contexts / --tokens")
    torch.manual_seed(0)
    cfg = dataclasses.replace(KNOWN_MODELS["qwen3-8b"].config, num_hidden_layers=args.layers)
    taps = tuple(sorted({1, args.layers // 2 - 1, args.layers - 4}))           # as the EAGLE3 target's graph
    if args.eagle3:
        with torch.device(DEV):
            head = random_(Eagle3(synthetic_eagle3_config(cfg), args.max_seq_len).to(torch.bfloat16))
        ref = eagle3_engines(head)[0]
        fast = FastEagle3Engine(eagle3_engines(head)[0], dataclasses.asdict(head.cfg))
        args.layers = 1
    else:
        with torch.device(DEV):
            target = random_(Qwen3(cfg, args.max_seq_len, taps).to(torch.bfloat16))
        ref = qwen3_engine(target)
        fast = FastQwen3Engine(qwen3_engine(target), dataclasses.asdict(cfg), taps)
    fast.bind_kv(ref.new_kv())
    builtin, chunk, gemv_tiles, cuda_tiles = dict(kernels.SCHEDULE), fast.chunk, dict(G.GEMV_TILES), dict(C.CUDA_GEMVS)
    tiles = dict(L.TILES)
    for v in parse_variants(args.variants):
        kernels.SCHEDULE.update(variant_schedule(v, builtin))
        fast.chunk = v.get("chunk", chunk)
        G.GEMV_TILES.clear()
        G.GEMV_TILES.update(gemv_tiles)
        L.TILES.clear()
        L.TILES.update(tiles)
        variant_gemv(v, cuda_tiles)
        name = variant_name(v)
        for ctx in map(int, args.contexts.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                inputs = step_inputs(tokens, ctx, cfg.vocab_size)
                if args.eagle3:
                    inputs["hidden_states"] = torch.randn(1, tokens, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
                ms = graphed_ms(fast.run, inputs)
                replay, _ = CudaGraphCapture(warmup=2)(lambda: fast.run(**inputs), DEV)
                rows, span = table(kernel_records(replay, args.reps), args.layers)
                what = "EAGLE3 step" if args.eagle3 else f"{args.layers} layers"
                print(f"\n== {name}: context {ctx}, {tokens} token(s), {what}, {args.max_seq_len}-slot "
                      f"cache: graphed {ms:.3f} ms, span under the profiler {span / 1e3:.3f} ms")
                print(f"{'kernel':<44}{'a step':>7}{'mean us':>9}{'crit us':>10}{'early us':>10}")
                for kname, n, mean, crit, early in rows:
                    print(f"{kname[:43]:<44}{n:>7.0f}{mean:>9.2f}{crit:>10.1f}{early:>10.2f}")
    kernels.SCHEDULE.update(builtin)
    G.GEMV_TILES.clear()
    G.GEMV_TILES.update(gemv_tiles)
    L.TILES.clear()
    L.TILES.update(tiles)
    variant_gemv({}, cuda_tiles)


if __name__ == "__main__":
    main()
