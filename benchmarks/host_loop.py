"""The generation loop's host side on a GPU: plain decode and a gamma-6 EAGLE3 chain through ``Generator``,
round graphs on, with and without pipelining (each round launched before the previous outcome is read)
and with the fused greedy verification and draft picks (kernels/accept.py) or torch's small ops.

    python benchmarks/host_loop.py [--layers 36] [--tokens 256] [--repeats 7] [--drafters plain,chain]
        [--modes 00,10,01,11]

Weights are random, drawn on the GPU as in benchmarks/fast_decode.py (the Qwen3-8B shape; speed does not
depend on their values), so acceptance is whatever the random head gets: the figures are ms per round.
Prints ms/round of each mode (best and median of the repeats, the modes interleaved) and, for
comparison, the graphed target decode step alone (the same weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from fast_decode import DEV, graphed_ms, random_, step_inputs

from xcompile.compile.config import KNOWN_MODELS, synthetic_eagle3_config
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.compile.reference import eagle3_engines, qwen3_engine
from xcompile.runtime.decoding.drafters import Eagle3ChainDrafter, NoDrafter
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.engines.fast import FastEagle3Engine, FastFCEngine, FastQwen3Engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--drafters", default="plain,chain", help="which of plain, chain")
    ap.add_argument("--modes", default="00,10,01,11", help="fused / pipeline bits of each mode, e.g. 01,11")
    args = ap.parse_args()
    torch.manual_seed(0)
    max_seq_len = 1024
    cfg = dataclasses.replace(KNOWN_MODELS["qwen3-8b"].config, num_hidden_layers=args.layers)
    taps = tuple(sorted({1, args.layers // 2 - 1, args.layers - 4}))
    with torch.device(DEV):
        target = random_(Qwen3(cfg, max_seq_len, taps).to(torch.bfloat16))
        head = Eagle3(synthetic_eagle3_config(cfg), max_seq_len).to(torch.bfloat16)
    head.embed_tokens.weight = target.model.embed_tokens.weight
    random_(head)
    fast = FastQwen3Engine(qwen3_engine(target), dataclasses.asdict(cfg), taps)
    fast.new_kv()
    e3, fc = eagle3_engines(head, max_seq_len)
    fe3, ffc = FastEagle3Engine(e3, dataclasses.asdict(head.cfg)), FastFCEngine(fc, {})
    fe3.new_kv()
    print(f"graphed target decode step: {graphed_ms(fast.run, step_inputs(1, 128, cfg.vocab_size)):.3f} ms")
    prompt = torch.randint(0, cfg.vocab_size, (128,)).tolist()
    drafters = {"plain": NoDrafter, "chain": lambda: Eagle3ChainDrafter(fe3, ffc, None, 6)}
    modes = [(m[0] == "1", m[1] == "1") for m in args.modes.split(",")]
    gens = {}
    for name in args.drafters.split(","):
        make = drafters[name]
        for fused, pipeline in modes:
            gen = Generator(fast, make(), [], max_seq_len, options=LoopOptions(cuda_graphs=True, pipeline=pipeline, fused=fused))
            gen.generate(prompt, 16)                                            # warm-up, round graph capture
            label = "eagle3 chain g=6" if name == "chain" else name
            gens[f"{label:<18} fused={int(fused)} pipeline={int(pipeline)}"] = gen
    times: dict[str, list[float]] = {key: [] for key in gens}
    for _ in range(args.repeats):                   # the modes interleaved: a drift of the clocks hits them all
        for key, gen in gens.items():
            s = gen.generate(prompt, args.tokens).stats
            times[key].append(1e3 * s.decode_s / s.rounds)
    for key, ts in times.items():
        print(f"{key}  best {min(ts):.3f}  median {statistics.median(ts):.3f} ms/round "
              f"({args.repeats} runs of {args.tokens} tokens, interleaved)")


if __name__ == "__main__":
    main()
