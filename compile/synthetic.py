"""Seeded random weights in the shape of a real config, for runs without a downloaded checkpoint.

Each tensor is drawn from a generator seeded by (seed, tensor name), so ``synthetic_state`` can
stream one tensor at a time onto a meta-device model (an 8B model does not fit twice in 24 GB of
RAM) and still give the same weights as a fully built ``synthetic_qwen3``.

Init: projections and embeddings N(0, std) with std 0.02 (HF ``initializer_range`` of Qwen3), RMSNorm
weights 1, so residual activations stay O(1..100) and finite in bf16. An EAGLE3 head's d2t is a
valid offset table: sorted distinct target ids minus arange (eagle3_semantics.md §2).

An engine dir exported from synthetic weights records each model's source as
``synthetic:<name>:<seed>`` (``source``/``parse_source``): the target draws from the request's seed,
its EAGLE3 head from seed + 1 and the draft model from seed + 2 (``SEED_OFFSETS``), so the torch
backend and ``xcompile diff`` rebuild the very weights the graphs hold.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
from torch import nn

from xcompile.compile.checkpoint import materialize, module_state
from xcompile.compile.config import KNOWN_MODELS, Qwen3Config, synthetic_eagle3_config
from xcompile.compile.errors import CompileError
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.layers import RMSNorm
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.runtime.contract import DRAFT, EAGLE3, TARGET

INIT_STD = 0.02     # Qwen3 config.json initializer_range
SOURCE_PREFIX = "synthetic:"
SEED_OFFSETS = {TARGET: 0, EAGLE3: 1, DRAFT: 2}


def source(name: str, seed: int, role: str = TARGET) -> str:
    """The manifest source (``ModelEntry.source``) of ``role``'s weights in a dir made with ``seed``."""
    return f"{SOURCE_PREFIX}{name}:{seed + SEED_OFFSETS[role]}"


def parse_source(entry_source: str) -> tuple[str, int] | None:
    """(name, seed) of a ``synthetic:<name>:<seed>`` source; None for a checkpoint dir."""
    if not entry_source.startswith(SOURCE_PREFIX):
        return None
    name, _, seed = entry_source.removeprefix(SOURCE_PREFIX).rpartition(":")
    return name, int(seed)


def _generator(seed: int, name: str) -> torch.Generator:
    # crc32, not hash(): Python salts str hashes per process
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def draft_ids(seed: int, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The target ids an EAGLE3 draft vocabulary covers: sorted, distinct, [draft_vocab] int64."""
    return torch.randperm(vocab_size, generator=_generator(seed, "d2t"))[:draft_vocab_size].sort().values


def synthetic_tensor(model: nn.Module, name: str, like: torch.Tensor, seed: int, std: float = INIT_STD,
                     norm_std: float = 0.0) -> torch.Tensor:
    """The synthetic value of one state tensor of ``model`` (a Qwen3 or an Eagle3), on the CPU."""
    owner = model.get_submodule(name.rpartition(".")[0])
    g = _generator(seed, name)
    if isinstance(model, Eagle3) and name in ("d2t", "t2d"):
        ids = draft_ids(seed, model.cfg.vocab_size, model.cfg.draft_vocab_size)
        if name == "d2t":
            return ids - torch.arange(ids.shape[0])
        t2d = torch.zeros(model.cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return t2d
    if isinstance(owner, RMSNorm):
        return (1.0 + norm_std * torch.randn(like.shape, generator=g)).to(like.dtype)
    return (std * torch.randn(like.shape, generator=g)).to(like.dtype)


def synthetic_state(model: nn.Module, seed: int = 0, std: float = INIT_STD, norm_std: float = 0.0
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (state name, tensor) for ``model`` (may live on the meta device), in its dtype.
    Like ``checkpoint.iter_state``: an EAGLE3 head's ``embed_tokens.weight`` is the target's and
    is not yielded."""
    for name, like in module_state(model).items():
        if isinstance(model, Eagle3) and name == "embed_tokens.weight":
            continue
        yield name, synthetic_tensor(model, name, like, seed, std, norm_std)


def known_config(name_or_cfg: str | Qwen3Config) -> Qwen3Config:
    """The config of a KNOWN_MODELS alias (a config is returned as is); CompileError naming the known ones."""
    if isinstance(name_or_cfg, Qwen3Config):
        return name_or_cfg
    known = KNOWN_MODELS.get(name_or_cfg.lower())
    if known is None:
        raise CompileError(f"unknown model {name_or_cfg!r} for synthetic weights; known: {', '.join(KNOWN_MODELS)}")
    return known.config


def synthetic_qwen3(name_or_cfg: str | Qwen3Config, max_seq_len: int, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                    taps: tuple[int, ...] | None = None, std: float = INIT_STD, norm_std: float = 0.0) -> Qwen3:
    """A Qwen3 with seeded random weights in the shape of a KNOWN_MODELS alias (or a config)."""
    cfg = known_config(name_or_cfg)
    with torch.device("meta"):
        model = Qwen3(cfg, max_seq_len, taps).to(dtype)
    return materialize(model, synthetic_state(model, seed, std, norm_std), dtype, device)


def synthetic_eagle3(target: Qwen3, seed: int = 0, max_seq_len: int | None = None,
                     rope_theta: float | None = None, std: float = INIT_STD, norm_std: float = 0.0) -> Eagle3:
    """An EAGLE3 head in the shape AngelSlim publishes for ``target`` (config.synthetic_eagle3_config),
    sharing the target's embedding, dtype and device. The target must carry the default taps."""
    if target.taps != tuple(sorted(target.cfg.default_tap_layers)):
        raise CompileError(f"a synthetic EAGLE3 head reads the target's default taps "
                           f"{list(target.cfg.default_tap_layers)}, but the target has taps {list(target.taps)}")
    embed = target.model.embed_tokens.weight
    cfg = synthetic_eagle3_config(target.cfg)
    with torch.device("meta"):
        head = Eagle3(cfg, max_seq_len or target.max_seq_len, rope_theta).to(embed.dtype)
    head.embed_tokens.weight = embed
    return materialize(head, synthetic_state(head, seed, std, norm_std), embed.dtype, embed.device)
