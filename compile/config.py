"""Model configs: frozen dataclasses for Qwen3 targets (every dense size, YaRN included) and EAGLE3 heads, and
the models xcompile knows by name. hf_config.py (head_config.py: EAGLE3 heads) reads them from HF ``config.json`` files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM",)
# EAGLE3 head configs by layout: AngelSlim / vLLM name (Eagle3LlamaForCausalLM), SGLang / SpecForge name
# (LlamaForCausalLMEagle3), SafeAILab/EAGLE's training config (plain LlamaForCausalLM + draft_vocab_size,
# eagle/traineagle3/config.json) and vllm-project/speculators' nested format (Eagle3Speculator).
EAGLE3_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
EAGLE_REPO_ARCHITECTURE = "LlamaForCausalLM"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
HEAD_ARCHITECTURES = (*EAGLE3_ARCHITECTURES, EAGLE_REPO_ARCHITECTURE, SPECULATORS_ARCHITECTURE)



@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (``rope_type: "yarn"``), the fields transformers' ``_compute_yarn_parameters``
    (modeling_rope_utils.py) reads, with its defaults. Qwen3's model card turns it on for 131,072-token contexts
    with factor 4 over the 32,768 positions it was trained on (docs/design.md, "RoPE and YaRN")."""

    factor: float                               # how many times the trained context is stretched
    original_max_position_embeddings: int       # the trained context (positions before scaling)
    beta_fast: float = 32.0                     # rotations past which a dimension keeps its frequency
    beta_slow: float = 1.0                      # rotations below which a dimension is fully interpolated
    mscale: float | None = None                 # attention factor = mscale(factor, mscale) / mscale(factor,
    mscale_all_dim: float | None = None         #   mscale_all_dim) when both are set (DeepSeek style)
    attention_factor: float | None = None       # cos/sin multiplier; None: 0.1 ln(factor) + 1 (YaRN eq. 21)
    truncate: bool = True                       # round the correction range to whole dimensions

    @property
    def positions(self) -> int:
        """Positions the scaled RoPE covers: factor x the trained context."""
        return int(self.factor * self.original_max_position_embeddings)

    def to_hf(self) -> dict:
        """The ``rope_scaling`` dict of a config.json (unset fields left out)."""
        return {"rope_type": "yarn", **{k: v for k, v in asdict(self).items() if v is not None}}


QWEN3_TRAINED_CONTEXT = 32768     # the positions Qwen3 was trained on, which its model card's YaRN stretches


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
    rope_scaling: Yarn | None = None            # None: plain RoPE

    @property
    def context_length(self) -> int:
        """Positions the model's RoPE covers: max_position_embeddings, or YaRN's factor x its trained context
        when that is longer (Qwen3's config.json keeps 40960 with YaRN on; the model card gives 131072)."""
        return max(self.max_position_embeddings, self.rope_scaling.positions if self.rope_scaling else 0)

    @property
    def context_source(self) -> str:
        """Where context_length comes from, for errors."""
        y = self.rope_scaling
        if y is not None and y.positions > self.max_position_embeddings:
            return (f"{y.positions} positions (YaRN factor {y.factor:g} x original_max_position_embeddings "
                    f"{y.original_max_position_embeddings})")
        return f"max_position_embeddings {self.max_position_embeddings}"

    @property
    def default_tap_layers(self) -> tuple[int, int, int]:
        """EAGLE3 taps as 0-based *output-of-layer* ids: layers 1, L/2-1, L-4 (HF hidden_states
        indices 2, L/2, L-3; [1, 17, 32] for Qwen3-8B). See docs/eagle3.md §1.2."""
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
    tap_field: str | None = None                # the TAP_FIELDS key tap_layers were read from
    layout: str = "midlayer"                    # checkpoint prefix of the decoder layer: "midlayer" or "layers.0"
    # residual = hidden_norm(hidden) instead of the un-normed hidden (speculators / vLLM llama_eagle3.py)
    norm_before_residual: bool = False
    rope_scaling: Yarn | None = None            # the head's own config decides, as in vLLM; None: plain RoPE

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
    mtp_path: Path | None = None            # its packaged MTP module (compile/models/mtp.py)


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
    "demo": KnownModel(None, path=DEMO_DIR / "target", eagle3_path=DEMO_DIR / "eagle3", draft_path=DEMO_DIR / "draft",
                       mtp_path=DEMO_DIR / "mtp"),
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
