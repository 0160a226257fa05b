"""Reading a checkpoint dir's weight files lazily: single or sharded safetensors (memory-mapped) and
pytorch_model.bin (weights_only, mmap). Headers are read at open, so a bad file fails by name before
any weight is read; tensors are read one at a time on demand."""

from __future__ import annotations

import hashlib
import pickle
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from xcompile.compile.checkpoint.resolution import refetch_hint
from xcompile.compile.errors import CompileError
from xcompile.compile.hf_config import read_json

# weight layouts in the order we look for them (HF save_pretrained names)
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_INDEX, SAFETENSORS, TORCH_BIN_INDEX, TORCH_BIN)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class _SafetensorsFile:
    """One .safetensors file; the header is parsed at open, tensors are read on demand (mmap)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._f = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CompileError(f"{path}: not a readable safetensors file ({e}); the file is truncated or "
                               f"corrupt: {refetch_hint(path)}") from None
        self._keys = list(self._f.keys())

    def keys(self) -> list[str]:
        return self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        name = self._f.get_slice(key).get_dtype()
        if name not in _SAFETENSORS_DTYPES:
            raise CompileError(f"{self.path}: tensor '{key}' has dtype {name}, which xcompile cannot load")
        return _SAFETENSORS_DTYPES[name]

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._f.get_tensor(key)
        except SafetensorError as e:
            raise CompileError(f"{self.path}: cannot read tensor '{key}' ({e})") from None


class _TorchFile:
    """One pytorch_model.bin (torch.save zip format): loaded with weights_only and mmap, so tensors
    are paged in when read."""

    def __init__(self, path: Path):
        self.path = path
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
            raise CompileError(f"{path}: not a readable torch checkpoint ({str(e).splitlines()[0]}); the file is "
                               f"truncated or corrupt: {refetch_hint(path)}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CompileError(f"{path}: expected a flat dict of tensors (a state dict)")
        self._state = state

    def keys(self) -> list[str]:
        return list(self._state)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._state[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._state[key].dtype

    def get(self, key: str) -> torch.Tensor:
        return self._state[key]


def weight_file_names(path: Path) -> list[str]:
    """The files a checkpoint dir's weights are read from: config.json, then the index and its shards,
    or the one weights file (what the manifest hashes). Empty of weights is not an error here."""
    names = ["config.json"]
    for index in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        if (path / index).is_file():
            return names + [index, *sorted(set(read_json(path / index).get("weight_map", {}).values()))]
    return names + [n for n in (SAFETENSORS, TORCH_BIN) if (path / n).is_file()][:1]


class Checkpoint:
    """The weights of one checkpoint dir: ``model.safetensors``, sharded safetensors with
    ``model.safetensors.index.json``, or ``pytorch_model.bin`` (sharded or not). Headers are read
    at construction (so a bad file fails here, by name); tensors are read by ``get``."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        present = [name for name in WEIGHT_FILES if (self.path / name).is_file()]
        if not present:
            raise CompileError(f"{self.path}: no weights (looked for {', '.join(WEIGHT_FILES)}); "
                               f"{refetch_hint(self.path)}")
        name = present[0]
        reader = _TorchFile if name.startswith("pytorch_model") else _SafetensorsFile
        if name.endswith(".index.json"):
            self._files = self._open_shards(self.path / name, reader)
        else:
            f = reader(self.path / name)
            self._files = dict.fromkeys(f.keys(), f)

    def _open_shards(self, index: Path, reader) -> dict:
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CompileError(f"{index}: field 'weight_map' should map tensor names to shard files")
        shards = {}
        for shard in sorted(set(weight_map.values())):
            if not (self.path / shard).is_file():
                raise CompileError(f"{self.path / shard}: shard file listed in {index.name} is missing; "
                                   f"{refetch_hint(self.path)}")
            shards[shard] = reader(self.path / shard)
        for shard, f in shards.items():
            listed = {k for k, v in weight_map.items() if v == shard}
            if listed - set(f.keys()):
                raise CompileError(f"{index}: lists tensor '{min(listed - set(f.keys()))}' in {shard}, which has no "
                                   "such tensor (bad index)")
            if set(f.keys()) - listed:
                raise CompileError(f"{f.path}: holds tensor '{min(set(f.keys()) - listed)}' that {index.name} does "
                                   "not list (bad index)")
        return {k: shards[v] for k, v in weight_map.items()}

    def keys(self) -> list[str]:
        return list(self._files)

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def file(self, key: str) -> Path:
        """The file that holds ``key`` (a shard for sharded checkpoints)."""
        return self._files[key].path

    def shape(self, key: str) -> tuple[int, ...]:
        return self._files[key].shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._files[key].dtype(key)

    def get(self, key: str) -> torch.Tensor:
        return self._files[key].get(key)


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks (weights files are GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
