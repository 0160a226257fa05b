"""The continuous-batching loop on the fast backend (runtime/decoding/batch.py): aggregate decoding speed of a
``--max-batch B`` target against one stream on the same dir and against the batch-1 loop, on a GPU.

    python benchmarks/batch_decode.py [--layers 36] [--batches 1,4,16,64] [--new-tokens 256]
                                      [--prompt-tokens 16] [--no-graphs] [--json FILE]
    python benchmarks/batch_decode.py --tiny ...      # the tests' tiny shape in Triton's interpreter (CPU)

Weights are random, drawn on the GPU (Qwen3-8B's shape cut to --layers), bf16. Per B it opens a target whose KV
holds B slots, warms the loop up (every step size compiled, the one-token step recorded), then times
    one        a single sequence of --new-tokens alone on that dir (each step still computes all B rows)
    all        B sequences together, submitted at once: aggregate generated tokens / wall time
    step       the median ms of the steps in which every row decoded (no prompt chunk)
    TTFT       the median of the B sequences' times to their first token
and, once, plain decoding on the batch-1 loop (Generator, whole-round CUDA graphs), the speed one stream has on
a ``--max-batch 1`` dir. Issue 37's goals read off it: B = 16 aggregate >= 10x one stream, and one stream on a
batch dir against the batch-1 loop. Greedy; the tokens are not checked here (tests/runtime/engines/test_fast.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from xcompile.compile.config import KNOWN_MODELS, Qwen3Config
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.compile.reference import qwen3_engine
from xcompile.runtime.decoding.batch import BatchGenerator
from xcompile.runtime.decoding.drafters import NoDrafter
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.engines.fast import FastQwen3Engine
from xcompile.runtime.engines.graphs import CudaGraphCapture

TINY = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, rope_theta=10000.0)


def positive_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, comma-separated")
    return values


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_target(cfg: Qwen3Config, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> Qwen3:
    """Random weights drawn on the device, norms ones."""
    with torch.device(device):
        module = Qwen3(cfg, max_seq_len).to(dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else 0.02 * torch.randn_like(p))
    return module.eval()


def prompts(n: int, tokens: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, vocab, (n, tokens), generator=g).tolist()


def level(module: Qwen3, cfg: Qwen3Config, batch: int, args, max_seq_len: int) -> dict:
    """One --max-batch B target: one stream alone, then B streams together (module docstring)."""
    engine = FastQwen3Engine(qwen3_engine(module, max_seq_len=max_seq_len, batch=batch), dataclasses.asdict(cfg))
    capture = CudaGraphCapture() if args.graphs and engine.device.type == "cuda" else None
    loop = BatchGenerator(engine, [], max_seq_len, capture=capture)
    loop.warm_up()
    step_ms = []
    step = loop.step

    def timed_step():                       # a step in which every running row decodes: the steady state
        decoding = all(not q.prefilling for q in loop.running) and not loop.waiting and loop.running
        sync(engine.device)
        t = time.perf_counter()
        out = step()
        sync(engine.device)
        if decoding:
            step_ms.append(1e3 * (time.perf_counter() - t))
        return out

    loop.step = timed_step
    row = {"batch": batch}
    for name, n in (("one", 1), ("all", batch)):
        step_ms.clear()
        sync(engine.device)
        t = time.perf_counter()
        results = loop.generate([(p, args.new_tokens) for p in prompts(n, args.prompt_tokens, cfg.vocab_size)])
        sync(engine.device)
        wall = time.perf_counter() - t
        tokens = sum(len(r.tokens) for r in results)
        row[name] = {"tok_s": round(tokens / wall, 1), "wall_s": round(wall, 3), "tokens": tokens,
                     "step_ms": round(statistics.median(step_ms), 3) if step_ms else None,
                     "ttft_ms": round(1e3 * statistics.median(r.stats.prefill_s for r in results), 2)}
    row["all_over_one"] = round(row["all"]["tok_s"] / row["one"]["tok_s"], 2)
    engine.close()
    return row


def batch1(module: Qwen3, cfg: Qwen3Config, args, max_seq_len: int) -> dict:
    """Plain decoding on the batch-1 loop: one stream's tokens a second."""
    engine = FastQwen3Engine(qwen3_engine(module, max_seq_len=max_seq_len), dataclasses.asdict(cfg))
    gen = Generator(engine, NoDrafter(), [], max_seq_len,
                    options=LoopOptions(cuda_graphs=args.graphs and engine.device.type == "cuda"))
    prompt = prompts(1, args.prompt_tokens, cfg.vocab_size)[0]
    gen.generate(prompt, args.new_tokens)                                  # compiles and records
    sync(engine.device)
    t = time.perf_counter()
    r = gen.generate(prompt, args.new_tokens)
    sync(engine.device)
    wall = time.perf_counter() - t
    engine.close()
    # tokens over the wall time, the prefill included, as the levels count them
    return {"tok_s": round(len(r.tokens) / wall, 1), "ttft_ms": round(1e3 * r.stats.prefill_s, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36, help="of the Qwen3-8B shape")
    ap.add_argument("--batches", type=positive_list, default=[1, 4, 16, 64], help="KV slots B of each level")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="run every step eagerly")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny shape on the CPU, in Triton's interpreter")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    for name in ("layers", "new_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.tiny:
        cfg, dtype, device = dataclasses.replace(TINY, num_hidden_layers=min(args.layers, 2)), torch.float32, "cpu"
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device is visible here; this times the fast kernels on a GPU (--tiny: the CPU)",
                  file=sys.stderr)
            return 1
        cfg = dataclasses.replace(KNOWN_MODELS["qwen3-8b"].config, num_hidden_layers=args.layers)
        dtype, device = torch.bfloat16, "cuda"
    max_seq_len = args.prompt_tokens + args.new_tokens + 1
    module = random_target(cfg, max_seq_len, dtype, torch.device(device))
    report = {"layers": cfg.num_hidden_layers, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
              "graphs": args.graphs, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "batch1": batch1(module, cfg, args, max_seq_len)}
    print(f"batch-1 loop: {report['batch1']['tok_s']} tok/s one stream")
    print(f"{'B':>4} {'one tok/s':>10} {'all tok/s':>10} {'all/one':>8} {'step ms':>8} {'TTFT ms':>8}")
    report["levels"] = []
    for b in args.batches:
        row = level(module, cfg, b, args, max_seq_len)
        report["levels"].append(row)
        print(f"{b:>4} {row['one']['tok_s']:>10} {row['all']['tok_s']:>10} {row['all_over_one']:>8} "
              f"{row['all']['step_ms']!s:>8} {row['all']['ttft_ms']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
