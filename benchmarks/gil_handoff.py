"""What a thread that keeps giving the GIL up pays to take it back while another thread runs Python: the engine
thread of ``xrun serve`` (every graph replay and host read gives the GIL up) beside the event loop parsing a burst
of requests (runtime/serve/scheduler.py SWITCH_INTERVAL). CPU only, no GPU, a few seconds.

    python benchmarks/gil_handoff.py [--waits 300] [--wait-us 20] [--intervals 5,0.5] [--repeats 5]

A worker thread makes --waits waits of --wait-us µs each with the GIL released (as a CUDA synchronize does), alone
and beside a thread that runs pure Python without pause, at each switch interval (ms; Python's default is 5):
the median wall time of --repeats tries. Beside a busy thread each take of the GIL back waits up to the interval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time


def positive_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive numbers separated by commas") from None
    if not values or not all(0 < v < 1e3 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers in (0, 1000) separated by commas")
    return values


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def waits(count: int, seconds: float) -> float:
    """Wall seconds of ``count`` GIL-free waits of ``seconds`` each on a new thread."""
    took = []

    def work():
        start = time.perf_counter()
        for _ in range(count):
            time.sleep(seconds)                 # gives the GIL up, then takes it back
        took.append(time.perf_counter() - start)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return took[0]


def beside_busy(count: int, seconds: float) -> float:
    """``waits`` while another thread runs Python without pause."""
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(i * i for i in range(2000))

    b = threading.Thread(target=busy)
    b.start()
    time.sleep(0.01)
    try:
        return waits(count, seconds)
    finally:
        stop.set()
        b.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waits", type=positive, default=300, help="GIL-free waits of the worker (default 300)")
    parser.add_argument("--wait-us", type=positive, default=20, help="microseconds each (default 20)")
    parser.add_argument("--intervals", type=positive_list, default=[5.0, 0.5],
                        help="switch intervals in ms (default 5,0.5)")
    parser.add_argument("--repeats", type=positive, default=5, help="tries, the median reported (default 5)")
    args = parser.parse_args()
    before = sys.getswitchinterval()
    try:
        for ms in args.intervals:
            sys.setswitchinterval(ms / 1e3)
            for name, run in (("alone", waits), ("beside a busy thread", beside_busy)):
                took = statistics.median(run(args.waits, args.wait_us / 1e6) for _ in range(args.repeats))
                print(f"switch interval {ms:g} ms, {name}: {args.waits} waits of {args.wait_us} µs in "
                      f"{took * 1e3:.1f} ms")
    finally:
        sys.setswitchinterval(before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
