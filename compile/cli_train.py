"""``xcompile train-eagle3`` and ``xcompile train-mtp`` (compile/train.py): the drafter trainers' commands, which
share their options; compile/cli.py adds them to the ``xcompile`` group."""

from __future__ import annotations

import click

from xcompile.runtime.cli.options import not_blank, positive_float, refuse_inert, utf8_file, writable_dir
from xcompile.runtime.common import logs

log = logs.logger("compile")


def _train_options(out: str, what: str):
    """The options ``train-eagle3`` and ``train-mtp`` share (compile/train.py), ``--out`` defaulting to ``out``."""
    options = [
        click.option("--model", required=True, callback=not_blank,
                     help="Target checkpoint: directory, cached HF repo id or alias."),
        click.option("--revision", help="Branch, tag or commit of the --model repo id (its cached snapshot) "
                     "[default: main]."),
        click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False), callback=utf8_file,
                     help="Training text: plain text (documents split at form-feed lines) or JSONL with 'text' or "
                          "'prompt'."),
        click.option("--heldout", type=click.Path(exists=True, dir_okay=False), callback=utf8_file,
                     help="Held-out text, evaluated at the end."),
        click.option("--out", default=out, show_default=True, callback=writable_dir, help=f"{what} to write."),
        click.option("--ttt-steps", type=click.IntRange(min=1), default=7, show_default=True,
                     help="Unrolled training-time-test steps."),
        click.option("--steps", type=click.IntRange(min=1), help="Optimizer steps (default: one pass over the data)."),
        click.option("--tokens", type=click.IntRange(min=1), help="Training tokens, instead of --steps."),
        click.option("--minutes", type=positive_float(), help="Wall-clock budget; the LR schedule follows it."),
        click.option("--lr", type=positive_float(), default=1e-3, show_default=True, help="Peak learning rate."),
        click.option("--batch", type=click.IntRange(min=1), default=8, show_default=True, help="Windows per step."),
        click.option("--seq-len", type=click.IntRange(min=3), default=512, show_default=True,
                     help="Tokens per window."),
        click.option("--device", default="cuda", show_default=True, type=click.Choice(["cuda", "cpu"])),
        click.option("--seed", default=0, show_default=True),
        click.option("--regenerate", is_flag=True, help="Replace JSONL prompts' responses by the target's greedy ones."),
        click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
                     help="Response length cap for --regenerate."),
        click.option("--force", is_flag=True, help=f"Replace --out if it exists (only a {what.lower()} xcompile "
                     "wrote)."),
        click.pass_context,
    ]

    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f
    return apply


def _train(ctx, files, opts: dict, data, heldout, out, regenerate, max_new_tokens, model, revision, force) -> None:
    """Check the shared options, then train through ``files`` (train_eagle3_files or train_mtp_files)."""
    from xcompile.compile.train import TrainOptions

    if opts["steps"] is not None and opts["tokens"] is not None:
        raise click.UsageError("--steps and --tokens both set the step budget (--tokens is turned into steps); "
                               "give one")
    if opts["seq_len"] < opts["ttt_steps"] + 2:
        raise click.UsageError(f"--seq-len {opts['seq_len']} is too short for --ttt-steps {opts['ttt_steps']}: step "
                               f"j predicts 2 + j tokens ahead, so a window needs at least {opts['ttt_steps'] + 2} "
                               "tokens")
    if not regenerate:
        refuse_inert(ctx, ["max_new_tokens"], "caps the responses --regenerate writes; without it nothing is generated")
    minutes = opts.pop("minutes")
    result = files(model, data, out, TrainOptions(seconds=minutes * 60 if minutes else None, **opts), heldout,
                   regenerate, max_new_tokens, log=log.info, revision=revision, force=force)
    if result.heldout:
        click.echo(f"held-out: loss {result.heldout['loss']:.4f}, per-step top-1 accuracy {result.heldout['step_acc']}")


@click.command("train-eagle3")
@_train_options("eagle3-head", "Head directory (AngelSlim layout)")
@click.option("--draft-vocab", type=click.IntRange(min=1), default=32000, show_default=True,
              help="Draft vocabulary: the N most frequent tokens (the whole vocabulary when N reaches it).")
def train_eagle3_cmd(ctx, model, revision, data, heldout, out, draft_vocab, ttt_steps, steps, tokens, minutes, lr,
                     batch, seq_len, device, seed, regenerate, max_new_tokens, force) -> None:
    """Distil an EAGLE3 head from a target (training-time-test recipe) and write it to --out."""
    from xcompile.compile.train_eagle3 import train_eagle3_files

    _train(ctx, train_eagle3_files, dict(ttt_steps=ttt_steps, steps=steps, tokens=tokens, minutes=minutes, lr=lr,
                                         batch=batch, seq_len=seq_len, draft_vocab=draft_vocab, seed=seed,
                                         device=device),
           data, heldout, out, regenerate, max_new_tokens, model, revision, force)


@click.command("train-mtp")
@_train_options("mtp-module", "Module directory")
@click.option("--draft-vocab", type=click.IntRange(min=1), default=32000, show_default=True,
              help="Draft vocabulary: the module's head reads the target's lm_head rows of the N most frequent "
                   "tokens (the whole vocabulary when N reaches it).")
def train_mtp_cmd(ctx, model, revision, data, heldout, out, draft_vocab, ttt_steps, steps, tokens, minutes, lr, batch,
                  seq_len, device, seed, regenerate, max_new_tokens, force) -> None:
    """Train an MTP module (DeepSeek-V3 style, one layer over the target's last hidden) for a frozen target and
    write it to --out; build it into an engine dir with --mtp DIR."""
    from xcompile.compile.train_mtp import train_mtp_files

    _train(ctx, train_mtp_files, dict(ttt_steps=ttt_steps, steps=steps, tokens=tokens, minutes=minutes, lr=lr,
                                      batch=batch, seq_len=seq_len, draft_vocab=draft_vocab, seed=seed,
                                      device=device),
           data, heldout, out, regenerate, max_new_tokens, model, revision, force)
