"""``xrun``: run engine dirs (generate, bench, serve). Thin commands; heavy imports happen inside them."""

from __future__ import annotations

import click

from xcompile.runtime.cli.bench_cmd import bench
from xcompile.runtime.cli.group import cli_group_class
from xcompile.runtime.cli.options import (
    MIN_P,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    given,
    positive_float,
    stop_strings,
    text_or_stdin,
)
from xcompile.runtime.cli.run_options import KV_CACHE, ROW_INVARIANT, check_drafter_options
from xcompile.runtime.decoding.registry import DRAFTER_CHOICES, DrafterSpec
from xcompile.runtime.engines.load import BACKEND_CHOICES


@click.group(cls=cli_group_class())
@click.version_option(package_name="xcompile")
def main() -> None:
    """Run xcompile engine dirs with speculative decoding."""


main.add_command(bench)


def _ids(ctx, param, text: str | None) -> list[int] | None:
    if text is None:
        return None
    parts = [t.strip() for t in text.split(",")] if "," in text else text.split()
    if "," in text and "" in parts and any(parts):
        raise click.BadParameter(f"an empty id between commas in {text!r}; give ids like '1,2,3'")
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected token ids like '1 2 3' or '1,2,3', got {text!r}") from None
    if not ids:
        raise click.BadParameter("no token ids given; pass at least one, e.g. '1,2,3'")
    return ids


def _nonempty(value: str | None, option: str) -> str | None:
    if value == "":
        raise click.BadParameter(f"an empty {option} would let no request in (none can send an empty key); give a "
                                 "key, or leave it out to serve without one")
    return value


def _check_sampling(ctx, req) -> None:
    """Sampling options greedy decoding would ignore, refused with the reason. A run is greedy exactly when
    its resolved temperature is 0: --temperature, else with --sample the dir's generation_config.json
    (whose do_sample is not consulted: --sample asks to sample), else 0. --num-samples is refused too:
    greedy samples are identical copies. Reads generation_config.json with --sample (a bad one: exit 1)."""
    if not req.sampling().greedy:
        return
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    hit = [flags[n] for n in ("sample", "top_k", "top_p", "min_p", "seed", "num_samples") if given(ctx, n)]
    if not hit:
        return
    if req.temperature is not None:
        why, fix = "--temperature 0", "give a --temperature above 0"
    elif req.sample:
        why, fix = f"temperature 0 in {req.engine_dir}/generation_config.json", "give a --temperature above 0"
    else:
        why, fix = "temperature 0, the default", ("add --temperature T (T > 0), or --sample to sample with the dir's "
                                                  "generation_config.json values")
    many = len(hit) > 1
    copies = " (--num-samples would print identical copies)" if given(ctx, "num_samples") else ""
    raise click.UsageError(f"{', '.join(hit)}: greedy decoding ({why}) does not sample, so "
                           f"{'they change' if many else 'it changes'} nothing{copies}; {fix}, or drop "
                           f"{'them' if many else 'it'}", ctx)


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=str))
@click.option("--prompt", callback=text_or_stdin,
              help="Prompt text (encoded with the dir's tokenizer); '-' reads stdin.")
@click.option("--prompt-ids", callback=_ids, help="Prompt token ids, e.g. '1,2,3'.")
@click.option("--chat", callback=text_or_stdin,
              help="One user message, wrapped in the tokenizer's chat template; '-' reads stdin.")
@click.option("--max-new-tokens", type=click.IntRange(min=1),
              help="New tokens at most; one that does not fit the context is refused  [default: 128, or what the "
                   "context leaves]")
@click.option("--drafter", type=click.Choice(DRAFTER_CHOICES), default="auto",
              show_default=True, help="auto: eagle3 if the dir has a head, else mtp if it has a module, else the "
              "draft model, else none.")
@click.option("--gamma", type=click.IntRange(min=1),
              help="Draft tokens per round of a chain (EAGLE3, MTP, the draft model)  [default: 4]")
@click.option("--tree-topk", type=click.IntRange(min=1), help="EAGLE3 / MTP tree: children per expanded node  "
              "[default: 10]")
@click.option("--tree-depth", type=click.IntRange(min=1), help="EAGLE3 / MTP tree: draft steps per round  [default: 6]")
@click.option("--tree-tokens", type=click.IntRange(min=2),
              help="EAGLE3 / MTP tree: tokens verified per round, the root included  [default: 32]")
@click.option("--stop", multiple=True, callback=stop_strings,
              help="Stop string (repeatable); the text up to it is kept.")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="auto", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda if available.")
@click.option("--no-cuda-graphs", is_flag=True, help="Run every step eagerly (on CUDA; CPU steps always do).")
@click.option("--sample", is_flag=True,
              help="Sample with the checkpoint's generation_config.json values (the flags below override).")
@click.option("--temperature", type=TEMPERATURE,
              help="0: greedy (the default without --sample), which the options below would not change, so they "
                   "are refused then.")
@click.option("--top-k", type=TOP_K, help="Keep the k most likely tokens (0: off).")
@click.option("--top-p", type=TOP_P, help="Keep the smallest set with this much probability (1: off).")
@click.option("--min-p", type=MIN_P, help="Drop tokens below min_p times the top token's probability (0: off).")
@click.option("--seed", type=SEED, help="Random seed (default: a fresh one, printed with the stats).")
@click.option("--num-samples", type=click.IntRange(min=1),
              help="Independent samples of the prompt, generated one after another.")
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text and stats as one JSON object.")
@click.option("--verify", is_flag=True, help="Hash every byte of the dir's files first (default: sampled blocks).")
@KV_CACHE
@ROW_INVARIANT
@click.pass_context
def generate(ctx, engine_dir, prompt, prompt_ids, chat, max_new_tokens, drafter, gamma, tree_topk, tree_depth,
             tree_tokens, stop, backend, device, no_cuda_graphs, sample, temperature, top_k, top_p, min_p, seed,
             num_samples, as_json, verify, kv_cache_dtype, row_invariant):
    """Generate from ENGINE_DIR with speculative decoding: greedy (the same tokens as plain greedy
    decoding), or sampled (each token distributed as plain sampling would draw it).

    The text (or --json) goes to stdout; the stats line and messages to stderr."""
    from xcompile.runtime.cli.generate import GenerateRequest, run_generate

    if sum(x is not None for x in (prompt, prompt_ids, chat)) != 1:
        raise click.UsageError("give exactly one of --prompt, --prompt-ids, --chat")
    if prompt == "" or chat == "":
        raise click.UsageError(f"{'--prompt' if prompt == '' else '--chat'} is empty (or stdin was): give at least "
                               "one character")
    tree = {k: v for k, v in (("topk", tree_topk), ("depth", tree_depth), ("total_tokens", tree_tokens)) if v}
    check_drafter_options(drafter, gamma, tree)
    spec = DrafterSpec.from_options(drafter, gamma, tree_topk, tree_depth, tree_tokens)
    req = GenerateRequest(engine_dir, prompt=prompt, prompt_ids=prompt_ids, chat=chat, max_new_tokens=max_new_tokens,
                          drafter=spec, stop=list(stop), backend=backend, device=device,
                          cuda_graphs=not no_cuda_graphs, verify=verify, sample=sample, temperature=temperature,
                          top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, num_samples=num_samples,
                          kv_cache_dtype=kv_cache_dtype, row_invariant=row_invariant)
    _check_sampling(ctx, req)
    run_generate(req, as_json=as_json, echo=click.echo)


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=str))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="auto", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda if available.")
@click.option("--drafter", type=click.Choice(DRAFTER_CHOICES), default="auto", show_default=True)
@click.option("--gamma", type=click.IntRange(min=1), help="Draft tokens per round (chain drafters).")
@click.option("--tree-topk", type=click.IntRange(min=1), help="EAGLE3 / MTP tree: children per expanded node.")
@click.option("--tree-depth", type=click.IntRange(min=1), help="EAGLE3 / MTP tree: draft steps per round.")
@click.option("--tree-tokens", type=click.IntRange(min=1), help="EAGLE3 / MTP tree: draft tokens verified per round.")
@click.option("--served-model-name", help="Model id clients send (default: the engine dir's model name).")
@click.option("--api-key", envvar="XRUN_API_KEY", callback=lambda ctx, param, v: _nonempty(v, "--api-key"),
              help="Require 'Authorization: Bearer KEY' on /v1 (or $XRUN_API_KEY).")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for the device (for a batch slot on a --max-batch N dir); more get 429.")
@click.option("--request-timeout", type=positive_float(),
              help="Seconds from arrival to the last token; later requests end with an error. Default: none.")
@click.option("--no-cuda-graphs", is_flag=True, help="Run every step eagerly (on CUDA; CPU steps always do).")
@click.option("--no-warm-up", is_flag=True,
              help="Report ready without first compiling every kernel and recording every graph a request can "
                   "reach (first requests then wait on them).")
@click.option("--ray", "use_ray", is_flag=True, help="Serve as Ray Serve replicas behind Ray's proxy.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --ray: replicas (one GPU each on CUDA).")
@KV_CACHE
@ROW_INVARIANT
def serve(engine_dir, host, port, backend, device, drafter, gamma, tree_topk, tree_depth, tree_tokens,
          served_model_name, api_key, max_queue, request_timeout, no_cuda_graphs, no_warm_up, use_ray, replicas,
          kv_cache_dtype, row_invariant):
    """Serve ENGINE_DIR over the OpenAI API (completions, chat, streaming): one request at a time, or up to N
    decoding together on a --max-batch N dir."""
    from xcompile.runtime.serve.run import serve_http, serve_ray
    from xcompile.runtime.serve.worker import ServeConfig

    if replicas != 1 and not use_ray:
        raise click.UsageError("--replicas needs --ray (one process serves one engine set)")
    tree = {k: v for k, v in (("topk", tree_topk), ("depth", tree_depth), ("total_tokens", tree_tokens)) if v}
    check_drafter_options(drafter, gamma, tree)
    config = ServeConfig(engine_dir, backend, device, DrafterSpec.from_options(drafter, gamma, tree_topk, tree_depth,
                                                                               tree_tokens),
                         served_model_name, api_key, max_queue, request_timeout, not no_cuda_graphs,
                         warm_up=not no_warm_up, kv_cache_dtype=kv_cache_dtype, row_invariant=row_invariant)
    if use_ray:
        serve_ray(config, host, port, replicas)
    else:
        serve_http(config, host, port)
