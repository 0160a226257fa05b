"""``xcompile diff`` (compile/diff.py): an engine dir against the PyTorch reference, teacher-forced, through
Polygraphy; compile/cli.py adds it to the ``xcompile`` group."""

from __future__ import annotations

import re

import click

from xcompile.runtime.cli.options import Finite, text_or_stdin, writable_dir


def _device(ctx, param, value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise click.BadParameter(f"{value!r}: cpu, cuda or cuda:N", param_hint="'--device'")
    return value


def _tolerances(values: tuple[str, ...], option: str) -> dict[str, float]:
    """``--atol 1e-3 --atol logits=5e-2`` -> {"": 1e-3, "logits": 5e-2}; OUTPUT one the graphs compare."""
    from xcompile.runtime.enginedir.contract import GRAPHS, graph_spec

    outputs = sorted({t.name for g in GRAPHS for t in graph_spec(g, 1).step_outputs})
    tols = {}
    for v in values:
        name, _, tol = v.rpartition("=")
        if name and name not in outputs:
            raise click.BadParameter(f"{v!r}: no graph has an output {name!r}; OUTPUT is one of {', '.join(outputs)}",
                                     param_hint=option)
        if name in tols:
            raise click.BadParameter(f"{v!r}: {'output ' + repr(name) if name else 'the default'} already has a "
                                     "tolerance; give each once", param_hint=option)
        try:
            tols[name] = Finite(min=0).convert(tol, None, None)
        except (click.BadParameter, ValueError):
            raise click.BadParameter(f"{v!r}: expected TOL or OUTPUT=TOL, TOL a finite number >= 0",
                                     param_hint=option) from None
    return tols


@click.command("diff")
@click.argument("engine_dir", type=click.Path())
@click.option("--backend", type=click.Choice(["ort", "trt"]), default="ort", show_default=True)
@click.option("--device", callback=_device,
              help="Device of engine and reference: cpu, cuda or cuda:N [default: cpu for ort, cuda for trt].")
@click.option("--prompt", callback=text_or_stdin,
              help="Prompt text, tokenized with the dir's tokenizer; '-' reads stdin.")
@click.option("--prompt-ids", help="Prompt token ids, comma-separated.")
@click.option("--steps", type=click.IntRange(min=0), default=4, show_default=True, help="Teacher-forced decode steps.")
@click.option("--draft-steps", type=click.IntRange(min=0), default=3, show_default=True, help="EAGLE3 draft steps.")
@click.option("--atol", multiple=True, metavar="[OUTPUT=]TOL", help="Absolute tolerance, per output or default.")
@click.option("--rtol", multiple=True, metavar="[OUTPUT=]TOL", help="Relative tolerance, per output or default.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--save", type=click.Path(file_okay=False), callback=writable_dir,
              help="Save Polygraphy inputs and RunResults here.")
@click.option("--unquantized", type=click.Path(), metavar="CKPT_DIR",
              help="A quantized export's unquantized checkpoint: also report the target's agreement with it.")
def diff_cmd(engine_dir, backend, device, prompt, prompt_ids, steps, draft_steps, atol, rtol, as_json, save,
             unquantized) -> None:
    """Compare an engine dir with the PyTorch reference (teacher-forced, through Polygraphy)."""
    if prompt is not None and prompt_ids is not None:
        raise click.UsageError("give --prompt or --prompt-ids, not both")
    try:
        ids = None if prompt_ids is None else tuple(int(i) for i in prompt_ids.replace(" ", "").split(","))
    except ValueError:
        raise click.BadParameter(f"{prompt_ids!r}: expected comma-separated integers", param_hint="--prompt-ids") from None
    atol, rtol = _tolerances(atol, "--atol"), _tolerances(rtol, "--rtol")
    from pathlib import Path

    from xcompile.compile.diff import DiffOptions, check_unquantized, run_diff
    from xcompile.compile.errors import CompileError

    if unquantized is not None:
        try:
            check_unquantized(Path(engine_dir), Path(unquantized))
        except CompileError as e:       # a bad option: one line, exit 2
            raise click.BadParameter(str(e).removeprefix("--unquantized: "), param_hint="--unquantized") from None
    opts = DiffOptions(backend=backend, device=device, prompt=prompt, prompt_ids=ids, steps=steps,
                       draft_steps=draft_steps, atol=atol, rtol=rtol,
                       save=None if save is None else Path(save), unquantized=None if unquantized is None
                       else Path(unquantized))
    report = run_diff(Path(engine_dir), opts)
    click.echo(report.to_json() if as_json else report.table(), nl=not as_json)
    if not report.passed:
        raise SystemExit(1)
