"""Why qgemv.cu's one-row calls wait: each Qwen3-8B projection at its shipped launch, timed, then under Nsight Compute.

    python benchmarks/qgemv_stalls.py [--kinds fp8,int4] [--ncu PATH]

Each call (step_tune.py's: qkv, o, gate/up, down; FP8 in 128 x 128 blocks, INT4 in groups of 128, random weights) is
first timed alone, the median of graphs of 200 calls (µs and the TB/s of the bytes it reads, QLinear.nbytes), then
this script runs itself under ``ncu`` (the CUDA toolkit's, or --ncu) for one call of each and prints, per call, what
Nsight Compute measured: its DRAM throughput, the SM's warps active and issue slots used, and the five reasons a
warp waited most, in cycles per instruction issued (``smsp__average_warps_issue_stalled_*_per_issue_active``:
barrier = a block-wide barrier, long_scoreboard = a global load, wait = a fixed-latency dependency, ...). Under
ncu the calls run one at a time with the caches flushed, so its durations are longer than the graph's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import torch
from step_tune import BLOCKS
from step_tune import CALLS as MODELS

from xcompile.runtime.bench.costs import timed
from xcompile.runtime.engines.graphs import CudaGraphCapture
from xcompile.runtime.engines.kernels import cuda_gemv
from xcompile.runtime.engines.kernels import cuda_qgemv as C
from xcompile.runtime.engines.kernels.qlinear import QLinear
from xcompile.runtime.engines.qweight import FP8, INT4, quantize

DEV = torch.device("cuda")
CALLS = [c for c in MODELS["qwen3-8b"] if c[0] != "lm_head"]       # the layer's; the lm_head stays bf16
METRICS = ["gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"]
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def call_of(kind: str, n: int, k: int, gated: bool, norm: bool, residual: bool):
    """One call of the shape at its shipped launch, and the bytes it reads."""
    torch.manual_seed(0)
    w = QLinear.pack([quantize(torch.randn(n, k, device=DEV) * k ** -0.5, kind, BLOCKS[kind])
                      for _ in range(1 + gated)])
    x = torch.randn(1, k, device=DEV).bfloat16()
    g = torch.rand(k, device=DEV).bfloat16() + 0.5 if norm else None
    out = torch.zeros(1, n, device=DEV, dtype=torch.bfloat16)

    def run() -> None:
        if C.qgemv(x, w, out, norm=g, eps=1e-6, gated=gated, residual=out if residual else None,
                   extra_out=None) is None:
            raise SystemExit(f"qgemv_stalls.py: qgemv.cu did not take the {kind} call of {n} x {k} here")
    return run, w.nbytes()


def alone_us(run, calls: int = 200) -> float:
    """µs of one call: the median of 10 replays of a graph of ``calls`` calls."""
    replay, _ = CudaGraphCapture(warmup=1)(lambda: [run() for _ in range(calls)], DEV)
    return timed(replay, DEV, 10) * 1000 / calls


def report(text: str, names: list[str]) -> None:
    """ncu's output, one profiled kernel a block in call order, as a line a call."""
    blocks = re.split(r"\n\s+void \S*qgemv_kernel", text)[1:]
    for name, block in zip(names, blocks):
        vals = {m[0]: float(m[1].replace(",", "")) for m in re.findall(r"^\s+(\S+)\s+\S*\s+([\d.,]+)\s*$", block, re.M)}
        stalls = sorted(((STALL.fullmatch(k)[1], v) for k, v in vals.items() if STALL.fullmatch(k)), key=lambda s: -s[1])
        print(f"{name:14} ncu {vals.get('gpu__time_duration.sum', float('nan')):6.1f} us, DRAM "
              f"{vals.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', float('nan')):4.1f} %, warps active "
              f"{vals.get('sm__warps_active.avg.pct_of_peak_sustained_active', float('nan')):4.1f} %, issuing "
              f"{vals.get('smsp__issue_active.avg.pct_of_peak_sustained_active', float('nan')):4.1f} %; waits "
              f"{sum(v for _, v in stalls):.2f} cycles an instruction: "
              + ", ".join(f"{k} {v:.2f}" for k, v in stalls[:5]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="fp8,int4", help="fp8 and/or int4")
    ap.add_argument("--ncu", help="the ncu to run (default: $CUDA_HOME/bin/ncu, /usr/local/cuda/bin/ncu or PATH's)")
    ap.add_argument("--calls-only", action="store_true", help=argparse.SUPPRESS)    # what runs under ncu
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if any(k not in (FP8, INT4) for k in kinds):
        raise SystemExit(f"qgemv_stalls.py: --kinds {args.kinds!r}: expected fp8 and/or int4")
    ncu = args.ncu or next((p for p in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ncu"),
                                        shutil.which("ncu")) if p and os.path.exists(p)), None)
    if not args.calls_only and (ncu is None or not os.path.exists(ncu)):
        raise SystemExit(f"qgemv_stalls.py: no ncu {'at ' + args.ncu if args.ncu else 'found'} (Nsight Compute, "
                         "in the CUDA toolkit): give --ncu PATH")
    if not torch.cuda.is_available():
        raise SystemExit("qgemv_stalls.py times qgemv.cu on a GPU: no CUDA device is visible here")
    if cuda_gemv.library(0) is None:
        raise SystemExit("qgemv_stalls.py: qgemv.cu is not built here (nvcc and an sm_90+ GPU; the log says why)")
    calls = [(kind, c) for kind in kinds for c in CALLS]
    if args.calls_only:
        for kind, c in calls:
            call_of(kind, *c[1:])[0]()
        torch.cuda.synchronize()
        return
    names = []
    for kind, c in calls:
        run, nbytes = call_of(kind, *c[1:])
        us = alone_us(run)
        names.append(f"{kind} {c[0]}")
        print(f"{names[-1]:14} alone {us:6.2f} us, {nbytes / 1e6:5.1f} MB -> {nbytes / us / 1e6:.2f} TB/s, launch "
              f"{tuple(C.tile_for(kind, c[1], c[2]))}", flush=True)
    done = subprocess.run([ncu, "-k", "regex:qgemv", "--launch-count", str(len(calls)), "--metrics", ",".join(METRICS),
                           sys.executable, __file__, "--kinds", args.kinds, "--calls-only"],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"qgemv_stalls.py: ncu exited {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}")
    report(done.stdout, names)


if __name__ == "__main__":
    main()
