"""One Qwen3-8B-shaped decode / verify step on the fast backend against the reference modules, on a GPU.

    python benchmarks/fast_decode.py [--layers 36] [--contexts 128,4096] [--max-seq-len 4352] [--tiles FILE]
                                     [--row-invariant] [--json FILE]

Weights are random, drawn on the GPU (their values do not matter for speed; the CPU-seeded weights of
``xrun bench --synthetic`` take a minute to draw). Per context it prints the graphed ms of

    target step   1 (decode), 7 (chain verify) and 32 (tree verify) tokens
    eagle3 step   1 and 10 tokens (a chain draft step, a tree level)
    eagle3 fc     7 rows of taps

on the reference modules (``ref``) and on the fast engines under each kernel configuration (KernelConfig,
runtime/engines/kernels/config.py), the engine's ``kernels`` replaced between timings: the shipped one
(``fast``), programmatic dependent launch off (``no_pdl``), the CUDA GEMV off so that one-row projections run
the Triton GEMV (``triton_gemv``; one-row steps only, it changes nothing else), and with ``--tiles FILE`` that
tile tables file (``tiles``: benchmarks/kernels.py's output, or a hand-made one; a file without "gemv" and
"cuda" tables puts one-row calls on the tile kernel); ``--row-invariant`` adds KernelConfig.row_invariant
(``exact``; with --tiles also ``exact_tiles``: its one_row table is what row_invariant's one-row calls take).
Then the TTFT of a 4096-token prompt against the bf16
matmul rate measured here, and the teacher-forced agreement of 16 decode steps with the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from xcompile.compile.config import KNOWN_MODELS, Qwen3Config, synthetic_eagle3_config
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.compile.reference import SYNTHETIC_SCHEMES, eagle3_engines, quantize_linears, qwen3_engine
from xcompile.runtime.bench.costs import matmul_rate, prefill_flops, timed
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.drafters import causal, prompt_inputs
from xcompile.runtime.engines.fast import FastEagle3Engine, FastFCEngine, FastQwen3Engine
from xcompile.runtime.engines.graphs import CudaGraphCapture
from xcompile.runtime.engines.kernels.config import KernelConfig, Tiles

DEV = torch.device("cuda")
TARGET_TOKENS = (1, 7, 32)      # decode, chain verify (gamma 6), tree verify (10/6/32)
EAGLE3_TOKENS = (1, 10)         # a chain draft step, a tree level (topk 10)
FC_ROWS = 7


def int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def random_(module: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    """Random weights drawn on the module's device, norms ones."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else std * torch.randn_like(p))
    return module.eval()


def qwen3_8b(layers: int, model: str = "qwen3-8b") -> tuple[Qwen3Config, tuple[int, ...]]:
    """Qwen3-8B's config (or another known ``model``'s) cut to ``layers`` layers, and the EAGLE3 taps of that
    depth."""
    cfg = dataclasses.replace(KNOWN_MODELS[model].config, num_hidden_layers=layers)
    return cfg, tuple(sorted({1, layers // 2 - 1, layers - 4}))


def target_pair(cfg: Qwen3Config, taps: tuple[int, ...], max_seq_len: int, quantize: str | None = None):
    """(reference engine, fast engine) of one random bf16 target, sharing weights and KV; and the module.
    ``quantize`` (fp8, int4): its decoder linears rounded as ``xrun bench --synthetic --quantize`` does."""
    with torch.device(DEV):
        module = random_(Qwen3(cfg, max_seq_len, taps).to(torch.bfloat16))
    if quantize:
        quantize_linears(module, quantize, SYNTHETIC_SCHEMES[quantize])
    ref = qwen3_engine(module)
    fast = FastQwen3Engine(qwen3_engine(module), dataclasses.asdict(cfg), taps)     # re-points the weights
    fast.bind_kv(ref.new_kv())
    return ref, fast, module


def head_pairs(cfg: Qwen3Config, max_seq_len: int, embed: torch.Tensor | None = None):
    """(reference, fast) EAGLE3 step engines sharing KV, and (reference, fast) fc engines, of one random head of
    the target's shape (AngelSlim's); ``embed``: the target's embedding, shared as the real heads do."""
    with torch.device(DEV):
        head = Eagle3(synthetic_eagle3_config(cfg), max_seq_len).to(torch.bfloat16)
    if embed is not None:
        head.embed_tokens.weight = embed
    random_(head)
    e3, fc = eagle3_engines(head)
    fe3, ffc = FastEagle3Engine(eagle3_engines(head)[0], dataclasses.asdict(head.cfg)), FastFCEngine(fc, {})
    fe3.bind_kv(e3.new_kv())
    return (e3, fe3), (fc, ffc)


def step_inputs(tokens: int, ctx: int, vocab: int) -> dict:
    """A causal step of ``tokens`` random tokens written at ``ctx``."""
    i64 = dict(dtype=torch.int64, device=DEV)
    return dict(input_ids=torch.randint(0, vocab, (1, tokens), **i64),
                position_ids=ctx + torch.arange(tokens, **i64)[None], write_index=torch.full((1,), ctx, **i64),
                tree_mask=causal(tokens, DEV), logit_rows=torch.arange(tokens, **i64)[None])


def graphed_ms(run, inputs: dict, reps: int = 30) -> float:
    replay, _ = CudaGraphCapture(warmup=2)(lambda: run(**inputs), DEV)
    return timed(replay, DEV, reps)


def kernel_configs(tiles: Tiles | None, row_invariant: bool = False) -> dict[str, KernelConfig]:
    """The configurations timed (module docstring), the shipped one first."""
    configs = {"fast": KernelConfig(), "no_pdl": KernelConfig(pdl=False), "triton_gemv": KernelConfig(cuda_gemv=False)}
    if tiles is not None:
        configs["tiles"] = KernelConfig(tiles=tiles)
    if row_invariant:
        configs["exact"] = KernelConfig(row_invariant=True)
        if tiles is not None:
            configs["exact_tiles"] = KernelConfig(row_invariant=True, tiles=tiles)
    return configs


def time_row(ref, fast, inputs: dict, rows: int, configs: dict[str, KernelConfig]) -> dict:
    """Graphed ms of one step on the reference engine and on the fast one under each configuration."""
    row = {"ref_ms": graphed_ms(ref.run, inputs)}
    for name, cfg in configs.items():
        if name == "triton_gemv" and rows > 1:             # the CUDA GEMV serves one-row calls only
            continue
        fast.kernels = cfg
        row[f"{name}_ms"] = graphed_ms(fast.run, inputs)
    fast.kernels = configs["fast"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--contexts", type=int_list, default=[128, 4096])
    ap.add_argument("--max-seq-len", type=int, default=4352, help="KV slots of the target's and the head's caches")
    ap.add_argument("--tiles", help="a tile tables file (tiles.json's format) to time against the shipped tables")
    ap.add_argument("--row-invariant", action="store_true", help="also time KernelConfig.row_invariant (module "
                    "docstring)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    if max(args.contexts) + max(TARGET_TOKENS) > args.max_seq_len:
        raise SystemExit(f"--max-seq-len {args.max_seq_len} holds no {max(TARGET_TOKENS)}-token step at context "
                         f"{max(args.contexts)}; raise it or lower --contexts")
    try:
        tiles = Tiles.load(args.tiles) if args.tiles else None
    except EngineError as e:
        raise SystemExit(f"--tiles: {e}") from None
    if not torch.cuda.is_available():
        raise SystemExit("fast_decode.py times CUDA graphs: no CUDA device is visible here")
    configs = kernel_configs(tiles, args.row_invariant)
    if tiles is not None:
        print(f"--tiles {args.tiles}: {tiles.provenance or '(no provenance)'}")
    torch.manual_seed(0)
    cfg, taps = qwen3_8b(args.layers)
    ref, fast, target = target_pair(cfg, taps, args.max_seq_len)
    (e3, fe3), (fc, ffc) = head_pairs(cfg, args.max_seq_len, target.model.embed_tokens.weight)
    out = {"layers": args.layers, "max_seq_len": args.max_seq_len, "tiles": args.tiles, "rows": []}
    print(f"{'what':<14}{'ctx':>6}{'tokens':>7}{'ref ms':>9}" + "".join(f"{n + ' ms':>15}" for n in configs))
    for ctx in args.contexts:
        ref.run(**prompt_inputs(torch.randint(0, cfg.vocab_size, (1, ctx), device=DEV)))
        steps = [("target step", ref, fast, tokens, step_inputs(tokens, ctx, cfg.vocab_size))
                 for tokens in TARGET_TOKENS]
        for tokens in EAGLE3_TOKENS:
            inputs = step_inputs(tokens, ctx, cfg.vocab_size)
            inputs["hidden_states"] = torch.randn(1, tokens, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
            steps.append(("eagle3 step", e3, fe3, tokens, inputs))
        taps_in = {"hidden_taps": torch.randn(1, FC_ROWS, 3 * cfg.hidden_size, device=DEV, dtype=torch.bfloat16)}
        steps.append(("eagle3 fc", fc, ffc, FC_ROWS, taps_in))
        for what, r, f, tokens, inputs in steps:
            row = {"what": what, "ctx": ctx, "tokens": tokens, **time_row(r, f, inputs, tokens, configs)}
            out["rows"].append(row)
            print(f"{what:<14}{ctx:>6}{tokens:>7}{row['ref_ms']:>9.3f}"
                  + "".join(f"{row[n + '_ms']:>15.3f}" if n + "_ms" in row else f"{'-':>15}" for n in configs))
    # prefill: TTFT of a 4096-token prompt (the fast engine runs prompts on the reference modules) against the
    # bf16 matmul rate measured here, FLOPs counted as xrun bench counts them (runtime/bench/costs.py)
    n = min(4096, args.max_seq_len)
    prompt = prompt_inputs(torch.randint(0, cfg.vocab_size, (1, n), device=DEV))
    ttft = timed(lambda: fast.run(**prompt), DEV, 5, warmup=1)
    rate = matmul_rate(DEV, torch.bfloat16)
    fraction = prefill_flops(dataclasses.asdict(cfg), n) / (ttft / 1e3) / rate
    out["prefill"] = {"tokens": n, "ttft_ms": ttft, "matmul_tflops": rate / 1e12, "fraction": fraction}
    print(f"prefill {n} tokens: {ttft:.1f} ms = {100 * fraction:.0f} % of the {rate / 1e12:.0f} TFLOP/s bf16 matmul "
          "rate measured here")
    # teacher-forced agreement: the same tokens into both paths, each on its own cache, logits compared
    ref.bind_kv([b.clone() for b in fast.kv])
    ctx, errs, agree = args.contexts[0], [], 0
    for i in range(16):
        inputs = step_inputs(1, ctx + i, cfg.vocab_size)
        a, b = ref.run(**inputs)["logits"].float(), fast.run(**inputs)["logits"].float()
        errs.append(((a - b).norm() / a.norm()).item())
        agree += int(a.argmax() == b.argmax())
    out["agreement"] = {"rel_err_max": max(errs), "argmax_agree": agree, "steps": 16}
    print(f"teacher-forced 16 decode steps at ctx {ctx}: max rel logit error {max(errs):.2e}, argmax agree {agree}/16")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
