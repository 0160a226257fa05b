"""Model configs: frozen dataclasses parsed from HF ``config.json`` files.

Qwen3 targets of every dense size and EAGLE3 heads as published for Qwen3 (AngelSlim, SpecForge).
Every error names the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xcompile.compile.errors import CompileError

QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM",)
EAGLE3_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @property
    def default_tap_layers(self) -> tuple[int, int, int]:
        """EAGLE3 taps as 0-based *output-of-layer* ids: layers 1, L/2-1, L-4 (HF hidden_states
        indices 2, L/2, L-3; [1, 17, 32] for Qwen3-8B). See reference/eagle3_semantics.md §1.2."""
        n = self.num_hidden_layers
        return (1, n // 2 - 1, n - 4) if n >= 5 else (0, n // 2, n - 1)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Eagle3Config:
    """One-layer Llama-style draft head over the target's three tapped hidden states."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                 # target vocabulary (the embedding table is the target's)
    draft_vocab_size: int
    target_hidden_size: int         # width of one tap; the fc input is 3x this
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tap_layers: tuple[int, ...] | None = None   # output-of-layer ids from the config, None = target default
    architecture: str = EAGLE3_ARCHITECTURES[0]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KnownModel:
    """One model alias: a Hugging Face repo (with its published config, for --synthetic stand-ins, and
    its published EAGLE3 head), or a checkpoint shipped inside the package (``path``, package data)."""

    repo_id: str | None
    config: Qwen3Config | None = None
    eagle3_repo_id: str | None = None
    path: Path | None = None                # packaged checkpoint dir
    eagle3_path: Path | None = None         # its packaged EAGLE3 head
    draft_path: Path | None = None          # its packaged small draft model


def _q(vocab, hidden, inter, layers, heads, kv, tie) -> Qwen3Config:
    return Qwen3Config(vocab, hidden, inter, layers, heads, kv, 128, tie_word_embeddings=tie)


# The demo pair trained by scripts/train_demo.py (compile/demo/README.md): a 7M-param Qwen3 on
# CPython's documentation, its EAGLE3 head and a 1.2M-param draft model on its tokenizer, so every
# command runs offline from a fresh clone.
DEMO_DIR = Path(__file__).parent / "demo"

# Every alias, one table (as gpt-fast's transformer_configs): the packaged demo, then the published
# dense Qwen3 configs (Qwen/Qwen3-*/config.json) with their published EAGLE3 heads (AngelSlim model
# cards). Resolution (checkpoint/resolution.py) and --synthetic stand-ins read it.
KNOWN_MODELS: dict[str, KnownModel] = {
    "demo": KnownModel(None, path=DEMO_DIR / "target", eagle3_path=DEMO_DIR / "eagle3", draft_path=DEMO_DIR / "draft"),
    "qwen3-0.6b": KnownModel("Qwen/Qwen3-0.6B", _q(151936, 1024, 3072, 28, 16, 8, True)),
    "qwen3-1.7b": KnownModel("Qwen/Qwen3-1.7B", _q(151936, 2048, 6144, 28, 16, 8, True), "AngelSlim/Qwen3-1.7B_eagle3"),
    "qwen3-4b": KnownModel("Qwen/Qwen3-4B", _q(151936, 2560, 9728, 36, 32, 8, True), "AngelSlim/Qwen3-4B_eagle3"),
    "qwen3-8b": KnownModel("Qwen/Qwen3-8B", _q(151936, 4096, 12288, 36, 32, 8, False), "AngelSlim/Qwen3-8B_eagle3"),
    "qwen3-14b": KnownModel("Qwen/Qwen3-14B", _q(151936, 5120, 17408, 40, 40, 8, False), "AngelSlim/Qwen3-14B_eagle3"),
    "qwen3-32b": KnownModel("Qwen/Qwen3-32B", _q(151936, 5120, 25600, 64, 64, 8, False), "AngelSlim/Qwen3-32B_eagle3"),
}

# AngelSlim heads: 32000-token draft vocabulary, one layer of the target's attention shape.
EAGLE3_DRAFT_VOCAB = 32000


def synthetic_eagle3_config(target: Qwen3Config) -> Eagle3Config:
    """The EAGLE3 head shape AngelSlim publishes for ``target`` (for --synthetic runs)."""
    return Eagle3Config(
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        vocab_size=target.vocab_size,
        draft_vocab_size=min(EAGLE3_DRAFT_VOCAB, target.vocab_size),   # small test vocabularies
        target_hidden_size=target.hidden_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        max_position_embeddings=target.max_position_embeddings,
    )


# --------------------------------------------------------------------------------------------
# parsing


class _Fields:
    """Typed field access on one config.json, with errors that name the file and the field."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data

    def fail(self, name: str, why: str) -> CompileError:
        return CompileError(f"{self.path}: field '{name}' {why}")

    def get(self, name: str, kind: type, default=None, *, required: bool = False):
        if name not in self.data or self.data[name] is None:
            if required:
                raise self.fail(name, "is missing")
            return default
        value = self.data[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise self.fail(name, f"should be {kind.__name__}, got {value!r}")
        if kind in (int, float) and value <= 0 and name not in ("rms_norm_eps",):
            raise self.fail(name, f"should be positive, got {value!r}")
        return value

    def rope_theta(self, default: float) -> float:
        # transformers 5 writes rope_theta under rope_parameters; published checkpoints at top level
        params = self.data.get("rope_parameters")
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            return _Fields(self.path, params).get("rope_theta", float, default)
        return self.get("rope_theta", float, default)

    def rope_scaling_is_plain(self) -> None:
        for key in ("rope_scaling", "rope_parameters"):
            value = self.data.get(key)
            if isinstance(value, dict) and value.get("rope_type", value.get("type", "default")) != "default":
                raise self.fail(key, f"asks for RoPE scaling {value!r}, which xcompile does not support yet")


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
                           f"{QWEN3_ARCHITECTURES + EAGLE3_ARCHITECTURES}")
    return archs[0]


def parse_qwen3(path: Path, data: dict | None = None) -> Qwen3Config:
    path = Path(path)
    data = read_json(path) if data is None else data
    arch = architecture(path, data)
    if arch not in QWEN3_ARCHITECTURES:
        raise CompileError(f"{path}: field 'architectures' is {arch!r}; xcompile compiles dense Qwen3 "
                           f"targets ({', '.join(QWEN3_ARCHITECTURES)})")
    f = _Fields(path, data)
    f.rope_scaling_is_plain()
    hidden = f.get("hidden_size", int, required=True)
    heads = f.get("num_attention_heads", int, required=True)
    kv = f.get("num_key_value_heads", int, heads)
    if heads % kv:
        raise f.fail("num_key_value_heads", f"({kv}) must divide num_attention_heads ({heads})")
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
    )


def parse_eagle3(path: Path, data: dict | None = None) -> Eagle3Config:
    path = Path(path)
    data = read_json(path) if data is None else data
    arch = architecture(path, data)
    if arch not in EAGLE3_ARCHITECTURES:
        raise CompileError(f"{path}: field 'architectures' is {arch!r}; an EAGLE3 head is one of "
                           f"{', '.join(EAGLE3_ARCHITECTURES)}")
    f = _Fields(path, data)
    f.rope_scaling_is_plain()
    if f.get("num_hidden_layers", int, 1) != 1:
        raise f.fail("num_hidden_layers", "must be 1 for an EAGLE3 head")
    hidden = f.get("hidden_size", int, required=True)
    heads = f.get("num_attention_heads", int, required=True)
    vocab = f.get("vocab_size", int, required=True)
    # tap ids: top level or under eagle_config; read as 0-based output-of-layer ids (SpecForge/sglang)
    eagle = data.get("eagle_config") if isinstance(data.get("eagle_config"), dict) else {}
    taps = data.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
    if taps is not None:
        if not (isinstance(taps, list) and len(taps) == 3 and all(isinstance(t, int) and t >= 0 for t in taps)):
            raise f.fail("eagle_aux_hidden_state_layer_ids", f"should be three layer ids, got {taps!r}")
        taps = tuple(taps)
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=f.get("intermediate_size", int, required=True),
        num_attention_heads=heads,
        num_key_value_heads=f.get("num_key_value_heads", int, heads),
        head_dim=f.get("head_dim", int, hidden // heads),
        vocab_size=vocab,
        draft_vocab_size=f.get("draft_vocab_size", int, vocab),
        target_hidden_size=f.get("target_hidden_size", int, hidden),
        rms_norm_eps=f.get("rms_norm_eps", float, 1e-6),
        rope_theta=f.rope_theta(10_000.0),
        max_position_embeddings=f.get("max_position_embeddings", int, 40960),
        tap_layers=taps,
        architecture=arch,
    )


def check_eagle3_fits(head: Eagle3Config, target: Qwen3Config, head_path: Path, taps: tuple[int, ...]) -> None:
    """A head that does not fit its target is a one-line error naming the head's config."""
    if head.target_hidden_size != target.hidden_size:
        raise CompileError(f"{head_path}: target_hidden_size/hidden_size {head.target_hidden_size} does not match "
                           f"the target's hidden_size {target.hidden_size}; pass the head trained for this target")
    if head.hidden_size != target.hidden_size:
        raise CompileError(f"{head_path}: hidden_size {head.hidden_size} differs from the target's "
                           f"{target.hidden_size}; the head shares the target's embedding table, so they must match")
    if head.vocab_size != target.vocab_size:
        raise CompileError(f"{head_path}: vocab_size {head.vocab_size} differs from the target's {target.vocab_size}; "
                           "the head was trained for another tokenizer")
    if any(t >= target.num_hidden_layers for t in taps):
        raise CompileError(f"{head_path}: tap layers {list(taps)} exceed the target's {target.num_hidden_layers} layers")


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
