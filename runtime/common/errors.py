"""Errors raised at the runtime's boundaries (bad engine dirs, bad requests)."""


class XcompileError(Exception):
    """Base of every error xcompile reports to a user: one line, says which file and what to do."""


class EngineError(XcompileError):
    """An engine dir, engine file or request the runtime cannot serve."""
