"""How long the load-time check of an engine dir takes (runtime/enginedir/integrity.py): the default sampled check
(what every `xrun`/backend load does) with the files in the page cache and evicted from it, and the
full check (`--verify`, `xcompile verify`). Not a test: it reads the dir (GBs) several times.

    python benchmarks/verify_speed.py [DIR] [--repeats 5]

Without DIR it exports ``xcompile export --model qwen3-0.6b --synthetic --dtype bf16`` into
engines/bench-qwen3-0.6b-synthetic first (a minute or two on 2 cores; kept for later runs).
Page-cache eviction uses posix_fadvise(DONTNEED), which drops clean pages of those files only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from xcompile.runtime.enginedir.manifest import Manifest

DEFAULT_DIR = Path("engines/bench-qwen3-0.6b-synthetic")


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(directory: Path, full: bool, cold: bool, names: list[str]) -> float:
    """Seconds for what a load checks: read the manifest, then check every file it needs."""
    if cold:
        evict([directory / n for n in names])
    start = time.perf_counter()
    manifest = Manifest.load(directory)
    manifest.verify(directory, manifest.needed_files(), full=full)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    directory = args.directory or DEFAULT_DIR
    if args.directory is None and not (directory / "manifest.json").is_file():
        cmd = [sys.executable, "-c", "from xcompile.compile.cli import main; main()", "export", "--model",
               "qwen3-0.6b", "--synthetic", "--dtype", "bf16", "--out", str(directory)]
        print("running:", " ".join(cmd), flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(f"exported in {time.perf_counter() - start:.0f} s", flush=True)
    manifest = Manifest.load(directory)
    names = manifest.needed_files()
    size = sum(manifest.files[n]["size"] for n in names)
    timed(directory, False, False, names)                       # warm the page cache once
    runs = {kind: [timed(directory, full, cold, names) for _ in range(args.repeats if not full else 1)]
            for kind, full, cold in (("fast_warm", False, False), ("fast_cold", False, True),
                                     ("full_warm", True, False))}
    report = {"dir": str(directory), "files": len(names), "bytes": size,
              "largest": max(((n, manifest.files[n]["size"]) for n in names), key=lambda x: x[1]),
              **{f"{kind}_s": round(statistics.median(v), 4) for kind, v in runs.items()},
              "full_gb_per_s": round(size / 1e9 / statistics.median(runs["full_warm"]), 2)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
