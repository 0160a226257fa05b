"""The kernels' open choices (runtime/engines/kernels/config.py): the tile tables as data, and KernelConfig."""

from __future__ import annotations

import json

import pytest

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.engines.kernels.config import (
    DEFAULT,
    TILES_FILE,
    CudaGemv,
    Gemv,
    KernelConfig,
    Tile,
    Tiles,
    shipped_tiles,
)


def test_the_shipped_tables_load_with_their_provenance():
    tiles = shipped_tiles()
    assert tiles.provenance and "H200" in tiles.provenance
    assert tiles.tile[(6144, 4096)] == Tile(64, 256, 4, 3, 2)               # Qwen3-8B qkv, split 2
    assert tiles.gemv[(4096, 12288)] == Gemv(4, 512, 4, 2)                   # down: 2 tiles ahead
    assert tiles.cuda[(12288, 4096)] == CudaGemv(2, 4, 2)                    # gate/up on gemv.cu
    assert tiles.one_row[(12288, 4096)] == Tile(32, 256, 4, 3, 1)            # ... and under row_invariant
    assert all(t.split == tiles.tile[s].split for s, t in tiles.one_row.items())
    assert DEFAULT.tiles is tiles and DEFAULT.pdl and DEFAULT.cuda_gemv


def test_tables_round_trip_through_json(tmp_path):
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(shipped_tiles().to_json()))
    assert Tiles.load(path) == shipped_tiles()


def test_tables_are_read_only_and_replace_makes_new_ones():
    tiles = shipped_tiles()
    with pytest.raises(TypeError):
        tiles.tile[(1, 2)] = Tile(16, 16, 1, 1)
    new = tiles.replace(tile={(1, 2): (16, 16, 1, 1)}, gemv={(6144, 4096): (8, 256, 4)})
    assert new.tile[(1, 2)] == Tile(16, 16, 1, 1) and new.gemv[(6144, 4096)] == Gemv(8, 256, 4)
    assert (1, 2) not in tiles.tile and tiles.gemv[(6144, 4096)] == Gemv(4, 256, 4)
    with pytest.raises(Exception):
        DEFAULT.pdl = False                                                     # frozen


@pytest.mark.parametrize("text", ['{"tile": {"6144": [64, 256, 4, 3]}}', '{"gemv": {"1,2": [1, 2, 3, 4, 5]}}',
                                  '[]', '{"tile": {"1,2": "64"}}', 'not json'])
def test_a_bad_tables_file_is_one_line_naming_it(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(EngineError, match="bad.json: not a tile tables file"):
        Tiles.load(path)


def test_pdl_is_off_where_the_gpu_lacks_it():
    """In the interpreter (and before sm_90) no kernel launches with PDL, whatever the config asks."""
    import torch
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("this GPU has PDL")
    assert not KernelConfig(pdl=True).pdl_on and KernelConfig().launch() == {}


def test_the_tables_file_is_the_package_data():
    assert TILES_FILE.name == "tiles.json" and TILES_FILE.is_file()
