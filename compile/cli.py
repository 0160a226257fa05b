"""``xcompile``: checkpoint in, ONNX graphs and engines out. Commands are thin: parse, call one
public function, print. Heavy modules (torch, onnx, tensorrt) are imported inside the commands so
``--help`` is instant."""

from __future__ import annotations

import click

from xcompile.runtime.errors import cli_group_class


@click.group(cls=cli_group_class())
@click.version_option(package_name="xcompile")
def main() -> None:
    """Compile Qwen3 (+ EAGLE3 head or draft model) to ONNX and TensorRT engines."""
