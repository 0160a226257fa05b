"""Checkpoints: find them, read them lazily, load them strictly.

    resolution.py   local dir, alias (config.KNOWN_MODELS) or HF cache -> a checkpoint dir; offline
    files.py        the dir's weight files (safetensors, sharded or not; pytorch_model.bin), read lazily
    keymap.py       a module's state checked against a key map, then filled tensor by tensor
    source.py       WeightSource: one model's weights (checkpoint or synthetic): files, hashes, tensors

The key maps live with the model families (``Qwen3.key_map``, ``Eagle3.key_map``). This module builds
modules from a ``WeightSource`` (``build``) and loads the checkpoint dirs of targets, draft models,
EAGLE3 heads and MTP modules.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from xcompile.compile.checkpoint.files import Checkpoint
from xcompile.compile.checkpoint.keymap import materialize, module_state
from xcompile.compile.checkpoint.resolution import resolve, resolve_draft, resolve_eagle3, resolve_mtp
from xcompile.compile.checkpoint.source import CheckpointSource, WeightSource
from xcompile.compile.config import DEMO_DIR, Eagle3Config, Qwen3Config
from xcompile.compile.errors import CompileError
from xcompile.compile.head_config import check_eagle3_fits, parse_eagle3
from xcompile.compile.hf_config import parse_qwen3, read_json
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.mtp import MTP, check_mtp_fits, draft_vocab_size, parse_mtp
from xcompile.compile.models.qwen3 import Qwen3

__all__ = [
    "DEMO_DIR", "Checkpoint", "CheckpointSource", "WeightSource", "build", "build_eagle3", "build_mtp", "build_qwen3",
    "load_draft_model", "load_eagle3", "load_mtp", "load_qwen3", "materialize", "module_state", "mtp_draft_vocab",
    "resolve",
    "resolve_draft", "resolve_eagle3", "resolve_mtp", "tap_layers",
]


def build(meta: nn.Module, source: WeightSource, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Fill ``meta`` (a module on the meta device) from ``source``, tensor by tensor, on ``device`` (each read,
    cast and checked there)."""
    return materialize(meta, source.tensors(meta, device=device), dtype, device)


def tap_layers(head_cfg: Eagle3Config, target_cfg: Qwen3Config) -> tuple[int, ...]:
    """The head's tap ids (0-based output-of-layer) from its config, else the target's defaults."""
    return head_cfg.tap_layers if head_cfg.tap_layers is not None else target_cfg.default_tap_layers


def build_qwen3(source: WeightSource, cfg: Qwen3Config, max_seq_len: int, taps: tuple[int, ...] | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Qwen3:
    """A Qwen3 (with EAGLE3 taps if given) of config ``cfg`` from ``source``."""
    with torch.device("meta"):
        model = Qwen3(cfg, max_seq_len, taps).to(dtype)     # free on meta; tensors are then read as dtype
    return build(model, source, dtype, device)


def build_eagle3(source: WeightSource, cfg: Eagle3Config, target: Qwen3, max_seq_len: int,
                 rope_theta: float | None = None) -> Eagle3:
    """An EAGLE3 head of config ``cfg`` from ``source``, sharing the target's embedding tensor (so in
    the target's dtype and on its device). ``rope_theta`` overrides the config's θ (docs/eagle3.md §6.3)."""
    embed = target.model.embed_tokens.weight
    with torch.device("meta"):
        head = Eagle3(cfg, max_seq_len, rope_theta).to(embed.dtype)
    head.embed_tokens.weight = embed                # shared, not copied: external in the key map
    return build(head, source, embed.dtype, embed.device)


def build_mtp(source: WeightSource, cfg: Qwen3Config, target: Qwen3, max_seq_len: int,
              draft_vocab: int | None = None) -> MTP:
    """An MTP module of config ``cfg`` from ``source``, sharing the target's embedding and lm_head tensors (so in
    the target's dtype and on its device); with ``draft_vocab``, its head is a copy of the lm_head rows its
    d2t names."""
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    with torch.device("meta"):
        module = MTP(cfg, max_seq_len, tied=target.cfg.tie_word_embeddings, draft_vocab=draft_vocab).to(embed.dtype)
    module.embed_tokens.weight = embed              # shared, not copied: external in the key map
    if draft_vocab:                                  # filled once d2t is read
        module.shared_head.head.weight = nn.Parameter(torch.empty(draft_vocab, head.shape[1], dtype=head.dtype,
                                                                  device=head.device), requires_grad=False)
    else:
        module.shared_head.head.weight = head       # the target's (its embedding when tied)
    module = build(module, source, embed.dtype, embed.device)
    if draft_vocab:
        module.gather_head(head)
    return module


def load_qwen3(path: Path, max_seq_len: int, taps: tuple[int, ...] | None = None,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Qwen3:
    """A Qwen3 target (with EAGLE3 taps if given) from a checkpoint dir, strictly."""
    path = Path(path)
    cfg = parse_qwen3(path / "config.json")
    if taps and not all(0 <= t < cfg.num_hidden_layers for t in taps):
        raise CompileError(f"{path / 'config.json'}: tap layers {list(taps)} outside the model's "
                           f"{cfg.num_hidden_layers} layers")
    return build_qwen3(CheckpointSource(path), cfg, max_seq_len, taps, dtype, device)


def load_draft_model(path: Path, target_cfg: Qwen3Config, max_seq_len: int, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> Qwen3:
    """A small draft Qwen3; it proposes target token ids, so it must share the target's vocabulary."""
    path = Path(path)
    cfg = parse_qwen3(path / "config.json")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise CompileError(f"{path / 'config.json'}: vocab_size {cfg.vocab_size} differs from the target's "
                           f"{target_cfg.vocab_size}; a draft model must share the target's tokenizer "
                           "(e.g. Qwen3-0.6B for Qwen3-8B)")
    return load_qwen3(path, max_seq_len, None, dtype, device)


def load_eagle3(path: Path, target: Qwen3, max_seq_len: int, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None, rope_theta: float | None = None) -> Eagle3:
    """An EAGLE3 head for ``target``, sharing its embedding tensor (so by default in the target's
    dtype and on its device). ``rope_theta`` overrides the config's θ (docs/eagle3.md §6.3)."""
    path = Path(path)
    config = path / "config.json"
    cfg = parse_eagle3(config)
    taps = tap_layers(cfg, target.cfg)
    check_eagle3_fits(cfg, target.cfg, config, taps)
    if tuple(sorted(taps)) != target.taps:
        raise CompileError(f"{config}: the head reads target layers {list(taps)}, but the target was built with "
                           f"taps {list(target.taps)}; load the target with taps=tap_layers(head_cfg, target_cfg)")
    embed = target.model.embed_tokens.weight
    dtype = dtype or embed.dtype
    device = torch.device(device) if device is not None else embed.device
    if dtype != embed.dtype or device.type != embed.device.type or device.index not in (None, embed.device.index):
        raise CompileError(f"{config}: the head shares the target's embedding ({embed.dtype} on {embed.device}); "
                           f"load it with that dtype and device, not {dtype} on {device}")
    return build_eagle3(CheckpointSource(path), cfg, target, max_seq_len, rope_theta)


def load_mtp(path: Path, target: Qwen3, max_seq_len: int) -> MTP:
    """An MTP module for ``target`` from a checkpoint dir (what ``xcompile train-mtp`` writes), sharing the target's
    embedding and lm_head (so in its dtype and on its device)."""
    config = Path(path) / "config.json"
    cfg = parse_mtp(config)
    check_mtp_fits(cfg, target.cfg, str(config))
    source = CheckpointSource(Path(path))
    return build_mtp(source, cfg, target, max_seq_len, mtp_draft_vocab(source, cfg))


def mtp_draft_vocab(source: CheckpointSource, cfg: Qwen3Config) -> int | None:
    """An MTP checkpoint's draft vocabulary: config.json's ``draft_vocab_size`` (None: none), which must agree
    with whether the weights hold the map ``d2t``."""
    config = source.path / "config.json"
    size = draft_vocab_size(config, read_json(config), cfg.vocab_size)
    ckpt = source.checkpoint
    if size and "d2t" not in ckpt:
        raise CompileError(f"{config}: field 'draft_vocab_size' is {size}, but the module's weights hold no tensor "
                           "'d2t' (the draft vocabulary's map); remove the field, or train the module with "
                           "`xcompile train-mtp --draft-vocab N`")
    if not size and "d2t" in ckpt:
        raise CompileError(f"{config}: no field 'draft_vocab_size', but {ckpt.file('d2t').name} holds a draft "
                           f"vocabulary map 'd2t' of {ckpt.shape('d2t')[0]} tokens; add \"draft_vocab_size\": "
                           f"{ckpt.shape('d2t')[0]} to the config")
    return size
