"""Check and time the fused kernels (runtime/engines/kernels/) at the Qwen3-8B / EAGLE3 / Qwen3-0.6B shapes on a GPU.

    python benchmarks/kernels.py [--sweep] [--json FILE]
    python benchmarks/kernels.py --gemv [--json FILE]     # the one-row GEMVs' tiles, then the verify tiles
    python benchmarks/kernels.py --gemv --no-verify --calls "8b qkv,8b gate/up" --schedule norm_late=1

For every projection shape: error against the torch reference at 1, 7 and 33 rows, row invariance
(row 0 of a 7-row call equals the 1-row call bit for bit), and the time of one launch inside a CUDA
graph of launches over rotating weight copies (so L2 never holds the weights), as GB/s of weight
bytes against the device's copy bandwidth; cuBLAS (F.linear) beside it. ``--sweep`` times every
candidate tile per shape and prints the best, which is what ``kernels/linear.py``'s TILES table
holds. Then attention at several live lengths and row counts, and rope_kv. ``--gemv`` times only the
one-row GEMVs' candidates (GEMV_SPLIT: split K included; GEMV_STREAM: the streaming kernel) at the
decode shapes (GEMV_CALLS, the lm_heads included), each called as the fast engines call it (qkv, gate/up
and the lm_heads with their norm, o/down adding the residual in place), against the tile kernel and
cuBLAS; before that, for the same shapes called the same way (a norm under SCHEDULE's norm_apart is a
launch of its own, timed with the call), the tile kernel's candidates (TILE_STREAM: the streaming kernel)
at 1, 7 and 32 rows, chosen at 7 + 32 (verify).
Its JSON's tiles and gemv_tiles feed ``fast_decode.py --tiles``. ``--calls`` keeps those GEMV shapes only,
``--no-verify`` leaves the tile kernel's sweep out, ``--schedule`` sets kernels.SCHEDULE entries first.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton

from xcompile.runtime.bench.measure import copy_bandwidth
from xcompile.runtime.engines import kernels
from xcompile.runtime.engines.kernels import gemv as G
from xcompile.runtime.engines.kernels import linear as L
from xcompile.runtime.engines.kernels.attention import attention, attention_reference, chunk_for
from xcompile.runtime.engines.kernels.rope_kv import rope_kv, rope_kv_reference

# (name, N_out, K, gated): every projection of the 8B target, its EAGLE3 head and the 0.6B draft model
SHAPES = [
    ("8b qkv", 6144, 4096, False), ("8b o", 4096, 4096, False), ("8b gate/up", 12288, 4096, True),
    ("8b down", 4096, 12288, False), ("8b lm_head", 151936, 4096, False),
    ("eagle3 qkv", 6144, 8192, False), ("eagle3 lm_head", 32000, 4096, False),
    ("0.6b qkv", 4096, 1024, False), ("0.6b o", 1024, 2048, False), ("0.6b gate/up", 3072, 1024, True),
    ("0.6b down", 1024, 3072, False), ("0.6b lm_head", 151936, 1024, False),
]
# tiles (BLOCK_N, BLOCK_K, warps, stages, split of K) tried per kind of shape
NARROW = [(32, 256, 4, 3, 1), (32, 256, 4, 3, 2), (64, 256, 4, 3, 1), (64, 256, 4, 3, 2), (64, 256, 4, 3, 4),
          (32, 512, 4, 3, 1), (32, 512, 4, 3, 2), (64, 512, 4, 3, 1), (64, 512, 4, 3, 2)]
GATED = [(64, 256, 4, 3, 1), (64, 256, 4, 3, 2), (128, 128, 8, 3, 1), (128, 128, 8, 3, 2), (128, 256, 8, 3, 1),
         (32, 512, 4, 3, 1), (64, 128, 4, 4, 1)]
WIDE = [(128, 128, 8, 3, 1), (64, 256, 4, 3, 1), (128, 256, 8, 2, 1), (256, 128, 8, 3, 1)]


# one-row CUDA-core GEMV tiles (BLOCK_N, BLOCK_K, warps): at most 64 fp32 accumulators per thread
GEMV = [(4, 512, 4), (4, 1024, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 4),
        (16, 512, 8), (16, 1024, 8), (32, 256, 8)]


# --gemv: one-row candidates, _gemv_kernel's and the streaming kernel's (the fastest of the third
# session's sweep, runs/2026-12-01-h200-s3-gemv-sweep.log, and of this session's first)
GEMV_SPLIT = [G.Gemv(4, 256, 4), G.Gemv(4, 512, 4), G.Gemv(4, 1024, 4), G.Gemv(8, 512, 4), G.Gemv(16, 512, 4),
              G.Gemv(4, 512, 4, 2)]
GEMV_STREAM = [G.Gemv(4, 1024, 4, 1, 4, 2), G.Gemv(4, 1024, 4, 1, 8, 1), G.Gemv(4, 1024, 4, 1, 8, 2),
               G.Gemv(4, 512, 4, 1, 8, 1), G.Gemv(4, 512, 4, 1, 4, 2), G.Gemv(8, 512, 4, 1, 8, 2)]
# --gemv: the streaming tile kernel's candidates (BLOCK_N, BLOCK_K, warps, stages, split, per_sm)
TILE_STREAM = [L.Tile(bn, bk, 4, st, 1, per_sm) for bn, bk, st in ((16, 256, 4), (32, 256, 3), (64, 128, 4),
                                                                    (64, 256, 3)) for per_sm in (1, 2)]
# the GEMV shapes as the fast engines call them: (name, N, K, norm prologue, residual epilogue, gated); a
# GEMV tile taken for an lm_head would round its lone row differently from a verify block's rows, as for
# the other GEMV shapes (kernels/__init__.py)
GEMV_CALLS = [("8b qkv", 6144, 4096, True, False, False), ("8b o", 4096, 4096, False, True, False),
              ("8b gate/up", 12288, 4096, True, False, True), ("8b down", 4096, 12288, False, True, False),
              ("eagle3 qkv", 6144, 8192, False, False, False), ("8b lm_head", 151936, 4096, True, False, False),
              ("eagle3 lm_head", 32000, 4096, True, False, False)]


def gemv_sweep(out: dict) -> None:
    """One-row candidates per shape, called as the engines call them; the fastest -> out["gemv_tiles"]
    when it beats the tile kernel's tile."""
    print(f"\n{'one-row GEMV':<14}{'N':>7}{'K':>7}  {'(bn, bk, warps, split, per_sm, ahead)':<38}{'us':>7}{'GB/s':>7}")
    for name, n, k, norm, residual, gated in GEMV_CALLS:
        ws = weights(2 * n if gated else n, k)
        x = torch.randn(1, k, device="cuda", dtype=DT)
        g = torch.rand(k, device="cuda", dtype=DT) + 0.5 if norm else None
        rs = [torch.randn(1, n, device="cuda", dtype=DT) for _ in ws]     # the timed calls add into / write these
        r_check = torch.randn(1, n, device="cuda", dtype=DT)
        ref = L.linear_reference(x, ws[0], norm=g, gated=gated, residual=r_check if residual else None)

        def call(w, r):
            return L.linear(x, w, norm=g, gated=gated, residual=r if residual else None, out=r)

        saved, current = G.GEMV_TILES.get((n, k)), G.gemv_tile(n, k)       # as linear() reads the table
        results = []
        for tile in [t for t in GEMV_SPLIT + GEMV_STREAM if k % (t.block_k * t.split) == 0]:
            G.GEMV_TILES[(n, k)] = tile
            try:
                r0 = r_check.clone()
                got = L.linear(x, ws[0], norm=g, gated=gated, residual=r0 if residual else None, out=r0)
                assert rel(got, ref) < 1e-2, rel(got, ref)
                results.append((graph_time([lambda w=w, r=r: call(w, r) for w, r in zip(ws, rs)]), tile))
            except Exception as e:                           # noqa: BLE001 - out of registers etc.
                print(f"  {tuple(tile)}: {type(e).__name__} {e}")
        G.GEMV_TILES.pop((n, k), None)
        tile_us = graph_time([lambda w=w, r=r: call(w, r) for w, r in zip(ws, rs)])
        cublas_us = time_cublas(n, k, gated)
        if saved is not None:
            G.GEMV_TILES[(n, k)] = saved
        results.sort()
        nbytes = (2 if gated else 1) * n * k * 2
        for t, tile in results[:6]:
            print(f"{name:<14}{n:>7}{k:>7}  {str(tuple(tile)):<38}{t:>7.1f}{nbytes / t / 1e3:>7.0f}"
                  + ("   <- current" if tile == current else ""))
        cur = next((t for t, tile in results if tile == current), float("nan"))
        print(f"{'':<28}current {cur:.1f} us, tile kernel {tile_us:.1f} us, cuBLAS (F.linear) {cublas_us:.1f} us")
        out["gemv"].append({"name": name, "n": n, "k": k, "sweep": [(t, list(tile)) for t, tile in results],
                            "tile_kernel_us": tile_us, "cublas_us": cublas_us})
        if results and results[0][0] < tile_us:
            out["gemv_tiles"][f"{n},{k}"] = list(results[0][1])


def verify_sweep(out: dict, rows=(1, 7, 32)) -> None:
    """Tile-kernel candidates (streaming ones included) of the decode shapes, timed at 1, 7 and 32 rows;
    the tile serves every row count but one row (a GEMV when one beats it, gemv_sweep after this), so
    the lowest time at 7 + 32 rows (chain and tree verify) -> out["tiles"] and L.TILES."""
    print(f"\n{'tile kernel':<14}{'N':>7}{'K':>7}  {'(bn, bk, w, s, split, per_sm)':<30}"
          + "".join(f"{f'm={m} us':>10}" for m in rows))
    for name, n, k, norm, residual, gated in GEMV_CALLS:
        current = tuple(L.tile_for(n, k))
        gemv = G.GEMV_TILES.pop((n, k), None)                # one row on the tile kernel here
        results = []
        for tile in candidates(name, n, k, gated) + [t for t in TILE_STREAM if k % t.block_k == 0]:
            try:
                results.append(([time_linear(n, k, gated, tile, m, norm=norm, residual=residual) for m in rows],
                                 tuple(L.Tile(*tile))))
            except Exception as e:                           # noqa: BLE001 - out of shared memory etc.
                print(f"  {tuple(tile)}: {type(e).__name__} {str(e)[:80]}")
        results.sort(key=lambda r: sum(r[0][1:]))
        for ts, tile in results[:5]:
            print(f"{name:<14}{n:>7}{k:>7}  {str(tile):<30}" + "".join(f"{t:>10.1f}" for t in ts)
                  + ("   <- current" if tile == current else ""))
        cur = next((ts for ts, tile in results if tile == current), None)
        if cur is not None and results[0][1] != current:
            print(f"{'':<28}current {current}: " + " / ".join(f"{t:.1f}" for t in cur) + " us")
        out.setdefault("verify", []).append({"name": name, "n": n, "k": k, "rows": list(rows),
                                             "sweep": [(ts, list(tile)) for ts, tile in results]})
        if results:
            out.setdefault("tiles", {})[f"{n},{k}"] = list(results[0][1])
            L.TILES[(n, k)] = L.Tile(*results[0][1])         # what gemv_sweep compares the GEMVs against
        if gemv is not None:
            G.GEMV_TILES[(n, k)] = gemv


def candidates(name: str, n: int, k: int, gated: bool) -> list[tuple]:
    if gated:
        tiles = GATED
    elif n > 16384:
        tiles = WIDE
    else:
        tiles = NARROW if name.startswith(("8b", "eagle3")) else NARROW[:2]
    return [t for t in tiles if k % (t[4] * min(t[1], k)) == 0]
DT = torch.bfloat16


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


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def weights(n_rows: int, k: int, copies_bytes: float = 6e8) -> list[torch.Tensor]:
    one = n_rows * k * 2
    n = max(2, int(copies_bytes // one) + 1)
    return [torch.randn(n_rows, k, device="cuda", dtype=DT) / k ** 0.5 for _ in range(min(n, 40))]


def check_linear(name, n, k, gated, report):
    rows = 2 * n if gated else n
    w = torch.randn(rows, k, device="cuda", dtype=DT) / k ** 0.5
    g = torch.rand(k, device="cuda", dtype=DT) + 0.5
    errs = {}
    for m in (1, 7, 33):
        x = torch.randn(m, k, device="cuda", dtype=DT)
        r = torch.randn(m, n, device="cuda", dtype=DT)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=DT)          # poisoned: every element written?
        if gated:
            L.linear(x, w, norm=g, gated=True, out=out)
            ref = L.linear_reference(x, w, norm=g, gated=True)
        else:
            L.linear(x, w, norm=g, residual=r, out=out)
            ref = L.linear_reference(x, w, norm=g, residual=r)
        errs[m] = rel(out, ref)
        assert not out.isnan().any(), f"{name}: unwritten output at m={m}"
    x = torch.randn(7, k, device="cuda", dtype=DT)
    one = L.linear(x[:1], w, norm=g, gated=gated)
    seven = L.linear(x, w, norm=g, gated=gated)
    report["invariant"] = bool(torch.equal(one[0], seven[0]))
    report["rel_err"] = errs


def time_linear(n, k, gated, tile, m=1, table=None, norm=True, residual=False) -> float:
    """µs of one launch with ``tile`` in ``table`` (L.TILES, or G.GEMV_TILES for the one-row kernel), with
    an RMSNorm prologue (norm) and / or adding the output into itself (residual, as o / down are called)."""
    table = L.TILES if table is None else table
    ws = weights(2 * n if gated else n, k)
    x = torch.randn(m, k, device="cuda", dtype=DT)
    g = torch.rand(k, device="cuda", dtype=DT) + 0.5 if norm else None
    outs = [torch.empty(m, n, device="cuda", dtype=DT) for _ in ws]
    saved = table.get((n, k))
    table[(n, k)] = tuple(tile)

    def call(w, o):
        return L.linear(x, w, norm=g, gated=gated, residual=o if residual else None, out=o)

    try:
        if table is L.TILES:                                  # the tile must also fit 4 row tiles (64 rows)
            L.linear(torch.randn(64, k, device="cuda", dtype=DT), ws[0], norm=g, gated=gated)
        return graph_time([lambda w=w, o=o: call(w, o) for w, o in zip(ws, outs)])
    finally:
        if saved is None:
            table.pop((n, k), None)
        else:
            table[(n, k)] = saved


def time_cublas(n, k, gated, m=1) -> float:
    ws = weights(2 * n if gated else n, k)
    x = torch.randn(m, k, device="cuda", dtype=DT)
    return graph_time([lambda w=w: F.linear(x, w) for w in ws])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--gemv", action="store_true", help="only the one-row GEMV's tiles (split K included)")
    ap.add_argument("--json")
    ap.add_argument("--calls", help="--gemv: only these GEMV_CALLS names (comma-separated)")
    ap.add_argument("--no-verify", action="store_true", help="--gemv: leave the tile kernel's verify sweep out")
    ap.add_argument("--schedule", default="", help="kernels.SCHEDULE entries to set first: key=value,...")
    args = ap.parse_args()
    kernels.set_schedule(args.schedule)
    if args.calls:
        names = args.calls.split(",")
        GEMV_CALLS[:] = [c for c in GEMV_CALLS if c[0] in names]
        if not GEMV_CALLS:
            raise SystemExit(f"--calls: none of {names} is a GEMV call")
    torch.manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda"))                # xrun bench's measurement
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s  triton {triton.__version__}"
          f"  schedule {kernels.SCHEDULE}")
    if args.gemv:
        out = {"copy_bandwidth": bw, "gemv": [], "gemv_tiles": {}}
        if not args.no_verify:
            verify_sweep(out)
        gemv_sweep(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    out = {"copy_bandwidth": bw, "linear": [], "attention": []}
    print(f"\n{'shape':<16}{'N':>8}{'K':>7} {'tile (bn,bk,w,s,split)':<22}{'us':>8}{'GB/s':>7}{'%bw':>6}  {'cublas us':>9}"
          f"{'%bw':>6}   m=7 us  m=32 us  invariant  rel err m=1/7/33")
    for name, n, k, gated in SHAPES:
        rep = {"name": name, "n": n, "k": k, "gated": gated}
        nbytes = (2 if gated else 1) * n * k * 2
        if args.sweep:
            results = []
            for tile in candidates(name, n, k, gated):
                try:
                    results.append((time_linear(n, k, gated, tile), tile))
                except Exception as e:                       # noqa: BLE001 - out of shared memory etc.
                    results.append((float("inf"), tile))
                    rep.setdefault("failed", []).append(f"{tile}: {type(e).__name__}")
            rep["sweep"] = [(t, list(tile)) for t, tile in results]
            t, tile = min(results)
        else:
            tile = L.tile_for(n, k)
            t = time_linear(n, k, gated, tile)
        L.TILES[(n, k)] = tuple(tile)                       # checked and timed below with the chosen tile
        if args.sweep and name.startswith(("8b", "eagle3")):
            # the one-row CUDA-core GEMV: kept for decode where it beats the tile kernel
            g_results = []
            for gt in GEMV:
                try:
                    g_results.append((time_linear(n, k, gated, gt, table=G.GEMV_TILES), gt))
                except Exception as e:                       # noqa: BLE001 - out of registers etc.
                    rep.setdefault("failed", []).append(f"gemv {gt}: {type(e).__name__}")
            rep["gemv_sweep"] = [(tg, list(gt)) for tg, gt in g_results]
            if g_results and min(g_results)[0] < t:
                rep["gemv"] = list(min(g_results)[1])
                rep["gemv_us"] = min(g_results)[0]
                G.GEMV_TILES[(n, k)] = tuple(rep["gemv"])
        check_linear(name, n, k, gated, rep)
        tc = time_cublas(n, k, gated)
        t7, t32 = time_linear(n, k, gated, tile, 7), time_linear(n, k, gated, tile, 32)
        rep.update(tile=list(tile), us=t, gbs=nbytes / t / 1e3, cublas_us=tc, us7=t7, us32=t32)
        out["linear"].append(rep)
        if args.json:                                       # written as it goes: a crash later keeps these
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        e = rep["rel_err"]
        if "gemv" in rep:
            print(f"{'  (one row)':<16}{'':>15} gemv {str(tuple(rep['gemv'])):<17}{rep['gemv_us']:>8.1f}"
                  f"{nbytes / rep['gemv_us'] / 1e3:>7.0f}")
        print(f"{name:<16}{n:>8}{k:>7} {str(tuple(tile)):<22}{t:>8.1f}{nbytes / t / 1e3:>7.0f}{100 * nbytes / t / 1e3 / (bw / 1e9):>6.0f}"
              f"  {tc:>9.1f}{100 * nbytes / tc / 1e3 / (bw / 1e9):>6.0f}  {t7:>7.1f}  {t32:>7.1f}  {str(rep['invariant']):>9}"
              f"  {e[1]:.1e}/{e[7]:.1e}/{e[33]:.1e}")
    print(f"\n{'attention':<12}{'ctx':>6}{'rows':>6}{'us':>8}{'rel err':>10}{'invariant':>10}")
    hq, hkv, d, smax = 32, 8, 128, 4352
    kc = torch.randn(1, hkv, smax, d, device="cuda", dtype=DT)
    vc = torch.randn(1, hkv, smax, d, device="cuda", dtype=DT)
    for ctx in (128, 1024, 4096):
        for m in (1, 7, 32):
            q = torch.randn(m, hq * d, device="cuda", dtype=DT)
            tm = (torch.rand(m, m, device="cuda") < 0.5) | torch.eye(m, dtype=torch.bool, device="cuda")
            tm = tm.tril().contiguous()
            wi = torch.tensor([ctx], device="cuda")
            y = attention(q, kc, vc, wi, tm, hq)
            err = rel(y, attention_reference(q, kc, vc, wi, tm, hq))
            inv = ""
            if m == 7:
                y1 = attention(q[:1], kc, vc, wi, tm[:1, :1].contiguous(), hq)
                inv = str(bool(torch.equal(y1[0], y[0])))
            t = graph_time([lambda: attention(q, kc, vc, wi, tm, hq)] * 20)
            out["attention"].append({"ctx": ctx, "rows": m, "us": t, "rel_err": err})
            print(f"{'split-kv':<12}{ctx:>6}{m:>6}{t:>8.1f}{err:>10.1e}{inv:>10}")
    from xcompile.compile.models.layers import rope_tables

    cos, sin = (t.cuda() for t in rope_tables(d, smax, 1e6))
    for m in (1, 7, 32):
        qkv = torch.randn(m, (hq + 2 * hkv) * d, device="cuda", dtype=DT)
        pos = torch.arange(m, device="cuda") + 100
        wi = torch.tensor([100], device="cuda")
        qn, kn = (torch.rand(d, device="cuda", dtype=DT) + 0.5 for _ in range(2))
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        a = rope_kv(qkv, pos, wi, cos, sin, k1, v1, hq, hkv, d, qn, kn)
        b = rope_kv_reference(qkv.cpu(), pos.cpu(), wi.cpu(), cos.cpu(), sin.cpu(), k2.cpu(), v2.cpu(), hq, hkv, d,
                              qn.cpu(), kn.cpu())
        t = graph_time([lambda: rope_kv(qkv, pos, wi, cos, sin, k1, v1, hq, hkv, d, qn, kn)] * 20)
        print(f"{'rope_kv':<12}{'':>6}{m:>6}{t:>8.1f}{rel(a.cpu(), b):>10.1e}")
    print(f"(attention chunk {chunk_for(smax)} keys per split)")
    out["tiles"] = {f"{n},{k}": list(L.tile_for(n, k)) for _, n, k, _ in SHAPES}
    out["gemv_tiles"] = {f"{n},{k}": list(t) for (n, k), t in G.GEMV_TILES.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
