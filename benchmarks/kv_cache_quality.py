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
import json
import sys
from pathlib import Path

import torch

from xcompile.compile import checkpoint as ck
from xcompile.compile import data as textdata
from xcompile.compile.config import parse_eagle3, parse_qwen3
from xcompile.compile.errors import CompileError
from xcompile.compile.train import measure_acceptance
from xcompile.runtime.enginedir.text import Text

DATA = Path(__file__).resolve().parents[1] / "data"
PROMPT_TOKENS = 48
CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@torch.no_grad()
def teacher_forced(model, windows: torch.Tensor, kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Argmax ids [N, S-1] of each window's positions but the last, their top-2 logit gaps, the mean cross-entropy."""
    ids, gaps, nll = [], [], 0.0
    s = windows.shape[1]
    positions = torch.arange(s).unsqueeze(0)
    causal = torch.ones(s, s, dtype=torch.bool).tril().unsqueeze(0)
    for w in windows:
        logits = model(w.unsqueeze(0), positions, torch.zeros(1, dtype=torch.int64), causal, positions,
                       *model.new_kv(dtype=kv_dtype))[0][0, :-1].float()
        ids.append(logits.argmax(-1))
        top = logits.topk(2).values
        gaps.append(top[:, 0] - top[:, 1])
        nll += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
    return torch.stack(ids), torch.stack(gaps), nll / (windows.shape[0] * (s - 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout", type=Path, default=DATA / "corpus.heldout.txt")
    parser.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args()
    for name in ("window", "prompts", "new_tokens", "gamma"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.heldout.is_file():
        parser.error(f"--heldout {args.heldout}: no such file")
    target_dir, head_dir = ck.resolve("demo"), ck.resolve_eagle3("demo", "")
    text = Text(target_dir)
    records = textdata.read_records(args.heldout)
    windows = textdata.pack(textdata.tokenize(records, text), textdata.doc_end_id(text), args.window)
    prompts = [ids[:PROMPT_TOKENS] for ids in textdata.tokenize(records, text) if len(ids) >= PROMPT_TOKENS]
    prompts = prompts[:args.prompts]
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
    base, report = results["bf16"], []
    for name, r in results.items():
        differs = r["argmax"] != base["argmax"]
        report.append({"cache": name, "agreement": float((~differs).float().mean()), "perplexity": r["perplexity"],
                       "perplexity_delta": r["perplexity"] / base["perplexity"] - 1, "tau": r["tau"],
                       "tau_delta": r["tau"] / base["tau"] - 1, "match_plain": r["match_plain"],
                       "positions": base["argmax"].numel(),
                       "flipped_gap_median": float(base["gaps"][differs].median()) if differs.any() else None,
                       "gap_median": float(base["gaps"].median())})
    print(f"{'cache':6} {'agreement':>10} {'perplexity':>18} {'tau':>16} {'spec = plain':>13}")
    for row in report:
        print(f"{row['cache']:6} {row['agreement']:10.2%} {row['perplexity']:8.3f} ({row['perplexity_delta']:+6.2%}) "
              f"{row['tau']:7.3f} ({row['tau_delta']:+6.2%}) {row['match_plain']:13.0%}")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CompileError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
