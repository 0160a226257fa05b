"""Errors raised at the runtime's boundaries (bad engine dirs, bad requests, options they cannot honour)."""


class XcompileError(Exception):
    """Base of every error xcompile reports to a user: one line, says which file and what to do."""

    exit_code = 1               # the CLIs' exit status for it (runtime/cli/group.py)


class EngineError(XcompileError):
    """An engine dir, engine file or request the runtime cannot serve."""


class OptionError(EngineError):
    """A command-line option whose value the engine dir, the model or the machine turns out not to allow (a
    --gamma past what the dir's graphs hold, --backend trt on a CPU): a bad option, so exit 2 like click's."""

    exit_code = 2
