"""Errors raised at the runtime's boundaries (bad engine dirs, bad requests)."""


class XcompileError(Exception):
    """Base of every error xcompile reports to a user: one line, says which file and what to do."""


class EngineError(XcompileError):
    """An engine dir, engine file or request the runtime cannot serve."""


def cli_group_class():
    """A click Group that turns every XcompileError, and any OSError that escaped a boundary, into one
    line on stderr and exit 1; SIGINT and SIGTERM into "interrupted" and exit 130 / 143 (the staged
    outputs of runtime/files.py are removed on the way out)."""
    import click

    from xcompile.runtime import interrupts
    from xcompile.runtime.files import os_error_line

    class Group(click.Group):
        def invoke(self, ctx):
            try:
                with interrupts.sigterm_raises():
                    return super().invoke(ctx)
            except XcompileError as e:
                click.echo(f"error: {e}", err=True)
                ctx.exit(1)
            except OSError as e:
                click.echo(f"error: {os_error_line(e)}", err=True)
                ctx.exit(1)
            except KeyboardInterrupt as e:
                click.echo("interrupted", err=True)
                ctx.exit(interrupts.exit_code(e))

    return Group
