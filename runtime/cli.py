"""``xrun``: run engine dirs (generate, bench). Thin commands; heavy imports happen inside them."""

from __future__ import annotations

import click

from xcompile.runtime.errors import cli_group_class


@click.group(cls=cli_group_class())
@click.version_option(package_name="xcompile")
def main() -> None:
    """Run xcompile engine dirs with speculative decoding."""


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected token ids like '1 2 3' or '1,2,3', got {text!r}") from None


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=str))
@click.option("--prompt", help="Prompt text (encoded with the dir's tokenizer).")
@click.option("--prompt-ids", help="Prompt token ids, e.g. '1,2,3'.")
@click.option("--chat", help="One user message, wrapped in the tokenizer's chat template.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--drafter", type=click.Choice(["auto", "none", "draft-model", "eagle3"]), default="auto",
              show_default=True, help="auto: eagle3 if the dir has a head, else the draft model, else none.")
@click.option("--gamma", type=click.IntRange(min=1), help="Draft tokens per round (chain drafters).")
@click.option("--tree-topk", type=click.IntRange(min=1), help="EAGLE3 tree: children per expanded node.")
@click.option("--tree-depth", type=click.IntRange(min=1), help="EAGLE3 tree: draft steps per round.")
@click.option("--tree-tokens", type=click.IntRange(min=1), help="EAGLE3 tree: draft tokens verified per round.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); the text up to it is kept.")
@click.option("--backend", type=click.Choice(["auto", "trt", "ort", "torch", "fast"]), default="auto", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda if available.")
@click.option("--no-cuda-graphs", is_flag=True, help="Run every step eagerly.")
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text and stats as one JSON object.")
@click.option("--verify", is_flag=True, help="Hash every byte of the dir's files first (default: sampled blocks).")
def generate(engine_dir, prompt, prompt_ids, chat, max_new_tokens, drafter, gamma, tree_topk, tree_depth, tree_tokens,
             stop, backend, device, no_cuda_graphs, as_json, verify):
    """Generate greedily from ENGINE_DIR with speculative decoding (same tokens as plain greedy)."""
    from xcompile.runtime.request import GenerateRequest, run_generate

    if sum(x is not None for x in (prompt, prompt_ids, chat)) != 1:
        raise click.UsageError("give exactly one of --prompt, --prompt-ids, --chat")
    tree = {k: v for k, v in (("topk", tree_topk), ("depth", tree_depth), ("total_tokens", tree_tokens)) if v}
    ids = _ids(prompt_ids) if prompt_ids is not None else None          # '' -> [] -> "empty prompt"
    req = GenerateRequest(engine_dir, prompt=prompt, prompt_ids=ids, chat=chat,
                          max_new_tokens=max_new_tokens, drafter=drafter, gamma=gamma, tree=tree or None,
                          stop=list(stop), backend=backend, device=device, cuda_graphs=not no_cuda_graphs,
                          verify=verify)
    run_generate(req, as_json=as_json, echo=click.echo)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@main.command()
@click.argument("engine_dir", required=False, type=click.Path(path_type=str))
@click.option("--synthetic", help="Seeded random weights in a known model's shape (e.g. qwen3-8b), no engine dir.")
@click.option("--draft-model", help="With --synthetic: also a synthetic draft model of this shape (e.g. qwen3-0.6b).")
@click.option("--backend", type=click.Choice(["auto", "trt", "ort", "torch", "fast"]), default="auto", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda if available.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="With --synthetic.")
@click.option("--gammas", default="1,2,4,6,8", show_default=True, help="Chain lengths to measure.")
@click.option("--tree", default="10,6,32", show_default=True, help="EAGLE3 tree topk,depth,tokens ('' for none).")
@click.option("--contexts", default="128,1024,4096", show_default=True, help="Prompt lengths.")
@click.option("--new-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--peer", is_flag=True, help="Also time transformers generate() with a static cache on the same weights.")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False),
              help="Text whose consecutive windows are the prompts (real text gives real acceptance).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=2, show_default=True, help="Prompts per context.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the full report as JSON here.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG of tokens/s per drafter (needs matplotlib).")
@click.option("--verify", is_flag=True, help="Hash every byte of the dir's files first (default: sampled blocks).")
def bench(engine_dir, synthetic, draft_model, backend, device, dtype, gammas, tree, contexts, new_tokens, repeats, peer,
          prompts, num_prompts, json_path, plot, verify):
    """Measure plain and speculative decoding speed against the device's bandwidth floor."""
    from xcompile.runtime.bench_cli import BenchRequest, run

    tree_t = _ints(tree)
    if tree_t and len(tree_t) != 3:
        raise click.BadParameter("--tree takes topk,depth,tokens", param_hint="--tree")
    if (engine_dir is None) == (synthetic is None):
        raise click.UsageError("give an ENGINE_DIR or --synthetic NAME")
    run(BenchRequest(engine_dir, synthetic, draft_model, backend, device, dtype, _ints(gammas),
                     dict(zip(("topk", "depth", "total_tokens"), tree_t)) or None, _ints(contexts), new_tokens,
                     repeats, peer, json_path, plot, prompts, num_prompts, verify), echo=click.echo)
