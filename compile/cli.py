"""``xcompile``: checkpoint in, ONNX graphs and engines out. Commands are thin: parse, call one
public function, print. Heavy modules (torch, onnx, tensorrt) are imported inside the commands so
``--help`` is instant."""

from __future__ import annotations

import re

import click

from xcompile.compile.cli_diff import diff_cmd
from xcompile.compile.cli_train import train_eagle3_cmd, train_mtp_cmd
from xcompile.runtime.cli.group import cli_group_class
from xcompile.runtime.cli.options import (
    ByteSize,
    not_blank,
    refuse_inert,
    utf8_file,
    writable_dir,
    writable_file,
)
from xcompile.runtime.common import logs

log = logs.logger("compile")

# sequences a dir decodes together: every one holds a KV slot of max_seq_len (Qwen3-8B at 4096 tokens: 0.6 GB
# in bf16), so 1024 is past any GPU's memory already; 100,000,000 ran the export out of host memory
_MAX_BATCH = click.option("--max-batch", type=click.IntRange(1, 1024), default=1, show_default=True,
                          help="Sequences decoded together (KV slots), 1..1024.")


def _taps(ctx, param, value: str | None) -> tuple[int, ...] | None:
    """``--eagle3-taps 1,17,32`` -> (1, 17, 32); ranges are checked against the target before work starts."""
    if value is None:
        return None
    try:
        taps = tuple(int(t) for t in value.replace(" ", "").split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected three comma-separated layer ids", param=param) from None
    if len(taps) != 3 or min(taps) < 0:
        raise click.BadParameter(f"{value!r}: expected three layer ids >= 0", param=param)
    return taps


@click.group(cls=cli_group_class())
@click.version_option(package_name="xcompile")
def main() -> None:
    """Compile Qwen3 (+ EAGLE3 head, MTP module or draft model) to ONNX and TensorRT engines."""


main.add_command(train_eagle3_cmd)
main.add_command(train_mtp_cmd)
main.add_command(diff_cmd)


# compile/quantize.py's SCHEMES, named here so that --help imports nothing heavy (a test keeps them equal)
QUANTIZE_SCHEMES = ("fp8", "int4-awq")


@main.command("quantize")
@click.option("--model", callback=not_blank, required=True,
              help="bf16 / fp32 Qwen3 checkpoint: directory, cached HF repo id or alias.")
@click.option("--revision", help="Branch, tag or commit of the --model repo id (its cached snapshot) [default: main].")
@click.option("--scheme", required=True, type=click.Choice(QUANTIZE_SCHEMES),
              help="fp8: fp8 weights, a scale per 128x128 block; int4-awq: int4 weights, a scale and zero point "
                   "per 128 inputs, AWQ-calibrated. Both rounded by GPTQ on the calibration text.")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), callback=utf8_file,
              help="Calibration text: plain text (documents split at form-feed lines) or JSONL with "
                   "'text' or 'prompt' [default: data/corpus.heldout.txt, the demo's held-out text].")
@click.option("--samples", type=click.IntRange(min=1), default=64, show_default=True,
              help="Calibration windows, spread over the text.")
@click.option("--seq-len", type=click.IntRange(min=2), default=512, show_default=True,
              help="Tokens per calibration window.")
@click.option("--out", required=True, callback=writable_dir, help="Checkpoint directory to write.")
@click.option("--force", is_flag=True, help="Replace --out if it exists (only a dir xcompile wrote, or an empty one).")
def quantize_cmd(model, revision, scheme, calibration, samples, seq_len, out, force) -> None:
    """Quantize a Qwen3 checkpoint with llm-compressor into a compressed-tensors checkpoint xcompile loads."""
    from pathlib import Path

    from xcompile.compile.quantize import QuantizeOptions, quantize_checkpoint

    opts = QuantizeOptions(scheme=scheme, calibration=None if calibration is None else Path(calibration),
                           samples=samples, seq_len=seq_len)
    click.echo(quantize_checkpoint(model, out, opts, force=force, revision=revision, log=log.info).line())


_CC = re.compile(r"^\d+\.\d$")


def _compute_capabilities(ctx, param, values):
    """--compute-capability X.Y, each (their support is checked against TensorRT-RTX before any export)."""
    for v in values:
        if not _CC.match(v):
            raise click.BadParameter(f"{v!r}: expected MAJOR.MINOR, e.g. 8.9 or 12.0",
                                     param_hint="--compute-capability")
    return values


# what an exported dir already fixed: refused next to `xcompile build DIRECTORY`
_EXPORT_OPTIONS = ["model", "revision", "eagle3", "mtp", "draft_model", "eagle3_taps", "dtype", "max_seq_len",
                   "max_batch", "synthetic", "seed"]
_MTP_HELP = ("Add an MTP module (xcompile train-mtp writes one): its directory; without a value, the module packaged "
             "for --model (demo), or a synthetic one with --synthetic.")


@main.command("build")
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--model", callback=not_blank,
              help="Target checkpoint: directory, cached HF repo id or alias (qwen3-8b); or give an "
              "exported DIRECTORY instead.")
@click.option("--revision", help="Branch, tag or commit of the --model repo id (its cached snapshot) [default: main].")
@click.option("--eagle3", is_flag=False, flag_value="", default=None, metavar="[HEAD]",
              help="Add an EAGLE3 head: its directory or repo id; without a value, the head published for --model.")
@click.option("--mtp", is_flag=False, flag_value="", default=None, metavar="[DIR]", help=_MTP_HELP)
@click.option("--draft-model", default=None, help="Add a small Qwen3 draft model (directory, repo id or alias).")
@click.option("--eagle3-taps", "eagle3_taps", metavar="L1,L2,L3", callback=_taps,
              help="Override the head's tap layers: 0-based layer-output ids (= HF hidden_states index - 1), "
                   "e.g. 1,17,32 for Qwen3-8B [default: from the head's config, else 1, L/2-1, L-4].")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Graph and engine precision (engines are strongly typed: the ONNX dtype is the engine's).")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="KV capacity per sequence [default: min(4096, config)].")
@_MAX_BATCH
@click.option("--synthetic", is_flag=True, help="Seeded random weights in the shape of the --model alias.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --synthetic weights.")
@click.option("--out", callback=writable_dir, default=None,
              help="Engine dir to write [default: engines/<model name>].")
@click.option("--trt", "flavor", type=click.Choice(["auto", "tensorrt", "rtx"]), default="auto", show_default=True,
              help="auto: full TensorRT when installed, else TensorRT-RTX.")
@click.option("--compute-capability", "compute_capabilities", multiple=True, metavar="X.Y",
              callback=_compute_capabilities,
              help="TensorRT-RTX target GPU (repeatable), e.g. 8.9 or 12.0 [default: TensorRT-RTX's set].")
@click.option("--max-draft-tokens", type=click.IntRange(min=1), default=None,
              help="Decode/verify profile covers 1..N+1 tokens [default: 63, a 60-node EAGLE tree].")
@click.option("--workspace", type=ByteSize(), default=None, metavar="SIZE",
              help="Builder WORKSPACE memory pool limit, e.g. 4G (trtexec --memPoolSize=workspace) "
                   "[default: TensorRT's, the device's memory].")
@click.option("--builder-optimization-level", "optimization_level", type=click.IntRange(0, 5), default=None,
              help="0 builds fastest, 5 searches longest for faster kernels [default: TensorRT's, 3].")
@click.option("--timing-cache", type=click.Path(dir_okay=False), callback=writable_file, default=None,
              help="Full TensorRT: timing cache file to read and update [default: <engine dir>/timing.cache].")
@click.option("--force", is_flag=True, help="Re-export and rebuild even when nothing changed (with DIRECTORY: "
              "rebuild its engines).")
@click.pass_context
def build_cmd(ctx, directory, model, revision, eagle3, mtp, draft_model, eagle3_taps, dtype, max_seq_len, max_batch,
              synthetic, seed, out, flavor, compute_capabilities, max_draft_tokens, workspace, optimization_level,
              timing_cache, force) -> None:
    """Export --model (+ head / draft) to ONNX and build TensorRT engines; unchanged parts are kept.

    With DIRECTORY, an engine dir `xcompile export` wrote, build engines from the ONNX graphs already
    there (no re-export), as trtexec or trtllm-build take a model that is already converted."""
    from pathlib import Path

    if directory is not None:
        refuse_inert(ctx, ["out"], f"building {directory} writes its engines into it; give no --out (copy the dir "
                     "to build elsewhere)")
        refuse_inert(ctx, _EXPORT_OPTIONS, f"{directory} is exported already and its manifest fixes these; build "
                     "from it without them, or re-export with --model")
    elif model is None:
        raise click.UsageError("give --model (export, then build) or an exported DIRECTORY (build only)")
    elif not synthetic:
        refuse_inert(ctx, ["seed"], "seeds --synthetic weights only")
    else:
        refuse_inert(ctx, ["revision"], "picks a snapshot of a checkpoint; --synthetic weights have none")
    if max_draft_tokens is not None and max_seq_len is not None and max_draft_tokens >= max_seq_len:
        raise click.UsageError(f"--max-draft-tokens {max_draft_tokens}: a verify of that many drafts and its root "
                               f"exceeds --max-seq-len {max_seq_len}; give at most {max_seq_len - 1}")
    from xcompile.compile.build import BuildOptions, build
    from xcompile.compile.export_build import default_out, export_and_build
    from xcompile.compile.pipeline import ExportRequest

    options = BuildOptions(flavor=flavor, compute_capabilities=tuple(compute_capabilities), force=force,
                           workspace=workspace, optimization_level=optimization_level,
                           timing_cache=None if timing_cache is None else Path(timing_cache),
                           **({"max_draft_tokens": max_draft_tokens} if max_draft_tokens is not None else {}))
    if directory is not None:
        where, manifest = Path(directory), build(Path(directory), options, progress=log.info)
    else:
        req = ExportRequest(model=model, out=Path(out) if out else default_out(model), eagle3=eagle3, mtp=mtp,
                            draft_model=draft_model, dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch,
                            synthetic=synthetic, seed=seed, force=force, eagle3_taps=eagle3_taps,
                            revision=revision)
        where, manifest = req.out, export_and_build(req, options, progress=log.info)
    click.echo(f"{where}: " + ", ".join(f"{e.file} ({e.flavor} {e.trt_version})" for e in manifest.engines.values()))


@main.command("inspect")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect_cmd(directory, as_json) -> None:
    """Show an engine dir: manifest, each graph's ONNX I/O and each engine's shapes per profile and aliasing."""
    import json

    from xcompile.compile.errors import CompileError
    from xcompile.compile.inspect import describe, format_report

    d = describe(directory)
    click.echo(json.dumps(d, indent=2) if as_json else format_report(d))
    if d["damaged"]:          # the report stands; the exit status and one line say the dir cannot run
        raise CompileError(f"{directory}: {len(d['damaged'])} file(s) missing or resized ({d['damaged'][0]}); "
                           "re-export the engine dir (--force)")


@main.command("verify")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--fast", is_flag=True, help="Hash sampled blocks only (the check every load does), not every byte.")
def verify_cmd(directory, fast) -> None:
    """Check every file of an engine dir against the sizes and hashes recorded when it was written."""
    from xcompile.compile.inspect import verify_dir

    click.echo(verify_dir(directory, full=not fast, log=lambda m: click.echo(m, err=True)))


@main.command("export")
@click.option("--model", callback=not_blank, required=True,
              help="Target: checkpoint dir, cached HF repo id, or alias (qwen3-8b).")
@click.option("--revision", help="Branch, tag or commit of the --model repo id (its cached snapshot) [default: main].")
@click.option("--eagle3", is_flag=False, flag_value="", default=None, metavar="[HEAD]",
              help="Add an EAGLE3 head: its dir or repo id; without a value, the head published for --model.")
@click.option("--mtp", is_flag=False, flag_value="", default=None, metavar="[DIR]", help=_MTP_HELP)
@click.option("--draft-model", help="Add a small draft Qwen3 sharing the target's tokenizer.")
@click.option("--eagle3-taps", "eagle3_taps", metavar="L1,L2,L3", callback=_taps,
              help="Override the head's tap layers: 0-based layer-output ids (= HF hidden_states index - 1), "
                   "e.g. 1,17,32 for Qwen3-8B [default: from the head's config, else 1, L/2-1, L-4].")
@click.option("--out", required=True, callback=writable_dir, help="Engine dir to write.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--max-seq-len", type=click.IntRange(min=1),
              help="KV cache capacity [default: min(4096, max_position_embeddings or YaRN's longer context)].")
@_MAX_BATCH
@click.option("--synthetic", is_flag=True, help="Seeded random weights in the shape of the --model alias.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --synthetic weights.")
@click.option("--synthetic-layers", type=click.IntRange(min=1), default=None,
              help="With --synthetic: the alias's shape with this many layers (a quicker stand-in).")
@click.option("--force", is_flag=True, help="Replace --out if it exists (only a dir xcompile wrote).")
@click.pass_context
def export_cmd(ctx, model, revision, eagle3, mtp, draft_model, eagle3_taps, out, dtype, max_seq_len, max_batch, synthetic,
               seed, synthetic_layers, force) -> None:
    """Export the target (+ EAGLE3 head, + MTP module, + draft model) to ONNX graphs in an engine dir."""
    from pathlib import Path

    if not synthetic:
        refuse_inert(ctx, ["seed"], "seeds --synthetic weights only")
    else:
        refuse_inert(ctx, ["revision"], "picks a snapshot of a checkpoint; --synthetic weights have none")
    from xcompile.compile.pipeline import ExportRequest, describe, export_engine_dir

    req = ExportRequest(model=model, out=Path(out), eagle3=eagle3, mtp=mtp, draft_model=draft_model, dtype=dtype,
                        max_seq_len=max_seq_len, max_batch=max_batch, synthetic=synthetic, seed=seed, force=force,
                        eagle3_taps=eagle3_taps, synthetic_layers=synthetic_layers, revision=revision)
    click.echo(describe(export_engine_dir(req, log=log.info)))
