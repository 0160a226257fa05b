"""Sizes and hashes of the files of an engine dir (and of the checkpoints it came from), checked at load.

A file's record, written by whoever writes the file (exporter, builder) and kept in the manifest:

    {"size": bytes, "block_size": B, "blocks": [digest of block 0, 1, ...], "sha256": digest of the blocks}

Hashing is two-level so that one streaming pass, before the size is known, serves any file size:
1 MiB leaves are hashed (sha256) as bytes arrive; a block is ``B = 1 MiB * 2^k`` (the least power of
two that keeps a file at or under ``MAX_BLOCKS`` blocks) and its digest is sha256 over its leaves'
digests, truncated to 128 bits (integrity against corruption and edits, not authenticity).

Checks (``verify``): the size always; then every block (``full``: ``xrun ... --verify``,
``xcompile verify``, and builds, which read the whole graph anyway) or a sample (the default): all
blocks of a file up to ``FAST_BYTES``, else the first, the last and random ones, ``SAMPLE_BYTES``
per file in all. An 8B engine dir is checked in well under a second that way
(benchmarks/verify_speed.py); a same-size edit of a big file is caught by the fast check only when
it lands in a sampled block, every time by the full one.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from pathlib import Path

from xcompile.runtime.common.errors import EngineError

LEAF = 1 << 20
MAX_BLOCKS = 1024
DIGEST_HEX = 32                 # sha256 truncated to 128 bits, as hex
FAST_BYTES = 32 << 20           # files up to this size are hashed whole by the fast check
SAMPLE_BYTES = 16 << 20         # bytes the fast check hashes per larger file (at least 4 blocks)
MIN_SAMPLES = 4


def block_size_for(size: int) -> int:
    b = LEAF
    while b * MAX_BLOCKS < size:
        b *= 2
    return b


def _combine(digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()[:DIGEST_HEX]


class Digest:
    """A file's record, computed from its bytes in write order (``update``), one pass."""

    def __init__(self):
        self.size, self.leaves, self._leaf, self._filled = 0, [], hashlib.sha256(), 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        while len(view):
            take = min(LEAF - self._filled, len(view))
            self._leaf.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == LEAF:
                self.leaves.append(self._leaf.digest())
                self._leaf, self._filled = hashlib.sha256(), 0

    def record(self) -> dict:
        leaves = self.leaves + ([self._leaf.digest()] if self._filled else [])
        block = block_size_for(self.size)
        per = block // LEAF
        blocks = [_combine(leaves[i:i + per]) for i in range(0, len(leaves), per)]
        return {"size": self.size, "block_size": block, "blocks": blocks,
                "sha256": hashlib.sha256("".join(blocks).encode()).hexdigest()}


def record_file(path: Path) -> dict:
    """The record of an existing file (read once)."""
    digest = Digest()
    with open(path, "rb") as f:
        while chunk := f.read(16 * LEAF):
            digest.update(chunk)
    return digest.record()


def _block_digest(f, index: int, block: int, size: int, buf: bytearray) -> str:
    f.seek(index * block)
    left, leaves = min(block, size - index * block), []
    while left > 0:
        n = f.readinto(memoryview(buf)[:min(LEAF, left)])
        if not n:
            break
        leaves.append(hashlib.sha256(memoryview(buf)[:n]).digest())
        left -= n
    return _combine(leaves)


def sampled_blocks(record: dict, rng: random.Random | None = None) -> list[int]:
    """The blocks the fast check hashes: all of a small file; else first, last and random ones."""
    n, block = len(record["blocks"]), record["block_size"]
    if record["size"] <= FAST_BYTES or n <= MIN_SAMPLES:
        return list(range(n))
    k = max(MIN_SAMPLES, SAMPLE_BYTES // block)
    middle = (rng or random.SystemRandom()).sample(range(1, n - 1), min(k - 2, n - 2))
    return sorted({0, n - 1, *middle})


def check_file(path: Path, record: dict, full: bool = False) -> str | None:
    """What is wrong with ``path`` against its record (None: it matches)."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            return "is not a regular file"
        if size != record["size"]:
            return f"has {size} bytes, {record['size']} were recorded (truncated, grown or replaced)"
        block = record["block_size"]
        buf = bytearray(LEAF)
        with open(path, "rb") as f:
            for i in range(len(record["blocks"])) if full else sampled_blocks(record):
                if _block_digest(f, i, block, size, buf) != record["blocks"][i]:
                    return (f"bytes {i * block}..{min((i + 1) * block, size)} differ from what was recorded "
                            "(modified or corrupt)")
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def verify(directory: Path, records: dict, names: Iterable[str], *, full: bool = False, fix: str) -> None:
    """Check files ``names`` of ``directory`` against ``records`` (name -> record); the first problem is
    an EngineError naming the file and ending with ``fix`` (what to do)."""
    for name in names:
        record = records.get(name)
        if record is None:
            raise EngineError(f"{Path(directory) / name}: the manifest records no size or hash for it (written by an "
                              f"older xcompile?); {fix}")
        problem = check_file(Path(directory) / name, record, full)
        if problem is not None:
            raise EngineError(f"{Path(directory) / name}: {problem}; {fix}")
