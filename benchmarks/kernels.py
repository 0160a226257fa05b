"""Tune the fast backend's tile tables on a GPU: time candidate tiles per weight shape, write a tiles.json.

    python benchmarks/kernels.py [--calls 8b,eagle3] [--out tiles.json] [--json sweep.json] [--one-row]

For each projection of the Qwen3-8B target, its EAGLE3 head and Qwen3-0.6B (``CALLS``; ``--calls`` picks groups
or names, e.g. ``8b,eagle3.qkv``), called as the fast engines call it (runtime/engines/fast.py: qkv and gate/up
normalised from the row sums at several rows and by the GEMV's prologue at one, o and down adding into their
output, the lm_heads normalised by a launch of their own at several rows), through ``linear(..., cfg=KernelConfig
(tiles=...))`` with a table holding only the candidate:

    tile    the tile kernel's candidates (BLOCK_N, BLOCK_K, warps, stages, split) at 1, 7 and 32 rows; the
            lowest at 7 + 32 (chain and tree verify) is chosen
    gemv    one-row Triton GEMV candidates (BLOCK_N, BLOCK_K, warps, ahead 1-4); kept when faster than the
            chosen tile at one row
    cuda    gemv.cu's candidates (cols, warps, stages, per_sm), where nvcc builds it (bf16, sm_90+); kept when
            faster than both
    one_row (``--one-row``, instead of the three above) the tile kernel at one row under KernelConfig.row_invariant
            (plain decoding's calls there): candidates that keep the shipped tile's K split (and BLOCK_N where the
            call leaves row sums), each checked bit for bit, result and row sums, against the same row as the
            first of a 7-row call on the shipped tile; the fastest with the same bits is kept when it beats the
            shipped tile

Each time is the median µs of one call inside a CUDA graph of calls over rotating weight copies (so L2 never
holds the weights), with GB/s of weight bytes; each candidate is first checked against linear_reference. The
shapes not tuned keep the shipped entries (runtime/engines/kernels/tiles.json). ``--out`` writes the tables in
tiles.json's format with a provenance line (command, date, device), for ``benchmarks/fast_decode.py --tiles`` and
``KernelConfig(tiles=Tiles.load(path))``; confirm a table inside the graphed step with fast_decode.py before
shipping it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from dataclasses import dataclass

import torch
import triton
from triton.runtime.errors import OutOfResources

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.engines.kernels import cuda_gemv
from xcompile.runtime.engines.kernels.config import TABLES, CudaGemv, Gemv, KernelConfig, Tile, Tiles, shipped_tiles
from xcompile.runtime.engines.kernels.linear import DEFAULT_TILE, linear, linear_reference
from xcompile.runtime.engines.kernels.tile_finish import RowSums

DEV, DT = torch.device("cuda"), torch.bfloat16
ROWS = (1, 7, 32)               # decode, chain verify (gamma 6), tree verify (10/6/32)


@dataclass(frozen=True)
class Call:
    """One projection as the engines call it. norm: "sums" (qkv, gate/up: the norm weight folded into W, the 1/rms
    from the row sums at several rows, the GEMV's prologue at one), "launch" (the lm_heads: several rows normalised
    by a launch of their own) or "" (none); residual: added into its own output in place, leaving its row sums."""
    name: str
    n: int
    k: int
    gated: bool = False
    norm: str = ""
    residual: bool = False


CALLS = [
    Call("8b.qkv", 6144, 4096, norm="sums"), Call("8b.o", 4096, 4096, residual=True),
    Call("8b.gate_up", 12288, 4096, gated=True, norm="sums"), Call("8b.down", 4096, 12288, residual=True),
    Call("8b.lm_head", 151936, 4096, norm="launch"),
    Call("eagle3.qkv", 6144, 8192), Call("eagle3.lm_head", 32000, 4096, norm="launch"),
    Call("0.6b.qkv", 4096, 1024, norm="sums"), Call("0.6b.o", 1024, 2048, residual=True),
    Call("0.6b.gate_up", 3072, 1024, gated=True, norm="sums"), Call("0.6b.down", 1024, 3072, residual=True),
    Call("0.6b.lm_head", 151936, 1024, norm="launch"),
]
# tile-kernel candidates by kind of shape (the shipped tile is always tried too)
NARROW = [Tile(32, 256, 4, 3, 1), Tile(32, 256, 4, 3, 2), Tile(64, 256, 4, 3, 1), Tile(64, 256, 4, 3, 2),
          Tile(64, 256, 4, 3, 4), Tile(32, 512, 4, 3, 1), Tile(32, 512, 4, 3, 2), Tile(64, 512, 4, 3, 2)]
GATED = [Tile(64, 256, 4, 3, 1), Tile(64, 256, 4, 3, 2), Tile(128, 128, 8, 3, 1), Tile(128, 128, 8, 3, 2),
         Tile(128, 256, 8, 3, 1), Tile(64, 128, 4, 4, 1)]
WIDE = [Tile(128, 128, 8, 3, 1), Tile(64, 256, 4, 3, 1), Tile(128, 256, 8, 2, 1), Tile(256, 128, 8, 3, 1)]
# one-row Triton GEMV candidates: at most 64 fp32 accumulators a thread, each with 1-4 weight tiles in flight
GEMV = [Gemv(bn, bk, w, ahead) for bn, bk, w in ((4, 256, 4), (4, 512, 4), (8, 512, 4), (16, 512, 4))
        for ahead in (1, 2, 3, 4)]
CUDA = [CudaGemv(cols, warps, stages) for cols in (1, 2) for warps in (4, 8) for stages in (2, 3, 4)]


def tile_candidates(call: Call, shipped: Tiles) -> list[Tile]:
    kind = GATED if call.gated else WIDE if call.n > 16384 else NARROW
    found = [shipped.tile[(call.n, call.k)]] if (call.n, call.k) in shipped.tile else []
    return list(dict.fromkeys(found + [t for t in kind if call.k % (t.split * t.block_k) == 0]))


def graph_time(fns, reps: int = 20) -> float:
    """Median µs of one call, from CUDA-graph replays of ``fns`` (a list of calls, run in turn)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Bench:
    """One call's operands: weight copies enough to spill L2 (600 MB), inputs of each row count, the norm weight
    and the row sums the engines would pass."""

    def __init__(self, call: Call):
        self.call = call
        rows = 2 * call.n if call.gated else call.n
        copies = min(40, max(2, int(6e8 // (rows * call.k * 2)) + 1))
        self.ws = [torch.randn(rows, call.k, device=DEV, dtype=DT) / call.k ** 0.5 for _ in range(copies)]
        self.x = {m: torch.randn(m, call.k, device=DEV, dtype=DT) for m in ROWS}
        self.sums = RowSums(call.k, DT, DEV)
        self.g = self.sums.unit if call.norm == "sums" else torch.rand(call.k, device=DEV, dtype=DT) + 0.5
        self.outs = {m: [torch.randn(m, call.n, device=DEV, dtype=DT) for _ in self.ws] for m in ROWS}
        for m in ROWS:                  # every row count's first row of x is the one-row call's (exact_row)
            self.x[m][0] = self.x[1][0]
        self.sums_out = RowSums(call.n, DT, DEV) if call.residual else None

    def run(self, m: int, w: torch.Tensor, out: torch.Tensor, cfg: KernelConfig) -> torch.Tensor:
        """linear() of m rows as the engines call it (Call's docstring); ``prepare(m)`` first. Under
        row_invariant one row takes its norm from the row sums too, as several rows do."""
        c = self.call
        from_sums = c.norm == "sums" and (m > 1 or cfg.row_invariant)
        return linear(self.x[m], w, norm=self.g if c.norm else None, gated=c.gated,
                      residual=out if c.residual else None, out=out,
                      sums=self.sums if from_sums else None, sums_out=self.sums_out, cfg=cfg)

    def prepare(self, m: int) -> None:
        """The row sums of x that the call before would have left (RowSums), outside the timed calls; x's first
        row, every row count's, gets the one-row call's sum at each."""
        x = self.x[m]
        self.sums.buf[0, :m] = x.float().pow(2).sum(1)
        self.sums.buf[0, 0] = self.x[1].float().pow(2).sum(1)[0]
        self.sums.left_by(x, 1)

    def time(self, m: int, cfg: KernelConfig) -> float:
        """µs of one m-row call under ``cfg``, after checking its result against linear_reference."""
        c, x, out = self.call, self.x[m], self.outs[m][0]
        self.prepare(m)
        before = out.clone()
        want = linear_reference(x, self.ws[0], norm=self.g if c.norm else None, gated=c.gated,
                                residual=before if c.residual else None)
        err = rel(self.run(m, self.ws[0], out, cfg), want)
        if not err < 2e-2:
            raise RuntimeError(f"relative error {err:.2e} against linear_reference")
        return graph_time([lambda w=w, o=o: self.run(m, w, o, cfg) for w, o in zip(self.ws, self.outs[m])])


def sweep(bench: Bench, shipped: Tiles, with_cuda: bool) -> dict:
    """Every candidate of one call, printed; the times and the chosen entry of each table (None: no entry)."""
    c = bench.call
    shape = (c.n, c.k)
    kb = (2 if c.gated else 1) * c.n * c.k * 2 / 1e3           # weight kB: / µs = GB/s
    found = {"name": c.name, "n": c.n, "k": c.k, "tile": [], "gemv": [], "cuda": []}

    def attempt(table: str, tile, rows, cfg) -> None:
        try:
            times = [bench.time(m, cfg) for m in rows]
            if table == "cuda" and (c.n, c.k, tile) in cuda_gemv.REFUSED:
                raise RuntimeError("the device refused its launch (the Triton GEMV ran instead)")
            found[table].append((tuple(tile), times))
        except (OutOfResources, RuntimeError, EngineError) as e:
            print(f"  {table} {tuple(tile)}: {type(e).__name__}: {str(e)[:100]}")

    for tile in tile_candidates(c, shipped):                 # one row on the tile kernel too: no gemv / cuda entry
        attempt("tile", tile, ROWS, KernelConfig(tiles=Tiles(tile={shape: tile})))
    for tile in [t for t in GEMV if c.k % t.block_k == 0]:
        attempt("gemv", tile, (1,), KernelConfig(cuda_gemv=False, tiles=Tiles(gemv={shape: tile})))
    for tile in CUDA if with_cuda else []:
        try:
            cuda_gemv.check(tile, c.n, c.k, gated=c.gated, smem_limit=cuda_gemv.smem_limit(0))
        except EngineError:
            continue                                          # more shared memory than the device has
        attempt("cuda", tile, (1,), KernelConfig(tiles=Tiles(cuda={shape: tile})))
    if not found["tile"]:
        raise SystemExit(f"{c.name}: no tile-kernel candidate ran")
    found["tile"].sort(key=lambda r: r[1][1] + r[1][2])
    found["gemv"].sort(key=lambda r: r[1][0])
    found["cuda"].sort(key=lambda r: r[1][0])
    print(f"\n{c.name} {shape}: µs at {' / '.join(map(str, ROWS))} rows; the tile kernel's chosen at 7 + 32")
    for table, rows in found.items():
        if table in TABLES:
            for tile, ts in rows[:6 if table == "tile" else 4]:
                mark = "   <- shipped" if getattr(shipped, table).get(shape) == tile else ""
                print(f"  {table:<5}{str(tile):<24}" + "".join(f"{t:>9.1f}" for t in ts) + f"{kb / ts[0]:>7.0f} GB/s"
                      + mark)
    # one row runs gemv.cu where the table has the shape (and it is built), else the Triton GEMV where the table
    # has it, else the tile kernel: each entry kept only where it beats what would run without it
    best_tile, (one_row, *_) = found["tile"][0]
    chosen = {"tile": best_tile, "gemv": None, "cuda": None}
    for table in ("gemv", "cuda"):
        if found[table] and found[table][0][1][0] < one_row:
            chosen[table], one_row = found[table][0][0], found[table][0][1][0]
    print(f"  chosen: tile {chosen['tile']}, one row on " + (f"gemv.cu {chosen['cuda']}" if chosen["cuda"] else
          f"the Triton GEMV {chosen['gemv']}" if chosen["gemv"] else "the tile kernel") + f" ({one_row:.1f} µs)")
    found["chosen"] = chosen
    return found


def exact_row(bench: Bench, tile: Tile, shipped: Tile) -> bool:
    """Whether one row on ``tile`` gives the bits (its result and the row sums it leaves) that the same row gives
    as the first of a 7-row call on the shipped tile, under KernelConfig.row_invariant."""
    shape, got = (bench.call.n, bench.call.k), []
    for m, t in ((7, shipped), (1, tile)):
        out = bench.outs[m][0].clone()
        out[0] = bench.outs[1][0][0]                    # the same residual row (timed calls add into outs)
        bench.prepare(m)
        y = bench.run(m, bench.ws[0], out, KernelConfig(row_invariant=True, tiles=Tiles(tile={shape: t})))
        sums = bench.sums_out.buf[:, 0].clone() if bench.sums_out is not None else None
        got.append((y[0].clone(), sums))
    (y7, s7), (y1, s1) = got
    return torch.equal(y7, y1) and (s7 is None or torch.equal(s7, s1))


def one_row_sweep(bench: Bench, shipped: Tiles) -> dict:
    """One row under KernelConfig.row_invariant runs the tile kernel; its candidates keep the shipped tile's split
    (and BLOCK_N where the call leaves row sums: one partial a column block), the rest free. Each is checked bit
    for bit against the shipped tile's 7-row call (exact_row) and timed at one row against the shipped tile."""
    c = bench.call
    shape = (c.n, c.k)
    t0 = shipped.tile.get(shape, DEFAULT_TILE).for_k(c.k)
    widths = [t0.block_n] if c.residual else [16, 32, 64, 128]
    cands = [t0] + [Tile(bn, bk, 8 if bn >= 128 else 4, st, t0.split) for bn in widths for bk in (256, 512)
                    for st in (3, 5) if c.k % (t0.split * bk) == 0]
    cands = list(dict.fromkeys(cands))
    kb = (2 if c.gated else 1) * c.n * c.k * 2 / 1e3
    rows = []
    for tile in cands:
        try:
            exact = exact_row(bench, tile, t0)
            us = bench.time(1, KernelConfig(row_invariant=True, tiles=Tiles(tile={shape: tile})))
            rows.append((tuple(tile), us, exact))
        except (OutOfResources, RuntimeError, EngineError) as e:
            print(f"  {tuple(tile)}: {type(e).__name__}: {str(e)[:100]}")
    rows.sort(key=lambda r: r[1])
    print(f"\n{c.name} {shape}: one row under row_invariant, µs (shipped {tuple(t0)}: "
          f"{next(r[1] for r in rows if r[0] == tuple(t0)):.1f})")
    for tile, us, exact in rows[:8]:
        print(f"  {str(tile):<24}{us:>9.1f}{kb / us:>7.0f} GB/s  {'same bits' if exact else 'OTHER BITS'}")
    print(f"  {sum(r[2] for r in rows)} of {len(rows)} candidates keep the bits")
    best = next((r for r in rows if r[2]), None)
    chosen = best[0] if best and best[0] != tuple(t0) else None
    print(f"  chosen: {chosen or 'the shipped tile'}")
    return {"name": c.name, "n": c.n, "k": c.k, "one_row": rows, "chosen": {"one_row": chosen}}


def select(spec: str) -> list[Call]:
    """The calls ``spec`` names: comma-separated groups (8b, eagle3, 0.6b) or names (8b.qkv)."""
    picked = []
    for name in spec.split(","):
        found = [c for c in CALLS if c.name == name or c.name.startswith(name + ".")]
        if not found:
            raise SystemExit(f"--calls: {name!r} names none of {', '.join(c.name for c in CALLS)}")
        picked += [c for c in found if c not in picked]
    return picked


def tuned(shipped: Tiles, results: list[dict], provenance: str) -> Tiles:
    """The shipped tables with each tuned shape's entries replaced (a gemv / cuda entry dropped where none won; a
    new tile drops the shape's one_row entry)."""
    tables = {name: dict(getattr(shipped, name)) for name in TABLES}
    for r in results:
        shape = (r["n"], r["k"])
        if "tile" in r["chosen"]:
            tables["one_row"].pop(shape, None)      # a one_row tile keeps the bits of the tile it was tuned against
        for name in r["chosen"]:
            tables[name].pop(shape, None)
            if r["chosen"][name] is not None:
                tables[name][shape] = r["chosen"][name]
    return Tiles(**tables, provenance=provenance)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", default="8b,eagle3", help="groups (8b, eagle3, 0.6b) or names (8b.qkv), comma-separated")
    ap.add_argument("--out", help="write the tuned tile tables here (tiles.json's format)")
    ap.add_argument("--json", help="write every candidate's times here")
    ap.add_argument("--one-row", action="store_true", help="the one_row table instead: one row under "
                    "KernelConfig.row_invariant on tile candidates that keep the shipped split (one_row_sweep)")
    args = ap.parse_args()
    calls = select(args.calls)
    if not torch.cuda.is_available():
        raise SystemExit("kernels.py times kernels in CUDA graphs: no CUDA device is visible here")
    shipped = shipped_tiles()
    with_cuda = cuda_gemv.library(0) is not None
    device = torch.cuda.get_device_name()
    print(f"device {device}, triton {triton.__version__}, gemv.cu {'built' if with_cuda else 'not available'}")
    torch.manual_seed(0)
    results = []
    for call in calls:
        bench = Bench(call)
        results.append(one_row_sweep(bench, shipped) if args.one_row else sweep(bench, shipped, with_cuda))
        del bench
        torch.cuda.empty_cache()
    when = datetime.date.today().isoformat()
    provenance = (f"{device}, {when}: python benchmarks/kernels.py {' '.join(sys.argv[1:])} (tuned: "
                  f"{', '.join(c.name for c in calls)}; other shapes as shipped)")
    tiles = tuned(shipped, results, provenance)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(tiles.to_json(), f, indent=1)
        print(f"\nwrote {args.out}: time it in the step with benchmarks/fast_decode.py --tiles {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
