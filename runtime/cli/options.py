"""Option types and checks both CLIs share, so every option fails at parse time, before any work.

Only click is imported here (``--help`` stays instant); checks that need the engine dir or a
library live next to the work they guard.
"""

from __future__ import annotations

import gzip
import math
import os
import re
import sys
from pathlib import Path

import click


class Finite(click.FloatRange):
    """A float in a range that is also finite (FloatRange lets nan through: every comparison with it is false)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value} is not a finite number", param, ctx)
        return value


def positive_float() -> Finite:
    return Finite(min=0, min_open=True)


# the sampling options' types: the ranges SamplingParams checks (runtime/decoding/sampling.py), refused
# here at parse time as bad options (exit 2) instead of later as a bad request
class Temperature(Finite):
    """0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE] (decoding/sampling.py's, repeated: it imports torch)."""

    low, high = 1e-5, 100.0

    def __init__(self):
        super().__init__(min=0, max=self.high)

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if 0 < value < self.low:
            self.fail(f"{value} is neither 0 (greedy) nor at least {self.low:g} (below it logits / T overflow)",
                      param, ctx)
        return value


TEMPERATURE = Temperature()
TOP_K = click.IntRange(min=0)
TOP_P = Finite(min=0, min_open=True, max=1)
MIN_P = Finite(min=0, max=1)
SEED = click.IntRange(0, 2**63 - 1)
YARN_FACTOR = Finite(min=1, min_open=True, max=32)     # xrun bench --yarn: up to 32 x 32,768 = 1,048,576 positions


class IntList(click.ParamType):
    """Comma-separated integers, each at least ``min``; ``empty`` says whether '' (none) is allowed
    and, when it is not, why (the message)."""

    name = "integers"

    def __init__(self, min: int = 1, empty: str | None = None, length: int | None = None):
        self.min, self.empty, self.length = min, empty, length

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        parts = [p.strip() for p in text.split(",")] if text else []
        if "" in parts:
            self.fail(f"{value!r}: an empty item between commas; expected comma-separated integers, e.g. 1,2,4",
                      param, ctx)
        try:
            ints = tuple(int(p) for p in parts)
        except ValueError:
            self.fail(f"{value!r}: expected comma-separated integers, e.g. 1,2,4", param, ctx)
        if not ints and self.empty is not None:
            self.fail(f"{value!r}: {self.empty}", param, ctx)
        if ints and self.length is not None and len(ints) != self.length:
            self.fail(f"{value!r}: expected {self.length} comma-separated integers", param, ctx)
        low = [i for i in ints if i < self.min]
        if low:
            self.fail(f"{value!r}: every value must be at least {self.min}, got {low[0]}", param, ctx)
        return ints


def utf8(value: str, option: str) -> str:
    """``value`` as given on the command line, refused when it is not valid UTF-8 (Python hands such
    bytes over as lone surrogates, which a tokenizer would choke on)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"{bad!r}"
        raise click.BadParameter(f"not valid UTF-8 ({byte} at character {e.start}); pass UTF-8 text",
                                 param_hint=option) from None
    return value


def decode_utf8(data: bytes, source: str, option: str) -> str:
    """``data`` (read from ``source``: stdin or a file) as text, refused when it is not valid UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.BadParameter(f"{source} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                                 "give UTF-8 text", param_hint=option) from None


def text_or_stdin(ctx, param, value):
    """Callback: a text option whose value '-' means "read it from stdin" (strict UTF-8 either way)."""
    if value is None:
        return None
    option = param.opts[0]
    if value != "-":
        return utf8(value, option)
    stdin = sys.stdin
    data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode("utf-8", "surrogateescape")
    return decode_utf8(data, "stdin", option)


def utf8_file(ctx, param, value):
    """Callback: a text file option (its type, a click.Path, checks that it is a readable file; ``.gz``:
    gzip-compressed), refused when its bytes are not UTF-8 or it holds no text, before any work (a model that
    takes minutes to load). Returns the path: the command reads the file itself."""
    if value is None:
        return None
    option, data = param.opts[0], Path(value).read_bytes()
    if value.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise click.BadParameter(f"{value} is not a readable gzip file ({e})", param_hint=option) from None
    text = decode_utf8(data, value, option)
    if not text or text.isspace():                  # (no stripped copy of what may be a large training file)
        raise click.BadParameter(f"{value} holds no text; give a file of text", param_hint=option)
    return value


def stop_strings(ctx, param, value):
    """Callback for ``--stop``: non-empty UTF-8 strings (an empty one would match at once)."""
    for s in value:
        if s == "":
            raise click.BadParameter("an empty stop string would stop before the first token; drop it",
                                     param_hint="--stop")
        utf8(s, "--stop")
    return value


def not_blank(ctx, param, value):
    """Callback: a source (a checkpoint dir, repo id or alias) that is not an empty string ('' would read as the
    current directory)."""
    if value is not None and not value.strip():
        raise click.BadParameter("an empty value; give a checkpoint directory, a repo id or an alias",
                                 param_hint=param.opts[0])
    return value


def writable_file(ctx, param, value):
    """Callback: an output file that can be written where it is asked for, checked before the work
    that fills it (its directory exists and is writable; the path is not a directory)."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("an empty path; give one", param_hint=param.opts[0])
    option, path = param.opts[0], Path(value)
    if path.is_dir():
        raise click.BadParameter(f"{path} is a directory; give a file path", param_hint=option)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise click.BadParameter(f"{parent} does not exist; create it first or write elsewhere", param_hint=option)
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise click.BadParameter(f"{path}: not writable here; choose another path", param_hint=option)
    return value


def writable_dir(ctx, param, value):
    """Callback: an output directory that can be created or written (its nearest existing ancestor is
    a writable directory; an existing path must be a directory)."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("an empty path; give one", param_hint=param.opts[0])
    option, path = param.opts[0], Path(value).absolute()
    if path.exists() and not path.is_dir():
        raise click.BadParameter(f"{path} exists and is not a directory", param_hint=option)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing.is_dir() and os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise click.BadParameter(f"{existing} is on a read-only file system, so {path} cannot be written; choose "
                                 "another path", param_hint=option)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise click.BadParameter(f"{existing} is not a writable directory, so {path} cannot be written; choose "
                                 "another path", param_hint=option)
    return value


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


class ByteSize(click.ParamType):
    """A size in bytes, with an optional K/M/G suffix (binary: 1K = 1024), as Polygraphy's --pool-limit."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        m = _SIZE.match(str(value))
        if not m:
            self.fail(f"{value!r}: expected a size like 512M or 4G", param, ctx)
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "")[:1].upper()])
        if size <= 0:
            self.fail(f"{value!r}: must be more than 0 bytes", param, ctx)
        return size


def given(ctx, name: str) -> bool:
    """Whether option ``name`` was on the command line (not its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def refuse_inert(ctx, names: list[str], why: str) -> None:
    """UsageError when any of the options ``names`` (parameter names) was given; ``why`` says why it
    would do nothing."""
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    hit = [flags[n] for n in names if given(ctx, n)]
    if hit:
        raise click.UsageError(f"{', '.join(hit)}: {why}", ctx)
