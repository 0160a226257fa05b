"""The key-map type each model family declares next to its module (``Qwen3.key_map``, ``Eagle3.key_map``),
as nano-vllm keeps ``packed_modules_mapping`` on the model class. Checked and applied by
compile/checkpoint/keymap.py (STYLE rule 2)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from xcompile.runtime.engines.qweight import QWeight

Reader = Callable[[str], torch.Tensor]          # checkpoint key -> tensor, as the weight source reads it

ROPE_CACHE = "RoPE tables are recomputed from rope_theta"


@dataclass(frozen=True)
class Stored:
    """One checkpoint tensor of a weight stored as several (a quantized linear's codes, scales, zeros)."""

    key: str
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    why: str                        # where the shape comes from, for errors


@dataclass(frozen=True)
class Packed:
    """A module tensor built from several checkpoint tensors when it is read: a quantized linear's weight.
    ``quantized(read, where)`` gives its canonical form (runtime/engines/qweight.py), ``where(key)`` naming the
    file that holds ``key``; ``build`` the weight dequantized (float32)."""

    stored: tuple[Stored, ...]
    quantized: Callable[[Reader, Callable[[str], str]], QWeight]

    def build(self, read: Reader, where: Callable[[str], str]) -> torch.Tensor:
        return self.quantized(read, where).dequantize()


@dataclass(frozen=True)
class KeyMap:
    """How a module's state (unique parameters + persistent buffers) is filled from a checkpoint.

    tensors   module state name -> checkpoint key; present unless ``derived`` can make it
    ignored   checkpoint key regex (full match) -> why nothing reads such a key
    external  module state filled from another model, not from this checkpoint
    derived   module state name -> builds it from other keys (through the reader) when its key is absent
    checks    module state name -> validates the tensor's values (tensor, where) after reading
    packed    module state name -> the checkpoint tensors it is built from (compile/checkpoint/quantized.py)
    """

    tensors: dict[str, str]
    ignored: dict[str, str] = field(default_factory=dict)
    external: frozenset[str] = frozenset()
    derived: dict[str, Callable[[Reader], torch.Tensor]] = field(default_factory=dict)
    checks: dict[str, Callable[[torch.Tensor, str], None]] = field(default_factory=dict)
    packed: dict[str, Packed] = field(default_factory=dict)
