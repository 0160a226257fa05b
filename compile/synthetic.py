"""Seeded random weights in the shape of a real config, for runs without a downloaded checkpoint.

Each tensor is drawn from (seed, tensor name), so ``synthetic_state`` can stream one tensor at a time onto
a meta-device model (an 8B model does not fit twice in 24 GB of RAM) and still give the same weights as a
fully built ``synthetic_qwen3``. The draw is counter-based (``uniform``: element i is an integer hash of the
tensor's key and i), so a tensor is made where it will live: the CPU export and a GPU opening the dir get the
same bits, and an 8B model's weights are drawn on the GPU in well under a second (a CPU generator took about
a minute of an 8B dir's opening, issue 37).

Init: projections and embeddings uniform with standard deviation std = 0.02 (HF ``initializer_range`` of
Qwen3), RMSNorm weights 1, so residual activations stay O(1..100) and finite in bf16. A draft vocabulary's d2t
(an EAGLE3 head's, an MTP module's) is a valid offset table: sorted distinct target ids minus arange
(docs/eagle3.md §2).

An engine dir exported from synthetic weights records each model's source as
``synthetic-hash:<name>:<seed>`` (``source``/``parse_source``): the target draws from the request's seed, its
EAGLE3 head from seed + 1 and the draft model from seed + 2 (``SEED_OFFSETS``), so the torch backend and
``xcompile diff`` rebuild the very weights the graphs hold. ``synthetic:`` sources were drawn by the torch
generator of earlier versions and are refused (they name other weights than their graphs hold).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from xcompile.compile.checkpoint import build_eagle3, build_qwen3, module_state
from xcompile.compile.checkpoint.source import WeightSource
from xcompile.compile.config import KNOWN_MODELS, Qwen3Config, synthetic_eagle3_config
from xcompile.compile.errors import CompileError, CompileOptionError
from xcompile.compile.models import eagle3, mtp
from xcompile.compile.models.keymap import KeyMap
from xcompile.compile.models.layers import RMSNorm
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.runtime.enginedir.contract import DRAFT, EAGLE3, MTP, TARGET

INIT_STD = 0.02     # Qwen3 config.json initializer_range
SOURCE_PREFIX = "synthetic-hash:"
OLD_PREFIX = "synthetic:"           # before the counter-based draw (2026-12-05)
SEED_OFFSETS = {TARGET: 0, EAGLE3: 1, DRAFT: 2, MTP: 3}


def source(name: str, seed: int, role: str = TARGET) -> str:
    """The manifest source (``ModelEntry.source``) of ``role``'s weights in a dir made with ``seed``."""
    return f"{SOURCE_PREFIX}{name}:{seed + SEED_OFFSETS[role]}"


def parse_source(entry_source: str) -> tuple[str, int] | None:
    """(name, seed) of a ``synthetic-hash:<name>:<seed>`` source; None for a checkpoint dir; CompileError for an
    earlier version's ``synthetic:`` source."""
    if entry_source.startswith(OLD_PREFIX):
        raise CompileError(f"manifest source {entry_source!r}: synthetic weights drawn by an earlier xcompile, which "
                           "this one would not draw again; re-export the dir (xcompile export --synthetic ... --force)")
    if not entry_source.startswith(SOURCE_PREFIX):
        return None
    name, _, seed = entry_source.removeprefix(SOURCE_PREFIX).rpartition(":")
    return name, int(seed)


def _key(seed: int, name: str) -> int:
    # crc32, not hash(): Python salts str hashes per process
    return zlib.crc32(f"{seed}:{name}".encode())


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(_key(seed, name))


_M32 = 0xFFFFFFFF
# elements hashed a step on the CPU, where 2^16 int64 lanes stay in the cache (2-core CPU: 0.43 s for 50M
# elements, against 0.50 s for randn and its scaling); on a GPU a step of 2^26 bounds the temporaries to 0.5 GB
_CPU_CHUNK, _GPU_CHUNK = 1 << 16, 1 << 26


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 lanes holding 32-bit values; the multipliers are below 2^31, so no
    product overflows int64 and every device computes the same bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def uniform(shape: tuple[int, ...] | torch.Size, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 values in (-1, 1), element i a hash of (key, i): 24 random bits as an odd integer in
    (-2^24, 2^24) times 2^-24, every step exact, so the CPU and any GPU draw the very same tensor."""
    device = torch.device(device)
    n = math.prod(shape)
    if n >= 1 << 32:
        raise CompileError(f"a synthetic tensor of {n} elements is past the 2^32 its draw counts")
    out = torch.empty(n, dtype=torch.float32, device=device)
    chunk = _GPU_CHUNK if device.type == "cuda" else _CPU_CHUNK
    for start in range(0, n, chunk):
        i = torch.arange(start, min(n, start + chunk), dtype=torch.int64, device=device)
        bits = _mix(_mix(i) ^ (key & _M32)) >> 8
        out[start:start + i.numel()] = (2 * bits - ((1 << 24) - 1)).to(torch.float32).mul_(2.0 ** -24)
    return out.view(tuple(shape))


def draft_ids(seed: int, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The target ids a synthetic draft vocabulary covers: sorted, distinct, [draft_vocab] int64."""
    return torch.randperm(vocab_size, generator=_generator(seed, "d2t"))[:draft_vocab_size].sort().values


def _d2t(model: nn.Module, seed: int) -> torch.Tensor:
    ids = draft_ids(seed, model.cfg.vocab_size, model.d2t.shape[0])
    return ids - torch.arange(ids.shape[0])


def _t2d(model: nn.Module, seed: int) -> torch.Tensor:
    return eagle3.t2d_from_d2t(_d2t(model, seed), model.cfg.vocab_size)


# state that is not a random weight, by model kind: a draft vocabulary's valid map (EAGLE3 head, MTP module)
_SPECIAL = {eagle3.KIND: {"d2t": _d2t, "t2d": _t2d}, mtp.KIND: {"d2t": _d2t}}


def synthetic_tensor(model: nn.Module, name: str, like: torch.Tensor, seed: int, std: float = INIT_STD,
                     norm_std: float = 0.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The synthetic value of one state tensor of ``model`` (a Qwen3, an Eagle3 or an MTP module), drawn on
    ``device`` (the same bits on any device)."""
    special = _SPECIAL.get(model.kind, {}).get(name)
    if special is not None:
        return special(model, seed).to(device)
    owner = model.get_submodule(name.rpartition(".")[0])
    # uniform(-a, a) has standard deviation a / sqrt(3); one multiply (and one add), each correctly rounded
    u = uniform(like.shape, _key(seed, name), device)
    if isinstance(owner, RMSNorm):
        return u.mul_(norm_std * math.sqrt(3)).add_(1.0).to(like.dtype)
    return u.mul_(std * math.sqrt(3)).to(like.dtype)


class SyntheticSource(WeightSource):
    """Seeded random weights for any module: no files; each tensor drawn from (seed, state name)."""

    def __init__(self, name: str, seed: int, std: float = INIT_STD, norm_std: float = 0.0):
        self.name, self.seed, self.std, self.norm_std = name, seed, std, norm_std

    @classmethod
    def for_role(cls, name: str, seed: int, role: str) -> SyntheticSource:
        """The weights of ``role`` in a dir made with ``seed`` (``SEED_OFFSETS``)."""
        return cls(name, seed + SEED_OFFSETS[role])

    @property
    def source(self) -> str:
        return f"{SOURCE_PREFIX}{self.name}:{self.seed}"

    def identity(self) -> str:
        return f"{self.source}:std={self.std}:norm_std={self.norm_std}"

    def _names(self, model: nn.Module, key_map: KeyMap) -> list[str]:
        return [n for n in module_state(model) if n not in key_map.external]

    def _fetch(self, model: nn.Module, key_map: KeyMap, name: str, like: torch.Tensor,
               device: torch.device) -> tuple[torch.Tensor, str]:
        return synthetic_tensor(model, name, like, self.seed, self.std, self.norm_std, device), self.source


def synthetic_state(model: nn.Module, seed: int = 0, std: float = INIT_STD, norm_std: float = 0.0
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (state name, tensor) for ``model`` (may live on the meta device), in its dtype.
    Like ``CheckpointSource.tensors``: an EAGLE3 head's ``embed_tokens.weight`` is the target's and
    is not yielded."""
    return SyntheticSource("", seed, std, norm_std).tensors(model)


def known_config(name_or_cfg: str | Qwen3Config, option: str | None = None) -> Qwen3Config:
    """The config of a KNOWN_MODELS alias (a config is returned as is); CompileError naming the known ones, a
    CompileOptionError (exit 2) naming ``option`` when the name came from that command-line option."""
    if isinstance(name_or_cfg, Qwen3Config):
        return name_or_cfg
    known = KNOWN_MODELS.get(name_or_cfg.lower())
    if known is None or known.config is None:
        shapes = ", ".join(alias for alias, m in KNOWN_MODELS.items() if m.config is not None)
        if option is not None:
            raise CompileOptionError(f"{option} {name_or_cfg}: no synthetic weights in that shape; give one of "
                                     f"{shapes}")
        raise CompileError(f"unknown model {name_or_cfg!r} for synthetic weights; known: {shapes}")
    return known.config


def synthetic_qwen3(name_or_cfg: str | Qwen3Config, max_seq_len: int, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                    taps: tuple[int, ...] | None = None, std: float = INIT_STD, norm_std: float = 0.0) -> Qwen3:
    """A Qwen3 with seeded random weights in the shape of a KNOWN_MODELS alias (or a config)."""
    cfg = known_config(name_or_cfg)
    name = name_or_cfg if isinstance(name_or_cfg, str) else ""
    return build_qwen3(SyntheticSource(name, seed, std, norm_std), cfg, max_seq_len, taps, dtype, device)


def synthetic_eagle3(target: Qwen3, seed: int = 0, max_seq_len: int | None = None,
                     rope_theta: float | None = None, std: float = INIT_STD, norm_std: float = 0.0) -> eagle3.Eagle3:
    """An EAGLE3 head in the shape AngelSlim publishes for ``target`` (config.synthetic_eagle3_config),
    sharing the target's embedding, dtype and device. The target must carry the default taps."""
    if target.taps != tuple(sorted(target.cfg.default_tap_layers)):
        raise CompileError(f"a synthetic EAGLE3 head reads the target's default taps "
                           f"{list(target.cfg.default_tap_layers)}, but the target has taps {list(target.taps)}")
    return build_eagle3(SyntheticSource("", seed, std, norm_std), synthetic_eagle3_config(target.cfg), target,
                        max_seq_len or target.max_seq_len, rope_theta)
