"""The options and checks that xrun's commands (runtime/cli/xrun.py, bench_cmd.py) share."""

from __future__ import annotations

import click

from xcompile.runtime.decoding.registry import TreeShape
from xcompile.runtime.engines.run_checks import KV_CACHE_DTYPES

# generate, bench and serve: the target's KV cache dtype (engines/load.py set_kv_cache_dtype)
KV_CACHE = click.option("--kv-cache-dtype", type=click.Choice(list(KV_CACHE_DTYPES)), default="auto",
                        show_default=True, help="The target's KV cache: auto (the engines' dtype) or fp8 (e4m3, "
                        "unscaled; --backend fast or torch).")
# generate, bench and serve: KernelConfig.row_invariant (runtime/engines/kernels/config.py)
ROW_INVARIANT = click.option("--row-invariant", is_flag=True, help="Fast backend: the target's one-row steps on "
                             "its verify kernels, so every drafter's greedy tokens are plain greedy's bit for bit on "
                             "the GPU (plain decoding pays the one-row GEMVs' speed).")


def check_drafter_options(drafter: str, gamma: int | None, tree: dict) -> None:
    """Conflicting or inert drafter options, refused with the reason (the dir's own drafter, for
    --drafter auto, is checked by run_generate before it loads anything)."""
    if drafter == "none" and (gamma or tree):
        raise click.UsageError("--drafter none drafts nothing, so --gamma / --tree-* would do nothing; drop them "
                               "or pick a drafter")
    if gamma and tree:
        raise click.UsageError("--gamma sets a chain's length, --tree-* select the EAGLE3 or MTP tree instead "
                               "(its size is --tree-tokens); give one or the other")
    if tree and drafter == "draft-model":
        raise click.UsageError("--tree-* shape the EAGLE3 or MTP tree; the draft model drafts a chain of --gamma "
                               "tokens")
    if tree:
        check_tree(tree, "--tree-topk", "--tree-depth", "--tree-tokens")


def check_tree(tree: dict, topk_opt: str, depth_opt: str, tokens_opt: str) -> None:
    """A tree shape (missing fields take the defaults) whose every level can be verified and whose
    size fits its candidates: depth + 1 <= total_tokens <= 1 + topk + (depth-1) * topk^2."""
    defaults = TreeShape()
    t = {"topk": defaults.topk, "depth": defaults.depth, "total_tokens": defaults.total_tokens, **tree}
    k, d, n = t["topk"], t["depth"], t["total_tokens"]

    def opt(name: str, flag: str) -> str:
        return f"{flag} {t[name]}" + ("" if name in tree else " (the default)")
    if n < d + 1:
        raise click.UsageError(f"{opt('total_tokens', tokens_opt)} verifies the root and {n - 1} drafts, so with "
                               f"{opt('depth', depth_opt)} the levels past {n - 1} are drafted but never verified; "
                               f"raise {tokens_opt} to at least {d + 1} or lower {depth_opt}")
    pool = 1 + k + (d - 1) * k * k
    if n > pool:
        raise click.UsageError(f"{opt('total_tokens', tokens_opt)} exceeds the {pool} nodes a tree of "
                               f"{opt('topk', topk_opt)} and {opt('depth', depth_opt)} can hold (1 + topk + "
                               f"(depth-1)*topk^2); lower {tokens_opt} or widen the tree")
