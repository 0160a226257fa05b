"""HF ``config.json`` files into config.py's dataclasses: Qwen3 targets (and draft models), their RoPE scaling, and
generation configs; ``Fields``, the typed reader every config parser here and in head_config.py (EAGLE3 heads)
shares. Every error names the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from xcompile.compile.config import HEAD_ARCHITECTURES, QWEN3_ARCHITECTURES, Qwen3Config, Yarn
from xcompile.compile.errors import CompileError

# fields whose null transformers would not read as a default (a missing one is: our default), so that a null
# would silently become another model: refused. Others (head_dim, num_key_value_heads, ...) derive as transformers does.
_NOT_NULL = {"rope_theta", "rms_norm_eps", "max_position_embeddings"}


class Fields:
    """Typed field access on one config.json, with errors that name the file and the field."""

    def __init__(self, path: Path, data: dict, prefix: str = ""):
        self.path, self.data, self.prefix = path, data, prefix

    def fail(self, name: str, why: str) -> CompileError:
        return CompileError(f"{self.path}: field '{self.prefix}{name}' {why}")

    def get(self, name: str, kind: type, default=None, *, required: bool = False):
        if name in _NOT_NULL and name in self.data and self.data[name] is None:
            raise self.fail(name, f"is null; give its value, or remove the field to take the default ({default})")
        if name not in self.data or self.data[name] is None:
            if required:
                raise self.fail(name, "is missing")
            return default
        value = self.data[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise self.fail(name, f"should be {kind.__name__}, got {value!r}")
        zero_ok = name == "rms_norm_eps"                        # 0 allowed, below it not
        if kind is float and not math.isfinite(value) or zero_ok and value < 0:     # json reads Infinity and NaN
            raise self.fail(name, f"should be a finite number{' >= 0' if zero_ok else ''}, got {value!r}")
        if kind in (int, float) and value <= 0 and not zero_ok:
            raise self.fail(name, f"should be positive, got {value!r}")
        return value

    def rope_theta(self, default: float) -> float:
        # transformers 5 writes rope_theta under rope_parameters; published checkpoints at top level
        params = self.data.get("rope_parameters")
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            return Fields(self.path, params, f"{self.prefix}rope_parameters.").get("rope_theta", float, default)
        return self.get("rope_theta", float, default)

    def rope_scaling(self) -> Yarn | None:
        """The RoPE scaling of ``rope_scaling`` (published checkpoints) or, without it, transformers 5's
        ``rope_parameters``, as transformers reads them (PreTrainedConfig.convert_rope_params_to_dict: a
        ``rope_scaling`` dict replaces ``rope_parameters``). None for plain RoPE; YaRN parsed with
        ``_compute_yarn_parameters``'s defaults; any other ``rope_type`` or field is refused naming it."""
        key = "rope_scaling" if self.data.get("rope_scaling") else "rope_parameters"
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(key, f"should be an object, got {value!r}")
        f = Fields(self.path, value, f"{self.prefix}{key}.")
        kind = value.get("rope_type", value.get("type", "default"))
        name = "rope_type" if "rope_type" in value else "type"
        if kind == "default":
            return None
        if kind != "yarn":
            raise f.fail(name, f"is {kind!r}; xcompile computes RoPE 'default' and 'yarn' (Qwen3's long-context "
                         "scaling) only: use a config without it or with YaRN")
        unknown = sorted(set(value) - _YARN_KEYS)
        if unknown:
            raise f.fail(unknown[0], f"is {value[unknown[0]]!r}, not a YaRN field xcompile computes "
                         f"({', '.join(sorted(_YARN_KEYS))}); remove it")
        if value.get("partial_rotary_factor", 1.0) != 1.0:
            raise f.fail("partial_rotary_factor", f"is {value['partial_rotary_factor']!r}; xcompile rotates the "
                         "whole head (1.0)")
        # transformers (standardize_rope_params): a top-level original_max_position_embeddings wins over the
        # dict's (Phi3 style), and without either the trained context is max_position_embeddings
        original = self.get("original_max_position_embeddings", int) or \
            f.get("original_max_position_embeddings", int) or self.get("max_position_embeddings", int, 40960)
        # a missing factor is the ratio of the two lengths (transformers' DeepSeek-V3 note)
        factor = f.get("factor", float) or self.get("max_position_embeddings", int, 40960) / original
        if factor * original > MAX_POSITIONS:
            raise f.fail("factor", f"is {factor:g}: {factor:g} x {original} trained positions passes the "
                         f"{MAX_POSITIONS:,} xcompile takes")
        if factor < 1:                               # transformers' _validate_yarn_rope_parameters warns of both
            raise f.fail("factor", f"is {factor:g}; YaRN stretches RoPE, so it must be at least 1")
        beta_fast, beta_slow = f.get("beta_fast", float, 32.0), f.get("beta_slow", float, 1.0)
        if beta_fast < beta_slow:
            raise f.fail("beta_fast", f"is {beta_fast:g}, below beta_slow {beta_slow:g}; YaRN needs beta_fast >= "
                         "beta_slow (Qwen3: 32 and 1)")
        return Yarn(
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=beta_fast,
            beta_slow=beta_slow,
            mscale=f.number("mscale"),
            mscale_all_dim=f.number("mscale_all_dim"),
            attention_factor=f.get("attention_factor", float),
            truncate=f.get("truncate", bool, True),
        )

    def number(self, name: str) -> float | None:
        """An optional float that may be 0 (YaRN's mscale fields: 0 means unset, as transformers reads them)."""
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
            raise self.fail(name, f"should be a finite number >= 0, got {value!r}")
        return float(value)


# the most positions a scaled RoPE may cover: 2^24 tokens, far past any KV cache one GPU holds (the 8B shape's
# at 2^24 tokens: 2.5 TB in bf16)
MAX_POSITIONS = 1 << 24

# rope_scaling / rope_parameters keys of a YaRN config (transformers' _validate_yarn_rope_parameters), plus the
# keys every rope dict may carry
_YARN_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


def read_json(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CompileError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CompileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CompileError(f"{path}: expected a JSON object")
    return data


def architecture(path: Path, data: dict) -> str:
    archs = data.get("architectures") or []
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise CompileError(f"{path}: field 'architectures' is missing; expected one of "
                           f"{QWEN3_ARCHITECTURES + HEAD_ARCHITECTURES}")
    return archs[0]


def _refuse_variants(f: Fields, data: dict) -> None:
    """What a Qwen3 config may set that the graphs do not compute, refused rather than ignored: another MLP
    activation, sliding-window layers (transformers makes layers at or past max_window_layers sliding when
    use_sliding_window is true, or as layer_types lists them). (An RMSNorm eps that is negative or not finite:
    Fields.get, for every config.)"""
    if data.get("hidden_act", "silu") != "silu":
        raise f.fail("hidden_act", f"is {data['hidden_act']!r}; xcompile computes Qwen3's SiLU-gated MLP")
    if data.get("use_sliding_window"):
        raise f.fail("use_sliding_window", "is true; xcompile computes full attention in every layer (Qwen3's "
                                           "published configs leave it false)")
    sliding = [i for i, t in enumerate(data.get("layer_types") or ()) if t != "full_attention"]
    if sliding:
        raise f.fail("layer_types", f"makes layer {sliding[0]} {data['layer_types'][sliding[0]]!r}; xcompile "
                                    "computes full attention in every layer")


def parse_qwen3(path: Path, data: dict | None = None, architectures: tuple[str, ...] = QWEN3_ARCHITECTURES
                ) -> Qwen3Config:
    """A Qwen3 config.json (``architectures``: what its first architecture may be; an MTP module's is its own)."""
    path = Path(path)
    data = read_json(path) if data is None else data
    arch = architecture(path, data)
    if arch not in architectures:
        if architectures == QWEN3_ARCHITECTURES:
            raise CompileError(f"{path}: field 'architectures' is {arch!r}; xcompile compiles dense Qwen3 "
                               f"targets ({', '.join(architectures)})")
        raise CompileError(f"{path}: field 'architectures' is {arch!r}; expected {', '.join(architectures)} (what "
                           "`xcompile train-mtp` writes): pass an MTP module's directory")
    f = Fields(path, data)
    if architectures == QWEN3_ARCHITECTURES and data.get("model_type", "qwen3") != "qwen3":
        raise f.fail("model_type", f"is {data['model_type']!r} beside architectures {arch!r}: transformers would "
                     "build that model type, not Qwen3; fix the config")
    hidden = f.get("hidden_size", int, required=True)
    heads = f.get("num_attention_heads", int, required=True)
    kv = f.get("num_key_value_heads", int, heads)
    if heads % kv:
        raise f.fail("num_key_value_heads", f"({kv}) must divide num_attention_heads ({heads})")
    _refuse_variants(f, data)
    return Qwen3Config(
        vocab_size=f.get("vocab_size", int, required=True),
        hidden_size=hidden,
        intermediate_size=f.get("intermediate_size", int, required=True),
        num_hidden_layers=f.get("num_hidden_layers", int, required=True),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=f.get("head_dim", int, hidden // heads),
        rms_norm_eps=f.get("rms_norm_eps", float, 1e-6),
        rope_theta=f.rope_theta(1_000_000.0),
        max_position_embeddings=f.get("max_position_embeddings", int, 40960),
        tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
        attention_bias=f.get("attention_bias", bool, False),
        rope_scaling=f.rope_scaling(),
    )


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


def parse_generation_config(path: Path, fallback: dict | None = None) -> GenerationConfig:
    """EOS ids from generation_config.json (else config.json's eos_token_id)."""
    path = Path(path)
    data = read_json(path) if path.is_file() else (fallback or {})
    eos = data.get("eos_token_id")
    if eos is None:
        return GenerationConfig()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CompileError(f"{path}: field 'eos_token_id' should be an int or a list of ints, got {eos!r}")
    return GenerationConfig(tuple(ids))
