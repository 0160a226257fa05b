"""Time the fast backend's split-KV attention (runtime/engines/kernels/attention.py) at long contexts, per chunk
size: what a verify block of several rows pays over a decode step's one row (issue 39, item 2).

    python benchmarks/attention_splits.py [--contexts 4096,16384,32000] [--rows 1,7,32] [--chunks 64,128,...]
                                          [--row-tiles 16,32] [--even 17,32,64] [--cache 32256]
                                          [--warps 4,8] [--stages 2,3]

One Qwen3-8B layer's attention (32 query heads over 8 KV heads of 128), bf16, on a cache of context + 64
slots: for each context, row count and --row-tiles value (query rows a program reads each KV tile for: a
7-token verify's 28 rows of a head group take two programs a split at 16, one at 32), the shipped layout
(attention.layout: one row's fixed chunk, several rows' even splits at 32 rows a tile, marked *), one row's
fixed chunk (attention.chunk_for) and each --chunks value, the median µs of one call (split kernel and reduction)
inside a CUDA graph of calls over rotating caches (so L2 never holds the keys; kernels.py's graph_time), its
GB/s of the live K/V bytes read, and that rate against the bytes a device copy moves a second here (read +
write: the memory system's rate, which a verify reading the keys once would approach). Each output is first
checked against the shipped layout's (the same softmax, summed in another order).

--even N,...: also the even layout (attention's ``even``): N splits share the live keys, the chunk picked at run
time from write_index, labelled eN. --cache SLOTS: a cache of that many slots for every context, as an engine
dir's max_seq_len sizes it (fixed chunks are then chosen for the whole cache, and splits past a shorter live
length idle); by default context + 64. --warps, --stages: the split kernel's num_warps and num_stages to time each
layout with (default: the shipped ones), labelled sN, and wN where not the shipped 4.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch
from batch_decode import positive_list  # benchmarks/: the scripts' shared option types and timing
from kernels import graph_time

from xcompile.runtime.bench.costs import copy_bandwidth
from xcompile.runtime.engines.kernels import attention as A

HQ, HKV, D = 32, 8, 128
COPIES = 8          # caches rotated through the graph: 8 x 2 x 8 x 32K x 128 x 2 B = 1 GB at 32K, past L2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=positive_list, default=[4096, 16384, 32000])
    ap.add_argument("--rows", type=positive_list, default=[1, 7, 32])
    ap.add_argument("--chunks", type=positive_list, default=[64, 128, 256, 512, 1024])
    ap.add_argument("--row-tiles", type=positive_list, default=[16, 32],
                    help="query rows (token x head of a group) a program reads each KV tile for (the shipped "
                    "layout's is timed too)")
    ap.add_argument("--even", type=positive_list, default=[], help="split counts of the even layout to time too")
    ap.add_argument("--cache", type=int, help="cache slots for every context (default: context + 64)")
    ap.add_argument("--warps", type=positive_list, default=[A.WARPS], help="the split kernel's num_warps values")
    ap.add_argument("--stages", type=positive_list, help="the split kernel's num_stages values (default: the "
                    "shipped attention.stages_for)")
    args = ap.parse_args()
    if max(args.rows) > A.MAX_ROWS:
        ap.error(f"--rows: at most {A.MAX_ROWS} rows a call")
    if any(c % A.BLOCK_S for c in args.chunks):
        ap.error(f"--chunks: each a multiple of {A.BLOCK_S} keys")
    if any(t not in (16, 32, 64) for t in args.row_tiles):
        ap.error("--row-tiles: each 16, 32 or 64")
    if args.cache is not None and args.cache < max(args.contexts) + A.MAX_ROWS:
        ap.error(f"--cache {args.cache}: shorter than the longest context + {A.MAX_ROWS} "
                 f"({max(args.contexts) + A.MAX_ROWS})")
    if not torch.cuda.is_available():
        print("attention_splits.py times the kernels on a GPU: no CUDA device is visible here", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    print(f"{'context':>8} {'rows':>4} {'tile':>4} {'chunk':>10} {'splits':>6} {'us':>8} {'GB/s':>6} {'of copy':>7}")
    for ctx in args.contexts:
        slots = args.cache or ctx + A.MAX_ROWS
        caches = torch.randn(COPIES, 2, 1, HKV, slots, D, device=dev, dtype=torch.bfloat16)
        for m in args.rows:
            q = torch.randn(m, HQ * D, device=dev, dtype=torch.bfloat16)
            wi = torch.tensor([ctx - m], device=dev)
            mask = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
            shipped = A.layout(slots, m)                            # {chunk or even, row_tile}
            tile0 = shipped.pop("row_tile")
            want = A.attention(q, caches[0, 0], caches[0, 1], wi, mask, HQ)
            candidates = [shipped] + [dict(chunk=c) for c in [A.chunk_for(slots, m)] + args.chunks]
            candidates += [dict(even=n) for n in args.even]
            layouts = [lay for i, lay in enumerate(candidates) if lay not in candidates[:i]]
            tiles = args.row_tiles + [tile0] * (tile0 not in args.row_tiles)
            for tile, layout, warps, stages in itertools.product(tiles, layouts, args.warps, args.stages or [None]):
                if "even" in layout:
                    label, splits = f"e{layout['even']}", min(layout["even"], math.ceil(slots / A.BLOCK_S))
                else:
                    label, splits = f"{layout['chunk']}", math.ceil(slots / layout["chunk"])
                programs = HKV * splits * math.ceil(HQ // HKV * m / tile)          # attention's grid
                shipped_stages = A.stages_for(layout.get("even", 0), programs, dev)
                stages = stages or shipped_stages
                launch = dict(row_tile=tile, warps=warps, stages=stages, **layout)
                got = A.attention(q, caches[0, 0], caches[0, 1], wi, mask, HQ, **launch)
                if ((got.float() - want.float()).norm() / want.float().norm()).item() > 2e-2:
                    print(f"{layout}, tile {tile}: output differs from the shipped one's at context {ctx}, {m} rows")
                    return 1
                us = graph_time([lambda i=i: A.attention(q, caches[i, 0], caches[i, 1], wi, mask, HQ, **launch)
                                 for i in range(COPIES)])
                read = 2 * HKV * ctx * D * 2
                rate = read / (us / 1e6)
                label += f"w{warps}" * (warps != A.WARPS) + f"s{stages}"
                label += "*" if layout == shipped and tile == tile0 and (warps, stages) == (A.WARPS, shipped_stages) \
                    else ""
                print(f"{ctx:>8} {m:>4} {tile:>4} {label:>10} {splits:>6} {us:>8.1f} "
                      f"{rate / 1e9:>6.0f} {100 * rate / bandwidth:>6.0f}%")
    print("* the shipped layout and tile (attention.layout); eN: the even layout over N splits; 'of copy': the K/V "
          "bytes read a second against the bytes a copy moves a second (read + write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
