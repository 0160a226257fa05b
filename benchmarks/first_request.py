"""What the first requests after a server's warm-up pay on the engine side alone, in-process: an engine dir opened
and warmed up as ``xrun serve`` does (LLM.warm_up, then the heap frozen), then requests one at a time on its batch
loop, each step timed with the device synchronised. Beside serve_load.py's first request (its server time and its
engine steps), it tells a stall in the engine from one in the HTTP side (issue 37: the 8B server's first request
took 74.8 ms of its own time against 7.9 next on an H100 on 2026-12-07; bisected on the CPU to the HTTP side: the
import of anyio's asyncio backend inside the first streamed response, runtime/serve/app.py).

    python benchmarks/first_request.py ENGINE_DIR [--requests 4] [--prompt-tokens 16] [--new-tokens 32]
                                       [--idle 1.0] [--profile 2] [--json FILE]

Per request: its first step (the prompt pass and first token: the engine's share of a TTFT), its second, and the
mean of the rest. --idle seconds pass before the first and the third request (a server waits on its clients; the
GPU idles). --profile N: cProfile the first step of the first N requests and print each one's 12 costliest
functions by own time, so that a one-time cost names its function. The prompts are serve_load.py's token-id
prompts (every request the same 16 ids, as its first request and its one-stream level send).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from serve_load import make_prompts

from xcompile.runtime.api import LLM
from xcompile.runtime.common.errors import XcompileError
from xcompile.runtime.engines.load import BACKEND_CHOICES
from xcompile.runtime.serve.scheduler import freeze_heap


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_request(llm: LLM, prompt: list[int], new_tokens: int, profile: bool) -> dict:
    """One greedy request alone on the batch loop: its steps' wall times (ms), the first maybe profiled."""
    batch, device = llm.batch, llm.device
    batch.submit(prompt, new_tokens)
    steps, top = [], None
    while not batch.idle:
        prof = cProfile.Profile() if profile and not steps else None
        start = time.perf_counter()
        if prof is not None:
            prof.enable()
        batch.step()
        sync(device)
        if prof is not None:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
            top = text.getvalue()
        steps.append(1e3 * (time.perf_counter() - start))
    rest = steps[2:]
    return {"first_ms": round(steps[0], 3), "second_ms": round(steps[1], 3) if len(steps) > 1 else None,
            "rest_mean_ms": round(statistics.fmean(rest), 3) if rest else None, "steps": len(steps), "profile": top}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine_dir", help="an engine dir exported with --max-batch N (N > 1)")
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--backend", default="auto", choices=BACKEND_CHOICES)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--idle", type=float, default=1.0, help="seconds before the first and the third request")
    ap.add_argument("--profile", type=int, default=2, help="cProfile the first step of this many requests")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    for name in ("requests", "prompt_tokens", "new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.idle <= 60 or args.profile < 0:
        ap.error("--idle takes 0-60 seconds and --profile a count >= 0")
    if args.json_path and not Path(args.json_path).resolve().parent.is_dir():
        ap.error(f"--json {args.json_path}: its folder does not exist")
    if not (Path(args.engine_dir) / "manifest.json").is_file():
        ap.error(f"{args.engine_dir}: not an engine dir (no manifest.json)")

    try:
        return probe(args, ap)
    except XcompileError as e:          # a dir or a device this cannot run, a prompt the dir refuses: one line
        print(f"first_request.py: {e}", file=sys.stderr)
        return 1


def probe(args, ap: argparse.ArgumentParser) -> int:
    start = time.perf_counter()
    llm = LLM(args.engine_dir, backend=args.backend, device=args.device)
    if llm.batch is None:
        ap.error(f"{args.engine_dir}: a --max-batch 1 dir runs no batch loop; export it with --max-batch N")
    opened = time.perf_counter()
    llm.warm_up()
    sync(llm.device)
    warmed = time.perf_counter()
    frozen = freeze_heap()
    print(f"open {opened - start:.1f} s, warm-up {warmed - opened:.1f} s, heap frozen ({frozen} objects)")
    prompt = make_prompts(SimpleNamespace(prompts=None, prompt_tokens=args.prompt_tokens), 1)[0]
    report = {"engine_dir": args.engine_dir, "device": str(llm.device), "requests": []}
    for i in range(args.requests):
        if i in (0, 2):
            time.sleep(args.idle)
        r = one_request(llm, prompt, args.new_tokens, i < args.profile)
        report["requests"].append(r)
        print(f"request {i}{' after idle' if i in (0, 2) else ''}: first step {r['first_ms']:.3f} ms, second "
              f"{r['second_ms']} ms, the rest {r['rest_mean_ms']} ms ({r['steps']} steps)")
        if r["profile"]:
            print(r["profile"])
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
