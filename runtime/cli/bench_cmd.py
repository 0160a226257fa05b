"""``xrun bench`` (runtime/bench/): plain and speculative decoding timed against the device's bandwidth floor;
runtime/cli/xrun.py adds it to the ``xrun`` group."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from xcompile.runtime.cli.options import (
    MIN_P,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    YARN_FACTOR,
    IntList,
    given,
    refuse_inert,
    utf8_file,
    writable_file,
)
from xcompile.runtime.cli.run_options import KV_CACHE, ROW_INVARIANT, check_tree
from xcompile.runtime.decoding.registry import TreeShape
from xcompile.runtime.engines.load import BACKEND_CHOICES


def _check_bench(ctx, engine_dir, synthetic, backend, tree, prompts, plot, temperature) -> None:
    if (engine_dir is None) == (synthetic is None):
        raise click.UsageError("give an ENGINE_DIR or --synthetic NAME" + (", not both" if synthetic else ""))
    if temperature == 0:
        refuse_inert(ctx, ["top_k", "top_p", "min_p", "seed"], "greedy runs (--temperature 0, the default) do not "
                     "sample, so sampling options change nothing; add --temperature T (T > 0) or drop them")
    if synthetic is None:
        refuse_inert(ctx, ["draft_model", "mtp", "dtype", "quantize", "yarn"], "apply to --synthetic weights only "
                     "(an engine dir has its own)")
    elif prompts is not None:
        raise click.UsageError("--prompts needs an engine dir with a tokenizer (synthetic weights have none)")
    if synthetic is not None and backend not in ("auto", "torch", "fast"):
        raise click.UsageError("--synthetic runs the torch or fast backend (no engine dir to load TensorRT or ONNX "
                               "from)")
    if given(ctx, "peer") and backend not in ("auto", "torch", "fast"):
        raise click.UsageError("--peer compares on the reference modules' weights; use --backend torch or fast")
    if tree:
        check_tree(dict(zip(("topk", "depth", "total_tokens"), tree)), "--tree TOPK", "DEPTH", "TOKENS")
    if plot is not None:
        check_plot(ctx, plot)


def check_plot(ctx: click.Context, plot: str) -> None:
    """UsageError for a --plot that matplotlib cannot write (missing, or a suffix it has no format for) or that
    names --json's file too."""
    if importlib.util.find_spec("matplotlib") is None:
        raise click.UsageError("--plot needs matplotlib: pip install 'xcompile[plot]'")
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(plot).suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise click.UsageError(f"--plot {plot}: matplotlib writes no '.{suffix}' files; end it in .png (or "
                               f"{', '.join('.' + f for f in sorted(formats) if f != 'png')})")
    json_path = ctx.params.get("json_path")
    if json_path is not None and Path(json_path).resolve() == Path(plot).resolve():
        raise click.UsageError(f"--json and --plot both name {plot}; give each its own file")


@click.command()
@click.argument("engine_dir", required=False, type=click.Path(path_type=str))
@click.option("--synthetic", help="Seeded random weights in a known model's shape (e.g. qwen3-8b), no engine dir.")
@click.option("--draft-model", help="With --synthetic: also a synthetic draft model of this shape (e.g. qwen3-0.6b).")
@click.option("--mtp", is_flag=True, help="With --synthetic: also a synthetic MTP module (one layer of the target's "
              "shape), for the three paradigms side by side.")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="auto", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda if available.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="With --synthetic.")
@click.option("--quantize", type=click.Choice(["fp8", "int4"]),
              help="With --synthetic: the target's decoder linears in FP8 (128x128 blocks) or INT4 (groups of 128).")
@click.option("--yarn", type=YARN_FACTOR,
              help="With --synthetic: the target's RoPE stretched by this YaRN factor over the 32,768 trained "
              "positions, as Qwen3's model card sets it for long contexts (4: 131,072).")
@click.option("--gammas", type=IntList(), default="1,2,4,6,8", show_default=True,
              help="Chain lengths to measure ('' for none).")
@click.option("--tree", type=IntList(length=3), default="10,6,32", show_default=True,
              help="EAGLE3 / MTP tree topk,depth,tokens ('' for none).")
@click.option("--contexts", type=IntList(empty="no prompt length given, so nothing would be measured"),
              default="128,1024,4096", show_default=True, help="Prompt lengths.")
@click.option("--new-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--peer", is_flag=True, help="Also time transformers generate() with a static cache on the same weights.")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False), callback=utf8_file,
              help="UTF-8 text whose consecutive windows are the prompts (real text gives real acceptance).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=2, show_default=True, help="Prompts per context.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), callback=writable_file,
              help="Write the full report as JSON here.")
@click.option("--plot", type=click.Path(dir_okay=False), callback=writable_file,
              help="Write a PNG of tokens/s per drafter (pip install 'xcompile[plot]').")
@click.option("--verify", is_flag=True, help="Hash every byte of the dir's files first (default: sampled blocks).")
@click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True,
              help="Sample (speculative sampling) instead of greedy decoding.")
@click.option("--top-k", type=TOP_K, default=0, show_default=True)
@click.option("--top-p", type=TOP_P, default=1.0, show_default=True)
@click.option("--min-p", type=MIN_P, default=0.0, show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the sampled runs (prompt i: sample i).")
@KV_CACHE
@ROW_INVARIANT
@click.pass_context
def bench(ctx, engine_dir, synthetic, draft_model, mtp, backend, device, dtype, quantize, yarn, gammas, tree, contexts,
          new_tokens, repeats, peer, prompts, num_prompts, json_path, plot, verify, temperature, top_k, top_p, min_p,
          seed, kv_cache_dtype, row_invariant):
    """Measure plain and speculative decoding speed against the device's bandwidth floor.

    The report goes to stdout; progress and messages to stderr."""
    _check_bench(ctx, engine_dir, synthetic, backend, tree, prompts, plot, temperature)
    from xcompile.runtime.bench.command import BenchRequest, run
    from xcompile.runtime.decoding.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    run(BenchRequest(engine_dir, synthetic, draft_model, backend, device, dtype, gammas,
                     TreeShape(*tree) if tree else None, contexts, new_tokens,
                     repeats, peer, json_path, plot, prompts, num_prompts, verify, sampling, quantize, mtp,
                     kv_cache_dtype, row_invariant, yarn,
                     frozenset(name for name in ("gammas", "tree") if given(ctx, name))), echo=click.echo)
