"""Errors raised at the compile side's boundaries (configs, checkpoints, export, build)."""

from xcompile.runtime.common.errors import XcompileError


class CompileError(XcompileError):
    """A checkpoint, config or build request that cannot be compiled; the message says what to do."""


class CompileOptionError(CompileError):
    """A command-line option whose value the checkpoint, the model or the machine turns out not to allow (a
    --seq-len past the model's positions): a bad option, so exit 2 like click's."""

    exit_code = 2
