"""What the fast backend's kernels leave open: a frozen ``KernelConfig`` handed to its engines.

Every other launch choice is settled in the kernels' code, each with the measurement that made it. What
stays open is what a user or a benchmark must be able to choose:

    pdl        programmatic dependent launch (sm_90+): each kernel starts while the previous one drains
               and waits for its results with gdc_wait; off only to measure what it gives
    cuda_gemv  one-row calls on the CUDA C++ kernels where nvcc builds them (else Triton's GEMVs): bf16 of the
               shapes in ``tiles.cuda`` on gemv.cu's, FP8 and INT4 on qgemv.cu's; off to time the Triton GEMVs
    tiles      the tile tables, per weight shape (N_OUT, K): data in tiles.json, replaced by a tuning run's
               (the quantized one-row launches of qgemv.cu per kind: ``qgemv_fp8``, ``qgemv_int4``)
    row_invariant  one-row calls take the paths of several rows' (the tile kernels, attention's split layout of
               several rows) and attention reads each token's visible keys packed onto consecutive positions
               (a tree node's ancestors where plain decoding holds them), so a token's logits are the same bits
               alone as in any row of a verify block, chain or tree, and every drafter's greedy output is plain
               greedy's bit for bit; its cost is the one-row GEMV's speed and the packed passes
               (docs/performance.md measures it)

Tile tables are keyed by weight shape only, never by row count, so a row reduces in the same order at
every row count the tile kernel serves. The one exception keeps that order: ``one_row`` gives one-row calls on
the tile kernel (row_invariant's, the lm_heads') a tile of their own that differs from the shape's ``tile`` only
where the bits do not (the K split and, for calls that leave row sums, BLOCK_N stay; benchmarks/kernels.py
--one-row checks each entry bit for bit on the GPU before it is kept).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.common.gpu import launch_options, pdl_capable

TILES_FILE = Path(__file__).with_name("tiles.json")


class Tile(NamedTuple):
    """A tile-kernel tile (linear.py): BLOCK_N output columns x BLOCK_K of K per step, num_warps,
    num_stages, and K split over ``split`` programs (partial sums added by the last to arrive)."""
    block_n: int
    block_k: int
    warps: int
    stages: int
    split: int = 1

    def for_k(self, k: int) -> Tile:
        """This tile as it runs at K = k: BLOCK_K at most K's power of two, a split only where it covers whole
        K blocks."""
        tile = self._replace(block_k=min(self.block_k, max(16, 1 << (k - 1).bit_length())))
        return tile if k % (tile.split * tile.block_k) == 0 else tile._replace(split=1)


class Gemv(NamedTuple):
    """A one-row Triton GEMV tile (gemv.py): BLOCK_N output columns x BLOCK_K of K per step, num_warps, and
    the weight tiles ``ahead`` steps ahead in flight (1-4; the same bits at any)."""
    block_n: int
    block_k: int
    warps: int
    ahead: int = 1


class CudaGemv(NamedTuple):
    """A tile of gemv.cu's kernel: ``cols`` output columns a stage (1 or 2; a stage holds their weight rows,
    all of K), ``warps`` a block, ``stages`` (2-8) in shared memory, ``per_sm`` blocks a SM (0: as many as fit)."""
    cols: int
    warps: int
    stages: int
    per_sm: int = 0


class QGemv(NamedTuple):
    """A launch of qgemv.cu's quantized one-row kernel: ``warps`` a block, ``ks`` bytes of each row's codes a
    stage, ``stages`` (2-8) in shared memory, ``grid`` blocks (0: as many as fit on the device)."""
    warps: int
    ks: int
    stages: int
    grid: int = 0


Shape = tuple[int, int]          # a weight's (N_OUT, K)
TABLES = {"tile": Tile, "gemv": Gemv, "cuda": CudaGemv, "one_row": Tile, "qgemv_fp8": QGemv, "qgemv_int4": QGemv}


@dataclass(frozen=True)
class Tiles:
    """The tile tables: ``tile`` for the tile kernel (shapes not listed take DEFAULT_TILE), ``gemv`` for the
    shapes whose one-row calls run the Triton GEMV (others: the tile kernel), ``cuda`` for those that run
    gemv.cu's kernel where it is built, ``one_row`` for one-row calls on the tile kernel (module docstring),
    ``qgemv_fp8`` / ``qgemv_int4`` for quantized one-row calls on qgemv.cu (shapes not listed: the kind's
    default launch, cuda_qgemv.TILE)."""

    tile: Mapping[Shape, Tile] = field(default_factory=dict)
    gemv: Mapping[Shape, Gemv] = field(default_factory=dict)
    cuda: Mapping[Shape, CudaGemv] = field(default_factory=dict)
    one_row: Mapping[Shape, Tile] = field(default_factory=dict)
    qgemv_fp8: Mapping[Shape, QGemv] = field(default_factory=dict)
    qgemv_int4: Mapping[Shape, QGemv] = field(default_factory=dict)
    provenance: str = ""

    def __post_init__(self):
        for name, kind in TABLES.items():
            table = {tuple(shape): kind(*t) for shape, t in getattr(self, name).items()}
            object.__setattr__(self, name, MappingProxyType(table))
        for shape, t in self.one_row.items():
            if shape not in self.tile or t.for_k(shape[1]).split != self.tile[shape].for_k(shape[1]).split:
                raise EngineError(f"one_row {shape}: its K split must be the tile entry's "
                                  f"({self.tile.get(shape)}), or one row rounds otherwise than a block's rows")

    @classmethod
    def load(cls, path: Path | str) -> Tiles:
        """A tables file: {"provenance": "...", "tile": {"N,K": [fields], ...}, "gemv": {...}, "cuda": {...}}
        (tables left out are empty); EngineError naming the file and entry otherwise."""
        try:
            data = json.loads(Path(path).read_text())
            tables = {}
            for name, kind in TABLES.items():
                rows = data.get(name, {})
                tables[name] = {tuple(int(n) for n in shape.split(",")): kind(*row) for shape, row in rows.items()}
                assert all(len(s) == 2 for s in tables[name]), f"{name}: a shape is 'N_OUT,K'"
        except (OSError, ValueError, TypeError, AttributeError, AssertionError) as e:
            raise EngineError(f"{path}: not a tile tables file ({e}); expected {{\"tile\": {{\"N,K\": [fields]}}, "
                              "\"gemv\": ..., \"cuda\": ...}") from None
        try:
            return cls(**tables, provenance=str(data.get("provenance", "")))
        except EngineError as e:
            raise EngineError(f"{path}: {e}") from None

    def to_json(self) -> dict:
        return {"provenance": self.provenance, **{name: {f"{n},{k}": list(t) for (n, k), t in getattr(self, name).items()}
                                                  for name in TABLES}}

    def replace(self, **entries: Mapping[Shape, tuple | None]) -> Tiles:
        """These tables with some entries replaced or added, e.g. ``replace(tile={(4096, 4096): (64, 256, 4, 3)})``;
        an entry of None removes the shape from that table (its calls then take what an unlisted shape takes)."""
        tables = {name: {s: t for s, t in {**getattr(self, name), **entries.get(name, {})}.items() if t is not None}
                  for name in TABLES}
        return Tiles(**tables, provenance=self.provenance)


@functools.cache
def shipped_tiles() -> Tiles:
    """The tables in tiles.json, measured on an H200 (their provenance says how)."""
    return Tiles.load(TILES_FILE)


@dataclass(frozen=True)
class KernelConfig:
    """The fast backend's open kernel choices (module docstring)."""

    pdl: bool = True
    cuda_gemv: bool = True
    tiles: Tiles = field(default_factory=shipped_tiles)
    row_invariant: bool = False

    @property
    def pdl_on(self) -> bool:
        """Whether kernels launch with programmatic dependent launch here (asked for, and the GPU has it)."""
        return self.pdl and pdl_capable()

    def launch(self) -> dict:
        """Launch options of every step kernel."""
        return launch_options(self.pdl_on)


DEFAULT = KernelConfig()
