"""``xrun``: run engine dirs (generate, bench). Thin commands; heavy imports happen inside them."""

from __future__ import annotations

import click

from xcompile.runtime.errors import cli_group_class


@click.group(cls=cli_group_class())
@click.version_option(package_name="xcompile")
def main() -> None:
    """Run xcompile engine dirs with speculative decoding."""
