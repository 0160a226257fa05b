"""The click group both CLIs (``xcompile``, ``xrun``) are made of: one error line per failure, exit codes, log
options on every command."""

from __future__ import annotations

import sys

import click

from xcompile.runtime.common.errors import XcompileError


def cli_group_class():
    """A click Group that turns every XcompileError, and any OSError that escaped a boundary, into one
    line on stderr and exit 1 (an OptionError: 2), a bad option into one line and exit 2, SIGINT and SIGTERM into
    "interrupted" and exit 130 / 143 (the staged outputs of runtime/common/files.py are removed on the way
    out), and gives itself and each of its commands the log options (runtime/common/logs.py)."""
    from xcompile.runtime.common import interrupts
    from xcompile.runtime.common.files import os_error_line
    from xcompile.runtime.common.logs import add_log_options

    class Group(click.Group):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            add_log_options(self)

        def add_command(self, cmd, name=None):
            super().add_command(add_log_options(cmd), name)

        def make_context(self, info_name, args, parent=None, **extra):
            try:
                return super().make_context(info_name, args, parent=parent, **extra)
            except click.UsageError as e:   # the group's own options (--log-level loud): one line as well
                if parent is not None:
                    raise
                where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
                click.echo(f"error: {e.format_message()}{where}", err=True)
                sys.exit(e.exit_code)

        def invoke(self, ctx):
            try:
                with interrupts.sigterm_raises():
                    return super().invoke(ctx)
            except XcompileError as e:
                click.echo(f"error: {e}", err=True)
                ctx.exit(e.exit_code)
            except click.UsageError as e:       # a bad option: one line too (click's exit code 2), not a usage page
                where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
                click.echo(f"error: {e.format_message()}{where}", err=True)
                ctx.exit(e.exit_code)
            except OSError as e:
                click.echo(f"error: {os_error_line(e)}", err=True)
                ctx.exit(1)
            except KeyboardInterrupt as e:
                click.echo("interrupted", err=True)
                ctx.exit(interrupts.exit_code(e))

    return Group
