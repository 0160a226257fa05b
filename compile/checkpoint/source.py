"""``WeightSource``: where one model's weights come from, built once and asked for its files, hashes
and tensors, so no caller branches on "checkpoint or synthetic".

    CheckpointSource(dir)          a checkpoint dir (compile/checkpoint/files.py), read through the
                                   module's key map, checked strictly before the first tensor is read;
                                   a quantized one (config.json's quantization_config) is dequantized
    SyntheticSource(name, seed)    seeded random weights (compile/synthetic.py)

Every tensor a source hands out passes through ``WeightSource._read`` (the one place for per-tensor
value checks), and ``fingerprint`` is one digest of what the weights depend on (to record in the
manifest and compare at load).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from xcompile.compile.checkpoint.files import Checkpoint, weight_file_names
from xcompile.compile.checkpoint.keymap import module_state, plan
from xcompile.compile.checkpoint.quantized import quantized_key_map
from xcompile.compile.checkpoint.resolution import refetch_hint
from xcompile.compile.errors import CompileError
from xcompile.compile.hf_config import read_json
from xcompile.compile.models.keymap import KeyMap
from xcompile.compile.quantization import Quantization, parse_quantization
from xcompile.runtime.enginedir import integrity
from xcompile.runtime.engines.qweight import QWeight

Weights = Iterator[tuple[str, torch.Tensor | QWeight]]


class WeightSource(ABC):
    """The weights of one model. Modules ask by their own state names; each family's ``key_map()``
    says how those names map onto the source."""

    @property
    @abstractmethod
    def source(self) -> str:
        """What the manifest records as ``ModelEntry.source``: a checkpoint dir or ``synthetic-hash:<name>:<seed>``."""

    def files(self) -> dict[str, Path]:
        """File name (relative to the source) -> path of every file the weights are read from."""
        return {}

    @cached_property
    def _records(self) -> dict[str, dict]:
        return {name: integrity.record_file(path) for name, path in self.files().items()}

    def records(self) -> dict[str, dict]:
        """File name -> size and hashes of ``files()`` (runtime/enginedir/integrity.py: what the manifest records and
        the torch backend checks the checkpoint against at load), computed once per source."""
        return dict(self._records)

    def hashes(self) -> dict[str, str]:
        """File name -> digest of ``files()`` (their records' ``sha256``), computed once per source."""
        return {name: r["sha256"] for name, r in self._records.items()}

    def fingerprint(self) -> str:
        """One sha256 over what the weights depend on: ``identity()`` and every file's hash."""
        digest = hashlib.sha256(self.identity().encode())
        for name, value in sorted(self.hashes().items()):
            digest.update(f"\n{name} {value}".encode())
        return digest.hexdigest()

    def identity(self) -> str:
        """The part of the fingerprint that is not a file: empty for checkpoints (their files say it all)."""
        return ""

    @property
    def quantization(self) -> Quantization | None:
        """How the weights are quantized (compile/quantization.py), None when they are not."""
        return None

    def key_map(self, model: nn.Module) -> KeyMap:
        """``model``'s key map as this source stores its weights (quantized linears: their stored tensors)."""
        return model.key_map()

    def quantized(self, model: nn.Module, name: str) -> QWeight | None:
        """State ``name`` of ``model`` in its quantized form (runtime/engines/qweight.py), None where the source
        stores it unquantized."""
        return None

    def check(self, model: nn.Module) -> None:
        """Raise now, before any weight is read, where this source cannot fill ``model`` (keys, shapes, dtypes)."""
        self._names(model, self.key_map(model))

    def tensors(self, model: nn.Module, quantized: bool = False, device: torch.device | str = "cpu") -> Weights:
        """Stream (module state name, tensor) for ``model`` (which may live on the meta device), one
        tensor in memory at a time, floating-point tensors cast to the model's dtype, on ``device``: each is
        moved (or drawn) there before it is cast and checked, so on a GPU the casts and checks of an 8B model
        cost milliseconds, not the CPU's minute. External state (an EAGLE3 head's ``embed_tokens.weight``: the
        target's) is not yielded. ``quantized``: a quantized linear comes as its ``QWeight``
        (runtime/engines/qweight.py, on the host), checked as its dequantized weight would be."""
        device = torch.device(device)
        key_map = self.key_map(model)
        state = module_state(model)
        for name in self._names(model, key_map):
            q = self.quantized(model, name) if quantized and name in key_map.packed else None
            if q is None:
                yield name, self._read(model, key_map, name, state[name], device)
                continue
            # the graph computes with the fp32 dequantized weight rounded to its dtype: NaN codes (e4m3 has
            # them) or an overflow of that dtype are refused here as for a dequantized read
            dense = q.dequantize()
            _check_finite(name, dense, dense.to(state[name].dtype), self._where(model, key_map, name))
            yield name, q

    def tensor(self, model: nn.Module, name: str) -> torch.Tensor:
        """One state tensor of ``model`` (e.g. an EAGLE3 head's ``d2t``, a target's embedding), in its dtype."""
        return self._read(model, self.key_map(model), name, module_state(model)[name], torch.device("cpu"))

    def _read(self, model: nn.Module, key_map: KeyMap, name: str, like: torch.Tensor,
              device: torch.device) -> torch.Tensor:
        """Every tensor of every source passes here: fetched onto ``device``, value-checked by the key map
        (d2t's range), cast to the module's dtype (floating point only) and refused if not finite. Per-tensor
        value checks go here."""
        tensor, where = self._fetch(model, key_map, name, like, device)
        tensor = tensor.to(device)
        if name in key_map.checks:
            key_map.checks[name](tensor, where)
        if not tensor.is_floating_point():
            return tensor
        cast = tensor.to(like.dtype)
        _check_finite(name, tensor, cast, where)
        return cast

    def _where(self, model: nn.Module, key_map: KeyMap, name: str) -> str:
        """Where state ``name`` is stored, for error messages."""
        return self.source

    @abstractmethod
    def _names(self, model: nn.Module, key_map: KeyMap) -> list[str]:
        """The state names ``tensors`` yields, in order; raises before any read if the source cannot fill them."""

    @abstractmethod
    def _fetch(self, model: nn.Module, key_map: KeyMap, name: str, like: torch.Tensor,
               device: torch.device) -> tuple[torch.Tensor, str]:
        """The raw tensor for state ``name`` (shaped like ``like``; on ``device`` where the source can make it
        there, else on the host) and where it came from (for error messages)."""


def _check_finite(name: str, tensor: torch.Tensor, cast: torch.Tensor, where: str) -> None:
    """A NaN/Inf weight (or one a cast to fp16 overflows) turns every output into NaN: refuse it by name."""
    if bool(torch.isfinite(cast).all()):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise CompileError(f"{where}: tensor {name!r} holds {bad} NaN/Inf value(s) of {tensor.numel()}; the "
                           "checkpoint is corrupt or comes from a diverged run: fetch or train it again")
    raise CompileError(f"{where}: tensor {name!r} overflows {cast.dtype} (|max| {float(tensor.abs().max()):.3g}); "
                       "export --dtype bf16 or fp32")


class CheckpointSource(WeightSource):
    """A checkpoint dir. Its weight files are opened once, at the first read (headers only)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    @property
    def source(self) -> str:
        return str(self.path)

    @cached_property
    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.path)

    def files(self) -> dict[str, Path]:
        return {name: self.path / name for name in weight_file_names(self.path)}

    @cached_property
    def quantization(self) -> Quantization | None:
        return parse_quantization(self.path / "config.json", read_json(self.path / "config.json"))

    def key_map(self, model: nn.Module) -> KeyMap:
        key_map = model.key_map()
        if self.quantization is None:
            return key_map
        return quantized_key_map(key_map, self.quantization, model, self.checkpoint)

    def _names(self, model: nn.Module, key_map: KeyMap) -> list[str]:
        return list(plan(self.checkpoint, model, key_map))

    def quantized(self, model: nn.Module, name: str) -> QWeight | None:
        packed = self.key_map(model).packed.get(name)
        if packed is None:
            return None
        ckpt = self.checkpoint
        return packed.quantized(ckpt.get, lambda k: str(ckpt.file(k)))

    def _where(self, model: nn.Module, key_map: KeyMap, name: str) -> str:
        packed = key_map.packed.get(name)
        return str(self.checkpoint.file(packed.stored[0].key if packed else key_map.tensors[name]))

    def _fetch(self, model: nn.Module, key_map: KeyMap, name: str, like: torch.Tensor,
               device: torch.device) -> tuple[torch.Tensor, str]:
        ckpt = self.checkpoint
        if name in key_map.packed:                  # a quantized linear, dequantized here
            packed = key_map.packed[name]
            return packed.build(ckpt.get, lambda k: str(ckpt.file(k))), str(ckpt.file(packed.stored[0].key))
        key = key_map.tensors[name]
        if key in ckpt:
            return ckpt.get(key), str(ckpt.file(key))
        if name not in key_map.derived:             # read before plan() checked the keys (tensor(): a head's d2t)
            raise CompileError(f"{ckpt.path}: missing tensor '{key}' that config.json implies; the checkpoint is "
                               f"incomplete or not of this model: {refetch_hint(ckpt.path)}")
        return key_map.derived[name](ckpt.get), str(ckpt.path)
