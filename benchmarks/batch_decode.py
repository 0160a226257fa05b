"""The continuous-batching loop on the fast backend (runtime/decoding/batch.py): aggregate decoding speed of a
``--max-batch B`` target against one stream on the same dir and against the batch-1 loop, on a GPU; and the
same loop's steps verifying EAGLE3 chains (batch_drafts.py), projected at an acceptance.

    python benchmarks/batch_decode.py [--layers 36] [--batches 1,4,16,64] [--gammas 0,3,6] [--tau 3.7]
                                      [--new-tokens 256] [--prompt-tokens 16] [--no-graphs] [--json FILE]
    python benchmarks/batch_decode.py --tiny ...      # the tests' tiny shape in Triton's interpreter (CPU)

Weights are seeded synthetic ones drawn on the device (Qwen3-8B's shape cut to --layers, its EAGLE3 head), bf16.
Per B and gamma it opens a target whose KV holds B slots, warms the loop up (every step size compiled, the
one-token step and the verify step recorded), then times
    one        a single sequence of --new-tokens alone on that dir (each step still computes all B rows)
    all        B sequences together, submitted at once: aggregate generated tokens / wall time
    step       the median ms of the steps in which every row decoded (no prompt chunk)
    TTFT       the median of the B sequences' times to their first token
and, once, plain decoding on the batch-1 loop (Generator, whole-round CUDA graphs), the speed one stream has on
a ``--max-batch 1`` dir. Gamma 0 is plain batch decoding. With gamma > 0 (at most 64 // B - 1) every greedy row
verifies a chain of gamma drafts a step; a synthetic head's drafts are all but never accepted, so the measured
tok/s is the cost side, and "proj" projects the aggregate at --tau tokens a row a verify step: B * tau / the
step's median ms (the head's passes inside it). Issue 37's goals read off it: B = 16 aggregate >= 10x one stream, one
stream on a batch dir against the batch-1 loop, and which of plain and drafting steps gives more at each B.
Greedy; the tokens are not checked here (tests/runtime/decoding/test_batch.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time

import torch

from xcompile.compile.config import KNOWN_MODELS, Qwen3Config
from xcompile.compile.reference import reference_engines, synthetic_manifest
from xcompile.runtime.decoding.batch import BatchGenerator
from xcompile.runtime.decoding.batch_drafts import BatchDrafts, max_gamma
from xcompile.runtime.decoding.drafters import Eagle3ChainDrafter, NoDrafter
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.enginedir.contract import EAGLE3, EAGLE3_FC, TARGET
from xcompile.runtime.engines.graphs import CudaGraphCapture
from xcompile.runtime.engines.load import fast_engines

TINY = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, rope_theta=10000.0)


def _int_list(text: str, least: int, what: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {what}, comma-separated")
    return values


def positive_list(text: str) -> list[int]:
    return _int_list(text, 1, "positive integers")


def gamma_list(text: str) -> list[int]:
    """Chain lengths, 0 (plain steps) or more."""
    return _int_list(text, 0, "chain lengths >= 0")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def open_fast(cfg: Qwen3Config, max_seq_len: int, batch: int, dtype: str, device: torch.device):
    """Fast engines of seeded synthetic weights of ``cfg`` and its EAGLE3 head, KV for ``batch`` slots, and the
    head's d2t."""
    m = synthetic_manifest("qwen3-8b", max_seq_len, dtype, config=cfg, max_batch=batch)
    ref = reference_engines(m, device)
    return fast_engines(m, ref), ref[EAGLE3].module.d2t


def prompts(n: int, tokens: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, vocab, (n, tokens), generator=g).tolist()


def level(cfg: Qwen3Config, batch: int, gamma: int, args, max_seq_len: int, dtype: str, device) -> dict:
    """One --max-batch B target, its steps plain (gamma 0) or verifying chains: one stream alone, then B streams
    together (module docstring)."""
    engines, d2t = open_fast(cfg, max_seq_len, batch, dtype, device)
    target = engines[TARGET]
    # break_even 0: every step verifies (a synthetic head accepts nothing, so the loop's rule would stop drafting)
    drafts = BatchDrafts(Eagle3ChainDrafter(engines[EAGLE3], engines[EAGLE3_FC], d2t, gamma), batch, max_seq_len,
                         target.device, 0.0) if gamma else None
    capture = CudaGraphCapture() if args.graphs and target.device.type == "cuda" else None
    loop = BatchGenerator(target, [], max_seq_len, capture=capture, drafts=drafts)
    loop.warm_up()
    step_ms = []
    step = loop.step

    def timed_step():                       # a step in which every running row decodes: the steady state
        decoding = all(not q.prefilling for q in loop.running) and not loop.waiting and loop.running
        sync(target.device)
        t = time.perf_counter()
        out = step()
        sync(target.device)
        if decoding:
            step_ms.append(1e3 * (time.perf_counter() - t))
        return out

    loop.step = timed_step
    row = {"batch": batch, "gamma": gamma}
    for name, n in (("one", 1), ("all", batch)):
        step_ms.clear()
        sync(target.device)
        t = time.perf_counter()
        results = loop.generate([(p, args.new_tokens) for p in prompts(n, args.prompt_tokens, cfg.vocab_size)])
        sync(target.device)
        wall = time.perf_counter() - t
        tokens = sum(len(r.tokens) for r in results)
        ms = statistics.median(step_ms) if step_ms else None
        row[name] = {"tok_s": round(tokens / wall, 1), "wall_s": round(wall, 3), "tokens": tokens,
                     "step_ms": round(ms, 3) if ms else None,
                     "ttft_ms": round(1e3 * statistics.median(r.stats.prefill_s for r in results), 2),
                     "accepted": sum(r.stats.accepted for r in results),
                     # tokens a second were every row to emit tau tokens a step (1 without drafts)
                     "projected_tok_s": round(n * (args.tau if gamma else 1) * 1e3 / ms, 1) if ms else None}
    row["all_over_one"] = round(row["all"]["tok_s"] / row["one"]["tok_s"], 2)
    for e in engines.values():
        e.close()
    return row


def batch1(cfg: Qwen3Config, args, max_seq_len: int, dtype: str, device) -> dict:
    """Plain decoding on the batch-1 loop: one stream's tokens a second."""
    engines, _ = open_fast(cfg, max_seq_len, 1, dtype, device)
    engine = engines[TARGET]
    gen = Generator(engine, NoDrafter(), [], max_seq_len,
                    options=LoopOptions(cuda_graphs=args.graphs and engine.device.type == "cuda"))
    prompt = prompts(1, args.prompt_tokens, cfg.vocab_size)[0]
    gen.generate(prompt, args.new_tokens)                                  # compiles and records
    sync(engine.device)
    t = time.perf_counter()
    r = gen.generate(prompt, args.new_tokens)
    sync(engine.device)
    wall = time.perf_counter() - t
    for e in engines.values():
        e.close()
    # tokens over the wall time, the prefill included, as the levels count them
    return {"tok_s": round(len(r.tokens) / wall, 1), "ttft_ms": round(1e3 * r.stats.prefill_s, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36, help="of the Qwen3-8B shape")
    ap.add_argument("--batches", type=positive_list, default=[1, 4, 16, 64], help="KV slots B of each level")
    ap.add_argument("--gammas", type=gamma_list, default=[0, 3, 6],
                    help="drafts a verify step chains per row (0: plain steps; each B takes those <= 64 // B - 1)")
    ap.add_argument("--tau", type=float, default=3.7, help="tokens a row a verify step, for the projection")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="run every step eagerly")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny shape on the CPU, in Triton's interpreter")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    for name in ("layers", "new_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.tau < 1:
        ap.error("--tau must be at least 1 (the bonus token)")
    if args.tiny:
        cfg, dtype, device = dataclasses.replace(TINY, num_hidden_layers=min(args.layers, 2)), "fp32", "cpu"
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device is visible here; this times the fast kernels on a GPU (--tiny: the CPU)",
                  file=sys.stderr)
            return 1
        cfg = dataclasses.replace(KNOWN_MODELS["qwen3-8b"].config, num_hidden_layers=args.layers)
        dtype, device = "bf16", "cuda"
    device = torch.device(device)
    max_seq_len = args.prompt_tokens + args.new_tokens + max(args.gammas) + 2     # and a verify step's chain
    report = {"layers": cfg.num_hidden_layers, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
              "graphs": args.graphs, "tau": args.tau,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "batch1": batch1(cfg, args, max_seq_len, dtype, device)}
    print(f"batch-1 loop: {report['batch1']['tok_s']} tok/s one stream")
    print(f"{'B':>4} {'gamma':>5} {'one tok/s':>10} {'all tok/s':>10} {'all/one':>8} {'step ms':>8} {'TTFT ms':>8} "
          f"{'proj tok/s':>10}")
    report["levels"] = []
    for b in args.batches:
        for gamma in [g for g in args.gammas if g <= max_gamma(b)]:
            row = level(cfg, b, gamma, args, max_seq_len, dtype, device)
            gc.collect()                    # the level's weights and graphs, before the next draws its own
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report["levels"].append(row)
            a = row["all"]
            print(f"{b:>4} {gamma:>5} {row['one']['tok_s']:>10} {a['tok_s']:>10} {row['all_over_one']:>8} "
                  f"{a['step_ms']!s:>8} {a['ttft_ms']:>8} {a['projected_tok_s']!s:>10}")
    print(f"proj: B x tau / step ms, tau {args.tau} with drafts (1 without); a synthetic head's drafts are all but "
          "never accepted, so the measured tok/s is the cost side")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
