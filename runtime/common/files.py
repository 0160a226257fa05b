"""Writes that cannot destroy: every xcompile output is locked, staged and renamed into place.

Every command that writes (export, build, train-eagle3, bench --json/--plot, diff --save) goes
through ``staged_dir`` or ``staged_file``, in this order:

    check    an output that is, contains or lies inside one of the command's inputs is refused
             (``--force`` or not: replacing it would delete the input)
    lock     an exclusive ``flock`` on ``<parent>/.<name>.lock``; a second writer of the same output
             fails at once, naming the holder (pid, host, command). The kernel drops the lock of a
             killed process, so a stale lock file never blocks
    clean    leftovers of killed runs (``.<name>.<8 chars>.partial`` / ``.old``) are removed; only
             the lock holder may, so no live run loses its staging dir. An ``.old`` holding the
             previous output while the output itself is missing (killed between the two renames
             of a swap) is moved back
    guard    an existing output needs ``replace`` (the command's --force); a directory is replaced
             only when xcompile wrote it (``MARKER``, an engine dir's manifest or a trained head's
             xcompile_train.json) or it is empty
    stage    the command writes into a sibling temp dir/file (same filesystem: the rename is atomic)
    commit   with SIGINT/SIGTERM held: old output renamed away, staged one renamed in, old removed

On an error or an interrupt, the staging dir/file and any parent dirs made for it are removed.
OSErrors (ENOSPC, EACCES, EROFS, ...) become one EngineError line naming the path and the errno.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from xcompile.runtime.common import interrupts
from xcompile.runtime.common.errors import EngineError, OptionError

# written into every dir xcompile stages: {"written_by": "xcompile export", "xcompile_version": ...}
MARKER = ".xcompile"
# dirs written before the marker existed: an engine dir (manifest.json with this format), a trained head
ENGINE_DIR_FORMAT = "xcompile-engine-dir"
HEAD_METADATA = "xcompile_train.json"
# tempfile's random part: 8 of [a-z0-9_], so ".a.<8>.partial" never matches the output "a.b"'s leftovers
_TOKEN = r"[a-z0-9_]{8}"

_HINTS = {
    errno.ENOSPC: "free some space there or choose another output",
    errno.EDQUOT: "free some space there or choose another output",
    errno.EACCES: "check the permissions or choose another path",
    errno.EPERM: "check the permissions or choose another path",
    errno.EROFS: "choose a path on a writable filesystem",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
}


def _meaning(e: OSError) -> str:
    return os.strerror(e.errno).lower() if e.errno else str(e)


def os_error_line(e: OSError, path: Path | str | None = None) -> str:
    """One line for an OSError: the path it names (else ``path``), the errno's meaning and a hint."""
    where = e.filename if e.filename is not None else path
    hint = _HINTS.get(e.errno)
    line = f"{where}: {_meaning(e)}" if where is not None else _meaning(e)
    return line + (f"; {hint}" if hint else "")


def _version() -> str:
    try:
        return version("xcompile")
    except PackageNotFoundError:
        return ""


def real(path: Path | str) -> Path:
    """Absolute path with symlinks resolved, also for a path that does not exist yet."""
    return Path(os.path.realpath(os.path.abspath(os.path.expanduser(str(path)))))


def _bad(option: str) -> type[EngineError]:
    """The error for an output path that cannot be: a bad option (exit 2) when a command-line option named it."""
    return OptionError if option.startswith("--") else EngineError


def check_not_input(out: Path, inputs: Iterable[Path | str | None], option: str = "the output") -> None:
    """Refuse an output that is, lies inside or contains one of ``inputs`` (files or dirs)."""
    target = real(out)
    for given in inputs:
        if given is None:
            continue
        source = real(given)
        if target == source:
            relation = "is"
        elif source in target.parents:
            relation = "lies inside"
        elif target in source.parents:
            relation = "contains"
        else:
            continue
        raise _bad(option)(f"{out}: {option} {relation} {source}, an input of this command; writing there "
                           "would destroy the input (with or without --force): choose another path")


def _writer(path: Path) -> str | None:
    """The command its marker says wrote ``path`` ("xcompile export", ...), None without one."""
    try:
        return json.loads((path / MARKER).read_text()).get("written_by")
    except (OSError, ValueError, AttributeError):
        return None


def written_by_xcompile(path: Path) -> bool:
    """Whether ``path`` is a dir xcompile wrote (see the module docstring's ``guard``)."""
    if (path / MARKER).is_file() or (path / HEAD_METADATA).is_file():
        return True
    try:
        return json.loads((path / "manifest.json").read_text()).get("format") == ENGINE_DIR_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# --------------------------------------------------------------------------------------------
# the lock


class OutputLock:
    """An exclusive lock on one output path, held by one process; ``holder`` describes who holds it."""

    def __init__(self, out: Path, what: str):
        self.out, self.what = out, what
        self.path = out.parent / f".{out.name}.lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise EngineError(f"{self.out}: another run is writing it ({holder}); wait for it to finish or "
                                  "choose another output") from None
            # the previous holder unlinks the file on release: lock the file that is at the path now
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join([self.what, *sys.argv[1:]]),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self.fd)
            self.fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, `{info['command']}`, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has just started"


# --------------------------------------------------------------------------------------------
# staging


def _make_parents(parent: Path) -> list[Path]:
    created = []
    for p in reversed([p for p in [parent, *parent.parents] if not p.exists()]):
        p.mkdir()
        created.append(p)
    return created


def _remove_dirs(created: list[Path]) -> None:
    for p in reversed(created):                     # deepest first, and only if still empty
        with contextlib.suppress(OSError):
            p.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _clean_leftovers(out: Path) -> None:
    """Staging leftovers of killed runs for ``out`` (the caller holds its lock)."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.{_TOKEN}\.(partial|old)")
    for p in out.parent.iterdir():
        if not pattern.fullmatch(p.name):
            continue
        kept = p / out.name
        if p.name.endswith(".old") and kept.exists() and not out.exists():
            kept.rename(out)                        # killed between the two renames of a swap
        _remove(p)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _output(out: Path, what: str, inputs: Iterable, option: str) -> Iterator[Path]:
    """Check, lock and clean for ``out`` (yielded, absolute); on failure, parent dirs made for it go."""
    out = real(out.parent) / out.name if out.name else real(out)
    check_not_input(out, inputs, option)
    created: list[Path] = []
    lock = OutputLock(out, what)
    done = False
    try:
        try:
            created = _make_parents(out.parent)
            lock.acquire()
        except OSError as e:
            where = f" ({e.filename})" if e.filename not in (None, str(out.parent), str(lock.path)) else ""
            raise _bad(option)(f"{out}: cannot write there: {_meaning(e)}{where}; choose another {option}") from None
        _clean_leftovers(out)
        yield out
        done = True
    except OSError as e:
        raise EngineError(os_error_line(e, out)) from e
    finally:
        lock.release()
        if not done:
            _remove_dirs(created)


SHIPPED = Path(__file__).resolve().parents[2] / "compile" / "demo"     # the package's demo models: never an output


@contextlib.contextmanager
def staged_dir(out: Path | str, what: str, *, inputs: Iterable = (), replace: bool = False,
               option: str = "--out", same_only: bool = False) -> Iterator[Path]:
    """A staging dir that becomes ``out`` when the block succeeds (module docstring). ``replace``:
    an existing ``out`` may be replaced (--force); ``inputs``: paths ``out`` must stay clear of; ``same_only``:
    replace only a dir an earlier ``what`` wrote (an output it rewrites without --force, as diff's --save)."""
    with _output(Path(out), what, inputs, option) as out:
        here = Path.cwd().resolve()
        if out.exists() and (here == out.resolve() or out.resolve() in here.parents):
            # replacing it would swap the directory the process (and the user's shell) stands in for a new one
            raise EngineError(f"{out}: is the current directory{'' if here == out.resolve() else ' or holds it'}; "
                              f"choose another {option} (a new directory beside it)")
        if SHIPPED == out.resolve() or SHIPPED in out.resolve().parents:
            raise EngineError(f"{out}: is part of the installed xcompile package (the demo models it ships); choose "
                              f"another {option}")
        if out.exists() or out.is_symlink():
            if not out.is_dir():
                raise EngineError(f"{out}: exists and is not a directory; choose another {option}")
            if not replace:
                raise EngineError(f"{out}: already exists; pass --force to replace it")
            if not written_by_xcompile(out) and any(out.iterdir()):
                raise EngineError(f"{out}: exists and was not written by xcompile; refusing to replace it, even with "
                                  f"--force: choose another {option} or remove it yourself")
            if same_only and any(out.iterdir()) and _writer(out) != what:
                raise EngineError(f"{out}: exists and was not written by {what} (an engine dir or another "
                                  f"command's output); refusing to replace it: choose another {option}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        try:
            yield tmp
            (tmp / MARKER).write_text(json.dumps({"written_by": what, "xcompile_version": _version()}) + "\n")
            tmp.chmod(0o777 & ~_umask())                # mkdtemp makes it 0700
            with interrupts.deferred():
                old = None
                if out.exists():
                    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
                    out.rename(old / out.name)
                tmp.rename(out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextlib.contextmanager
def staged_file(out: Path | str, what: str, *, inputs: Iterable = (), option: str = "the output") -> Iterator[Path]:
    """A temp file next to ``out`` that replaces it when the block succeeds (a file the user named is
    rewritten; a directory there is an error)."""
    with _output(Path(out), what, inputs, option) as out:
        if out.is_dir():
            raise EngineError(f"{out}: is a directory; {option} names a file to write")
        if out.exists() and written_by_xcompile(out.parent):       # an engine dir's manifest, weights, ...
            raise _bad(option)(f"{out}: a file of the dir {out.parent} xcompile wrote; writing {option} over it "
                               "would damage that dir: choose another path")
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            yield tmp
            tmp.chmod(0o666 & ~_umask())
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def link_tree(src: Path, dst: Path) -> None:
    """Hard-link (copy where links are not possible) every file of the flat dir ``src`` into ``dst``,
    so a staged rebuild starts from the current output without copying gigabytes. Writers never
    modify a file in place (they write a new one and rename it), so the old output stays intact."""
    for p in src.iterdir():
        if p.is_file() and p.name != MARKER:
            try:
                os.link(p, dst / p.name)
            except OSError:
                shutil.copy2(p, dst / p.name)
