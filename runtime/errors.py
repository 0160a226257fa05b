"""Errors raised at the runtime's boundaries (bad engine dirs, bad requests)."""


class XcompileError(Exception):
    """Base of every error xcompile reports to a user: one line, says which file and what to do."""


class EngineError(XcompileError):
    """An engine dir, engine file or request the runtime cannot serve."""


def cli_group_class():
    """A click Group that turns every XcompileError (and Ctrl-C) into one line on stderr and exit 1, a
    bad option into one line and exit 2, and gives itself and each of its commands the log options
    (runtime/logs.py)."""
    import click

    from xcompile.runtime.logs import add_log_options

    class Group(click.Group):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            add_log_options(self)

        def add_command(self, cmd, name=None):
            super().add_command(add_log_options(cmd), name)

        def invoke(self, ctx):
            try:
                return super().invoke(ctx)
            except XcompileError as e:
                click.echo(f"error: {e}", err=True)
                ctx.exit(1)
            except click.UsageError as e:       # a bad option: one line too (click's exit code 2), not a usage page
                where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
                click.echo(f"error: {e.format_message()}{where}", err=True)
                ctx.exit(e.exit_code)
            except KeyboardInterrupt:
                click.echo("interrupted", err=True)
                ctx.exit(130)

    return Group
