"""Errors raised at the runtime's boundaries (bad engine dirs, bad requests)."""


class XcompileError(Exception):
    """Base of every error xcompile reports to a user: one line, says which file and what to do."""


class EngineError(XcompileError):
    """An engine dir, engine file or request the runtime cannot serve."""


def cli_group_class():
    """A click Group that turns every XcompileError (and Ctrl-C) into one line on stderr and exit 1."""
    import click

    class Group(click.Group):
        def invoke(self, ctx):
            try:
                return super().invoke(ctx)
            except XcompileError as e:
                click.echo(f"error: {e}", err=True)
                ctx.exit(1)
            except KeyboardInterrupt:
                click.echo("interrupted", err=True)
                ctx.exit(130)

    return Group
