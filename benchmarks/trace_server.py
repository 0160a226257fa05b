"""What a served request runs, thread by thread: ``xrun serve`` started with a profiler on every thread of its
process, then requests sent one at a time, each traced alone. It finds a first use inside a first request: the
server's event loop, engine thread and any other thread, in one timeline (issue 37: the step histogram's first
series, made on the engine thread between a prompt step and its token's delivery, took 5.2 ms of an 8B server's
first request on an H100, 2026-12-07; benchmarks/first_request.py times the engine alone, serve_load.py the client).

    python benchmarks/trace_server.py ENGINE_DIR [--serve-args "--device cuda"] [--requests 3] [--prompt-tokens 16]
                                      [--max-tokens 4] [--min-ms 0.3] [--out DIR]

Each request is a streamed completion of token ids (serve_load.py's prompts), sent once the server is ready and
the one before it is done, its TTFT timed at the client. While it runs, every Python and C call of every server
thread that lasts at least --min-ms is recorded (start, duration, thread, depth, function); the timeline goes to
DIR/request-N.txt (default: a temporary folder, printed) and the calls of 1 ms or more are printed. A profiled
request runs slower than an unprofiled one: compare a first request with the next ones, not with serve_load.py's
figures. Threads started before the profiler is switched on are profiled only on Python 3.12 or newer
(threading.setprofile_all_threads); on older Pythons every thread is profiled from the server's start, at a cost
on every request.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

from serve_load import Server, make_prompts

TRACER = "xcompile-trace"       # the watcher thread's name, left out of the timelines


# ---------------------------------------------------------------------------------------------------------------
# inside the server process (--as-server): the profiler, switched on while the flag file exists


def serve_traced(flag: Path, out: Path, min_s: float, xrun_args: list[str]) -> int:
    calls, stacks, on = [], {}, [False]

    def profile(frame, event, arg):
        if not on[0]:
            return
        stack = stacks.setdefault(threading.get_ident(), [])
        now = time.perf_counter()
        if event in ("call", "c_call"):
            stack.append(now)
        elif stack:                     # return, c_return, c_exception
            began = stack.pop()
            if now - began >= min_s:
                code = frame.f_code
                where = getattr(arg, "__qualname__", repr(arg)) if event != "return" else \
                    f"{code.co_qualname} {Path(code.co_filename).name}:{code.co_firstlineno}"
                calls.append((began, now - began, threading.current_thread().name, len(stack), where))

    def switch(to: bool) -> None:
        on[0] = to
        stacks.clear()
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(profile if to else None)

    def watch() -> None:
        n = 0
        while True:
            time.sleep(0.001)
            if flag.exists() != on[0]:
                if not on[0]:
                    calls.clear()
                    switch(True)
                    continue
                switch(False)
                write_timeline(out / f"request-{n}.txt", [c for c in calls if c[2] != TRACER])
                n += 1

    if not hasattr(threading, "setprofile_all_threads"):       # Python < 3.12: every thread from the start
        threading.setprofile(profile)
        sys.setprofile(profile)
    threading.Thread(target=watch, name=TRACER, daemon=True).start()
    from xcompile.runtime.cli.xrun import main
    main(["serve", *xrun_args], prog_name="xrun")        # exits with xrun's status, its errors in its words
    return 0


def write_timeline(path: Path, calls: list[tuple]) -> None:
    """One line a call, in start order: ms from the first call, ms long, thread, the call indented by depth."""
    t0 = min((c[0] for c in calls), default=0.0)
    lines = [f"{1e3 * (began - t0):9.3f} {1e3 * took:8.3f} {thread[:20]:20} {'  ' * min(depth, 30)}{where}"
             for began, took, thread, depth, where in sorted(calls)]
    tmp = path.with_suffix(".part")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)                   # whole, or not there yet


# ---------------------------------------------------------------------------------------------------------------
# the driver


def refuse(message: str) -> int:
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    return 2


def stream_ttft(url: str, prompt: list[int], max_tokens: int) -> float:
    """One streamed completion; ms from sending it to its first chunk (it is then read to its end)."""
    import httpx2 as httpx  # the HTTP client the openai package itself uses

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start, first = time.perf_counter(), None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.read().decode()[:200]}")
        for line in r.iter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter()
    return 1e3 * ((first or time.perf_counter()) - start)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-server":     # the server's side: FLAG OUT MIN_S -- XRUN ARGS
        flag, out, min_s = Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
        return serve_traced(flag, out, min_s, sys.argv[6:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine_dir")
    ap.add_argument("--serve-args", default="", help="xrun serve's options, as one string")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--min-ms", type=float, default=0.3, help="calls shorter than this are not recorded")
    ap.add_argument("--out", help="the timelines' folder (default: a new temporary one)")
    args = ap.parse_args()
    for name in ("requests", "prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            return refuse(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.min_ms <= 1000:
        return refuse("--min-ms takes (0, 1000] ms")
    if not (Path(args.engine_dir) / "manifest.json").is_file():
        return refuse(f"{args.engine_dir}: not an engine dir (no manifest.json)")
    if args.out is not None and not Path(args.out).is_dir():
        return refuse(f"--out {args.out}: no such folder")
    out = Path(args.out or tempfile.mkdtemp(prefix="xcompile-trace-")).resolve()
    flag = out / "tracing"
    flag.unlink(missing_ok=True)
    server = Server(args.engine_dir, shlex.split(args.serve_args), start_timeout=600, stop_timeout=30)
    server.cmd[:2] = [sys.executable, str(Path(__file__).resolve()), "--as-server", str(flag), str(out),
                      str(args.min_ms / 1e3), "--"]
    prompt = make_prompts(argparse.Namespace(prompts=None, prompt_tokens=args.prompt_tokens), 1)[0]
    try:
        url = server.start()
        for n in range(args.requests):
            flag.touch()
            time.sleep(0.05)                    # the watcher polls every ms
            ttft = stream_ttft(url, prompt, args.max_tokens)
            time.sleep(0.05)
            flag.unlink()
            timeline = out / f"request-{n}.txt"
            deadline = time.monotonic() + 30
            while not timeline.exists():
                if time.monotonic() > deadline or not server.alive():
                    raise RuntimeError(f"no timeline for request {n} in {out}")
                time.sleep(0.01)
            print(f"request {n}: TTFT {ttft:.1f} ms at the client (profiled); timeline {timeline}")
            for line in timeline.read_text().splitlines():
                if float(line.split()[1]) >= 1.0:
                    print(f"  {line}")
    except (RuntimeError, OSError) as e:
        return refuse(str(e))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
