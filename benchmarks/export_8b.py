"""Export a Qwen3-8B-shaped bf16 target + its EAGLE3 head from synthetic weights; report wall time and
peak RSS. Not a test: it writes ~17 GB and takes minutes on the 2-core CI machine.

    python benchmarks/export_8b.py [--out DIR] [--keep] [--max-seq-len N]

Runs ``xcompile export --model qwen3-8b --synthetic --dtype bf16 --eagle3`` as a child process and
reads its peak RSS from ``resource.getrusage(RUSAGE_CHILDREN)`` (goal: <= 20 GB on a 24 GB machine;
the weights alone are 16.4 GB, so holding them twice would not fit).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

GOAL_RSS_GB = 20.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("engines/bench-qwen3-8b-synthetic"))
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the exported dir (default: delete it)")
    args = parser.parse_args()

    cmd = [sys.executable, "-c", "from xcompile.compile.cli import main; main()", "export", "--model", args.model,
           "--synthetic", "--dtype", "bf16", "--eagle3", "--out", str(args.out), "--force"]
    if args.max_seq_len:
        cmd += ["--max-seq-len", str(args.max_seq_len)]
    print("running:", " ".join(cmd), flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - start
    # ru_maxrss is in KiB on Linux: the largest resident set of any finished child
    peak_child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.glob("*.onnx*"))} if rc == 0 else {}
    report = {"model": args.model, "rc": rc, "wall_s": round(wall, 1), "peak_rss_gb_child": round(peak_child, 2),
              "peak_rss_gb_self": round(peak_self, 2), "goal_rss_gb": GOAL_RSS_GB,
              "files_gb": {k: round(v / 1e9, 3) for k, v in sizes.items()}}
    print(json.dumps(report, indent=2))
    if rc == 0 and not args.keep:
        shutil.rmtree(args.out)
    return rc or int(peak_child > GOAL_RSS_GB)


if __name__ == "__main__":
    sys.exit(main())
