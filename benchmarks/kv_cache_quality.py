"""What an FP8 KV cache costs the demo pair (compile/demo; issue 39 item 4): the demo target computing in bf16
with its KV cache in bf16 and in FP8 (e4m3, unscaled, values past +-448 saturated), on the CPU (torch backend).

    python benchmarks/kv_cache_quality.py [--heldout data/corpus.heldout.txt] [--window 512] [--prompts 32]
        [--new-tokens 128] [--gamma 4]

As benchmarks/quant_quality.py defines them, FP8 against bf16:
    agreement    teacher-forced top-1 agreement: each position's argmax over the held-out text, cut into windows of
                 --window tokens (each window one causal pass, which writes its keys and values into the cache
                 and reads them back from it, rounded as a decode step would read them)
    perplexity   exp(mean next-token cross-entropy) over the same positions
    flips        bf16's top-2 logit gap at the positions whose argmax differs (median), against all positions'
    tau          EAGLE3 τ with the demo head (its own cache in bf16), greedy chain of --gamma, and the fraction of
                 prompts whose speculative output equals plain greedy's on the same cache
Prints a table, then the JSON report that docs/perf keeps.
"""

from __future__ import annotations

import argparse

import torch
from quant_quality import (  # benchmarks/: the measures of the quantized models, against the bf16 cache
    PROMPT_TOKENS,
    compare,
    demo_heldout,
    heldout_args,
    print_report,
    run,
    teacher_forced,
)

from xcompile.compile import checkpoint as ck
from xcompile.compile.acceptance import measure_acceptance
from xcompile.compile.head_config import parse_eagle3
from xcompile.compile.hf_config import parse_qwen3

CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def main() -> int:
    args = heldout_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    target_dir, head_dir, windows, prompts = demo_heldout(args)
    cfg = parse_qwen3(target_dir / "config.json")
    n = max(args.window, PROMPT_TOKENS + args.new_tokens + args.gamma + 1)
    target = ck.load_qwen3(target_dir, n, ck.tap_layers(parse_eagle3(head_dir / "config.json"), cfg),
                           dtype=torch.bfloat16)
    head = ck.load_eagle3(head_dir, target, n)
    results = {}
    for name, dtype in CACHES.items():
        argmax, gaps, nll = teacher_forced(target, windows, dtype)
        tau = measure_acceptance(target, head, prompts, args.new_tokens, args.gamma, kv_dtype=dtype)
        results[name] = {"argmax": argmax, "gaps": gaps, "perplexity": float(torch.tensor(nll).exp()),
                         "tau": tau["tau"], "match_plain": tau["match_plain"]}
    report = list(compare(results, "bf16", "cache").values())
    print_report(report, "cache", lambda row: f"speculative = plain {row['match_plain']:.0%}")
    return 0


if __name__ == "__main__":
    run(main)
