"""Model families by the manifest's ``ModelEntry.kind``: one registry instead of ``isinstance`` switches.

A family knows how its config is read (``config.json`` at export, the manifest's fields afterwards)
and how its module is built from a ``WeightSource``. Everything else a family decides lives on its
module class (compile/models/): the weight key map (``key_map``), the contract graphs it runs as
(``graphs``, ``graph_spec``, ``graph_dims``) and its KV geometry (``kv_shape``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from xcompile.compile.checkpoint import build_eagle3, build_mtp, build_qwen3
from xcompile.compile.checkpoint.source import WeightSource
from xcompile.compile.config import Eagle3Config, Qwen3Config, Yarn
from xcompile.compile.errors import CompileError
from xcompile.compile.head_config import parse_eagle3
from xcompile.compile.hf_config import parse_qwen3
from xcompile.compile.models import eagle3, mtp, qwen3

# (source, config, max_seq_len, dtype, device, target module or None, manifest extra) -> module
Loader = Callable[[WeightSource, object, int, torch.dtype, torch.device | str, nn.Module | None, dict], nn.Module]


@dataclass(frozen=True)
class Family:
    kind: str
    config_type: type
    parse: Callable[[Path], object]         # config.json -> frozen config
    load: Loader

    def config_from(self, fields: dict, where: str) -> object:
        """The config recorded in a manifest (``ModelEntry.config``), JSON lists back to tuples."""
        names = {f.name for f in dataclasses.fields(self.config_type)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise CompileError(f"{where}: config field '{unknown[0]}' is not a {self.kind} config field; the manifest "
                               "was written by another xcompile version: re-export")
        try:
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
            if isinstance(values.get("rope_scaling"), dict):       # a nested frozen config (Yarn), as to_dict wrote it
                values["rope_scaling"] = Yarn(**values["rope_scaling"])
            return self.config_type(**values)
        except TypeError as e:
            raise CompileError(f"{where}: {self.kind} config is incomplete ({e}); re-export") from None


def _load_qwen3(source, cfg, max_seq_len, dtype, device, target, extra) -> nn.Module:
    return build_qwen3(source, cfg, max_seq_len, tuple(extra.get("taps") or ()) or None, dtype, device)


def _load_eagle3(source, cfg, max_seq_len, dtype, device, target, extra) -> nn.Module:
    if target is None:
        raise CompileError("an EAGLE3 head needs its target model (it embeds with the target's table)")
    return build_eagle3(source, cfg, target, max_seq_len, extra.get("rope_theta"))


def _load_mtp(source, cfg, max_seq_len, dtype, device, target, extra) -> nn.Module:
    if target is None:
        raise CompileError("an MTP module needs its target model (it shares the target's embedding and lm_head)")
    return build_mtp(source, cfg, target, max_seq_len, extra.get("draft_vocab"))


FAMILIES: dict[str, Family] = {f.kind: f for f in (
    Family(qwen3.KIND, Qwen3Config, parse_qwen3, _load_qwen3),
    Family(eagle3.KIND, Eagle3Config, parse_eagle3, _load_eagle3),
    Family(mtp.KIND, Qwen3Config, mtp.parse_mtp, _load_mtp),
)}


def family(kind: str, where: str = "manifest.json") -> Family:
    """The family of a manifest's model ``kind``; CompileError naming the known kinds."""
    if kind not in FAMILIES:
        raise CompileError(f"{where}: model kind {kind!r} is unknown; xcompile knows {', '.join(FAMILIES)}")
    return FAMILIES[kind]
