"""What quantizing costs the demo pair (compile/demo): the demo target quantized by ``xcompile quantize``'s
function with each scheme, each compared with the bf16 checkpoint on the CPU. Not a test: a few minutes (AWQ).

    python benchmarks/quant_quality.py [--calibration data/corpus.train.txt] [--samples 64] [--seq-len 512]
        [--heldout data/corpus.heldout.txt] [--window 512] [--prompts 32] [--new-tokens 128] [--gamma 4]

For bf16 (the shipped checkpoint), fp8 and int4-awq, every model computing in fp32 (so only the weights differ):

    agreement    teacher-forced top-1 agreement with bf16: the argmax of each position's logits over the held-out
                 text, cut into windows of --window tokens, equal to bf16's
    perplexity   exp(mean next-token cross-entropy) over the same positions
    flips        bf16's top-2 logit gap at the positions whose argmax differs (median), against all positions'
    tau          EAGLE3 τ with the demo head, greedy chain of --gamma on the torch backend (tokens emitted per
                 verify round, runtime/decoding/outcome.py): --prompts held-out prompts (the first 48 tokens of
                 held-out documents 0, 1, ...), --new-tokens each

Calibration (both schemes: GPTQ, and AWQ before it for int4-awq) reads the training text by default, so the
held-out text it is scored on stays unseen.
Prints a table, then the JSON report (one object per model) that docs/perf keeps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from xcompile.compile import checkpoint as ck
from xcompile.compile import data as textdata
from xcompile.compile.acceptance import measure_acceptance
from xcompile.compile.errors import CompileError
from xcompile.compile.head_config import parse_eagle3
from xcompile.compile.hf_config import parse_qwen3
from xcompile.compile.quantize import SCHEMES, QuantizeOptions, quantize_checkpoint
from xcompile.runtime.enginedir.text import Text

DATA = Path(__file__).resolve().parents[1] / "data"
PROMPT_TOKENS = 48
# issue 36's goals against bf16: agreement at least, perplexity and τ within (relative)
GOALS = {"fp8": (0.99, 0.01, 0.03), "int4-awq": (0.96, 0.05, 0.08)}


@torch.no_grad()
def teacher_forced(model, windows: torch.Tensor, kv_dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Argmax ids [N, S-1] of each window's positions but the last, their top-2 logit gaps [N, S-1], and the mean
    next-token cross-entropy (``kv_dtype``: the cache's dtype, default the model's)."""
    ids, gaps, nll = [], [], 0.0
    s = windows.shape[1]
    positions = torch.arange(s).unsqueeze(0)
    causal = torch.ones(s, s, dtype=torch.bool).tril().unsqueeze(0)
    for w in windows:
        logits = model(w.unsqueeze(0), positions, torch.zeros(1, dtype=torch.int64), causal, positions,
                       *model.new_kv(dtype=kv_dtype))[0][0, :-1].float()                        # [S-1, V]
        ids.append(logits.argmax(-1))
        top = logits.topk(2).values
        gaps.append(top[:, 0] - top[:, 1])
        nll += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
    return torch.stack(ids), torch.stack(gaps), nll / (windows.shape[0] * (s - 1))


def heldout_args(parser: argparse.ArgumentParser, *counts: str) -> argparse.Namespace:
    """The held-out measurement's options (--heldout, --window, --prompts, --new-tokens, --gamma) added and parsed,
    each count (and ``counts``) at least 1."""
    parser.add_argument("--heldout", type=Path, default=DATA / "corpus.heldout.txt")
    parser.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args()
    for name in (*counts, "window", "prompts", "new_tokens", "gamma"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.heldout.is_file():
        parser.error(f"--heldout {args.heldout}: no such file")
    return args


def demo_heldout(args: argparse.Namespace) -> tuple[Path, Path, torch.Tensor, list[list[int]]]:
    """The demo target's and head's dirs, the held-out text's windows of --window tokens, and the first
    PROMPT_TOKENS tokens of the first --prompts held-out documents that long."""
    target_dir, head_dir = ck.resolve("demo"), ck.resolve_eagle3("demo", "")
    text = Text(target_dir)
    records = textdata.read_records(args.heldout)
    windows = textdata.pack(textdata.tokenize(records, text), textdata.doc_end_id(text), args.window)
    prompts = [ids[:PROMPT_TOKENS] for ids in textdata.tokenize(records, text) if len(ids) >= PROMPT_TOKENS]
    return target_dir, head_dir, windows, prompts[:args.prompts]


def compare(results: dict[str, dict], base_name: str, key: str) -> dict[str, dict]:
    """Each result's report row against ``results[base_name]``: agreement, perplexity and τ and their deltas,
    and the base's top-2 logit gap where the argmax differs against its median everywhere (how near a tie the
    flipped positions were)."""
    base, rows = results[base_name], {}
    for name, r in results.items():
        differs = r["argmax"] != base["argmax"]
        rows[name] = {key: name, "agreement": float((~differs).float().mean()), "perplexity": r["perplexity"],
                      "perplexity_delta": r["perplexity"] / base["perplexity"] - 1, "tau": r["tau"],
                      "tau_delta": r["tau"] / base["tau"] - 1, "match_plain": r["match_plain"],
                      "positions": base["argmax"].numel(),
                      "flipped_gap_median": float(base["gaps"][differs].median()) if differs.any() else None,
                      "gap_median": float(base["gaps"].median())}
    return rows


def evaluate(target_dir: Path, head_dir: Path, windows: torch.Tensor, prompts: list[list[int]], args) -> dict:
    cfg = parse_qwen3(target_dir / "config.json")
    taps = ck.tap_layers(parse_eagle3(head_dir / "config.json"), cfg)
    n = max(args.window, PROMPT_TOKENS + args.new_tokens + args.gamma + 1)
    target = ck.load_qwen3(target_dir, n, taps, dtype=torch.float32)
    head = ck.load_eagle3(head_dir, target, n)
    argmax, gaps, nll = teacher_forced(target, windows)
    tau = measure_acceptance(target, head, prompts, args.new_tokens, args.gamma)
    return {"argmax": argmax, "gaps": gaps, "perplexity": float(torch.tensor(nll).exp()), "tau": tau["tau"],
            "match_plain": tau["match_plain"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, default=DATA / "corpus.train.txt")
    parser.add_argument("--samples", type=int, default=64, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    args = heldout_args(parser, "samples", "seq_len")
    target_dir, head_dir, windows, prompts = demo_heldout(args)

    dirs, seconds = {"bf16": target_dir}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in SCHEMES:
            opts = QuantizeOptions(scheme, args.calibration, args.samples, args.seq_len)
            start = time.monotonic()
            quantize_checkpoint(target_dir, Path(tmp) / scheme, opts, log=lambda m: print(m, file=sys.stderr))
            seconds[scheme] = round(time.monotonic() - start, 1)
            dirs[scheme] = Path(tmp) / scheme
        results = {name: evaluate(d, head_dir, windows, prompts, args) for name, d in dirs.items()}

    report = []
    for name, row in compare(results, "bf16", "model").items():
        row["quantize_s"] = seconds.get(name, 0.0)
        if name in GOALS:
            agree, ppl, tau = GOALS[name]
            row["goals_met"] = {"agreement": row["agreement"] >= agree, "perplexity": row["perplexity_delta"] <= ppl,
                                "tau": abs(row["tau_delta"]) <= tau}
        report.append(row)
    print_report(report, "model", lambda row: str(row.get("goals_met", "")))
    return 0


def print_report(report: list[dict], key: str, last: Callable[[dict], str]) -> None:
    """The rows as a table (``last``: each row's last column), then the JSON report that docs/perf keeps."""
    print(f"{key:10} {'agreement':>10} {'perplexity':>18} {'tau':>16}")
    for row in report:
        print(f"{row[key]:10} {row['agreement']:10.2%} {row['perplexity']:8.3f} ({row['perplexity_delta']:+6.2%}) "
              f"{row['tau']:7.3f} ({row['tau_delta']:+6.2%})  {last(row)}")
    print(json.dumps(report, indent=2))


def run(main: Callable[[], int]) -> None:
    """``main``'s exit status; a CompileError (the demo checkpoints unreadable) as one line, status 1."""
    try:
        sys.exit(main())
    except CompileError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    run(main)
