"""Errors raised at the compile side's boundaries (configs, checkpoints, export, build)."""

from xcompile.runtime.common.errors import XcompileError


class CompileError(XcompileError):
    """A checkpoint, config or build request that cannot be compiled; the message says what to do."""
