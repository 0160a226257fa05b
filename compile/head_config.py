"""EAGLE3 head configs in every published layout for Qwen3 (AngelSlim, SafeAILab/EAGLE, SpecForge, speculators):
``parse_eagle3``, where a head's tap ids come from and what they count, and whether a head fits its target. Every
error names the file and the field (hf_config.Fields).
"""

from __future__ import annotations

from pathlib import Path

from xcompile.compile.config import (
    EAGLE3_ARCHITECTURES,
    EAGLE_REPO_ARCHITECTURE,
    HEAD_ARCHITECTURES,
    SPECULATORS_ARCHITECTURE,
    Eagle3Config,
    Qwen3Config,
)
from xcompile.compile.errors import CompileError
from xcompile.compile.hf_config import Fields, architecture, read_json

# Where a head's tap ids come from, and what they count (docs/eagle3.md §1.2):
#   top level   HF hidden_states indices = the input of that layer. vLLM reads the field as is and its
#               targets capture ``hidden_states + residual`` before layer i (gpu_model_runner
#               _get_eagle3_aux_layers_from_config); speculators' default is [2, L//2, L-3]
#               (speculators/models/utils.py resolve_target_layer_ids), i.e. outputs of 1, L/2-1, L-4.
#   eagle_config.*  layer-output ids: SGLang adds 1 before capturing (set_eagle3_layers_to_capture) and
#               SpecForge writes [1, L//2-1, L-4] (algorithms/model_providers.py resolve_eagle_capture_layers).
# value: (subtracted to get xcompile's 0-based layer-output ids, the convention as recorded in the manifest)
TAP_FIELDS = {
    "eagle_aux_hidden_state_layer_ids": (1, "HF hidden_states indices: the input of that layer (vLLM, speculators)"),
    "eagle_config.eagle_aux_hidden_state_layer_ids": (0, "layer-output ids (SGLang adds 1 before capturing; SpecForge)"),
}
TAP_OVERRIDE = "--eagle3-taps"
TAP_DEFAULT = "default"
TAP_CONVENTIONS = {TAP_OVERRIDE: "layer-output ids",
                   TAP_DEFAULT: "layer-output ids: the target's default (Qwen3Config.default_tap_layers)"}

# speculators serializes transformer_layer_config with transformers' to_diff_dict (Eagle3SpeculatorConfig
# .serialize_transformer_config), which may drop fields equal to LlamaConfig's defaults: read a missing
# one as LlamaConfig's default (transformers LlamaConfig.__init__).
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0}


def parse_eagle3(path: Path, data: dict | None = None) -> Eagle3Config:
    """An EAGLE3 head config in any published layout (see HEAD_ARCHITECTURES). Options a layout may set
    that xcompile does not compute are refused naming the field, never ignored."""
    path = Path(path)
    data = read_json(path) if data is None else data
    arch = architecture(path, data)
    if arch == SPECULATORS_ARCHITECTURE or "speculators_model_type" in data:
        return _parse_speculators(path, data, arch)
    f = Fields(path, data)
    if arch not in HEAD_ARCHITECTURES:
        raise f.fail("architectures", f"is {arch!r}; an EAGLE3 head is one of {', '.join(HEAD_ARCHITECTURES)}")
    if arch == EAGLE_REPO_ARCHITECTURE and "draft_vocab_size" not in data:
        raise f.fail("architectures", f"is {arch!r} without 'draft_vocab_size': a plain Llama model, not an EAGLE3 "
                     f"head (SafeAILab/EAGLE heads carry draft_vocab_size; others are {', '.join(EAGLE3_ARCHITECTURES)})")
    eagle = data.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise f.fail("eagle_config", f"should be an object, got {eagle!r}")
    eagle = eagle or {}
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise f.fail("eagle_config.use_aux_hidden_state", "is false (a head without the target's taps and fc), "
                     "which xcompile does not run")
    _refuse_options(f, data)
    cfg = _layer_fields(f, data, default_theta=10_000.0)
    taps, field = _tap_ids(f, {"eagle_aux_hidden_state_layer_ids": data.get("eagle_aux_hidden_state_layer_ids"),
                               "eagle_config.eagle_aux_hidden_state_layer_ids":
                                   eagle.get("eagle_aux_hidden_state_layer_ids")})
    return Eagle3Config(
        **cfg,
        draft_vocab_size=f.get("draft_vocab_size", int, cfg["vocab_size"]),
        target_hidden_size=f.get("target_hidden_size", int, cfg["hidden_size"]),
        tap_layers=taps, tap_field=field, architecture=arch,
        # vLLM's Eagle3 decoder layer reads a flat config's field with default false (llama_eagle3.py)
        norm_before_residual=f.get("norm_before_residual", bool, False),
    )


def _parse_speculators(path: Path, data: dict, arch: str) -> Eagle3Config:
    """vllm-project/speculators' format: ``Eagle3Speculator`` with the decoder layer's config nested under
    ``transformer_layer_config`` and the EAGLE3 fields at the top (speculators models/eagle3 config.py)."""
    f = Fields(path, data)
    if data.get("speculators_model_type") != "eagle3":
        raise f.fail("speculators_model_type", f"is {data.get('speculators_model_type')!r}; xcompile loads "
                     "speculators EAGLE3 heads ('eagle3')")
    layer = data.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise f.fail("transformer_layer_config", "should be an object holding the draft layer's config")
    if layer.get("model_type", "llama") != "llama":
        raise f.fail("transformer_layer_config.model_type", f"is {layer['model_type']!r}; xcompile runs Llama-style "
                     "EAGLE3 layers (a qwen3 layer adds q/k norms)")
    if "norm_before_residual" not in data:
        # vLLM's speculators config reader defaults it to true (transformers_utils/configs/speculators/algos.py
        # update_eagle3), speculators' own Eagle3SpeculatorConfig to false: a missing field is ambiguous
        raise f.fail("norm_before_residual", "is missing, and vLLM reads a missing one as true while speculators "
                     "reads it as false; add the value the head was trained with")
    _refuse_options(f, data)
    lf = Fields(path, {**_LLAMA_DEFAULTS, **layer}, "transformer_layer_config.")
    _refuse_options(lf, lf.data)
    cfg = _layer_fields(lf, lf.data, default_theta=10_000.0)
    taps, field = _tap_ids(f, {"eagle_aux_hidden_state_layer_ids": data.get("eagle_aux_hidden_state_layer_ids")})
    return Eagle3Config(
        **cfg,
        draft_vocab_size=f.get("draft_vocab_size", int, 32000),       # Eagle3SpeculatorConfig's default
        target_hidden_size=f.get("target_hidden_size", int, cfg["hidden_size"]),
        tap_layers=taps, tap_field=field, architecture=arch, layout="layers.0",
        norm_before_residual=f.get("norm_before_residual", bool, False),
    )


# options of EAGLE3 variants xcompile does not compute: refused, never ignored
_REFUSED = {
    "norm_before_fc": "an RMSNorm over the 3H taps before fc (vLLM/speculators, gpt-oss heads)",
    "fc_norm": "one RMSNorm per tap before fc (EAGLE-3.1; SpecForge, vLLM)",
    "norm_output": "the normed hidden fed back to the next step (EAGLE-3.1; SpecForge)",
    "attention_bias": "q/k/v/o biases in the draft layer",
    "mlp_bias": "MLP biases in the draft layer",
    "quantization_config": "quantized weights (xcompile reads quantized Qwen3 targets and draft models; a head "
                           "loads in its float dtype)",
}


def _refuse_options(f: Fields, data: dict) -> None:
    for name, what in _REFUSED.items():
        if data.get(name) not in (None, False):
            raise f.fail(name, f"is {data[name]!r}: {what}, which xcompile does not compute yet")
    if data.get("hidden_act", "silu") != "silu":
        raise f.fail("hidden_act", f"is {data['hidden_act']!r}; the draft layer's MLP is SiLU-gated")


def _layer_fields(f: Fields, data: dict, default_theta: float) -> dict:
    """The draft decoder layer's shape from a Llama-style config (flat, or speculators' nested one)."""
    if f.get("num_hidden_layers", int, 1) != 1:
        raise f.fail("num_hidden_layers", "must be 1 for an EAGLE3 head")
    hidden = f.get("hidden_size", int, required=True)
    heads = f.get("num_attention_heads", int, required=True)
    return dict(
        hidden_size=hidden,
        intermediate_size=f.get("intermediate_size", int, required=True),
        num_attention_heads=heads,
        num_key_value_heads=f.get("num_key_value_heads", int, heads),
        head_dim=f.get("head_dim", int, hidden // heads),
        vocab_size=f.get("vocab_size", int, required=True),
        rms_norm_eps=f.get("rms_norm_eps", float, 1e-6),
        rope_theta=f.rope_theta(default_theta),
        max_position_embeddings=f.get("max_position_embeddings", int, 40960),
        rope_scaling=f.rope_scaling(),
    )


def _tap_ids(f: Fields, found: dict[str, object]) -> tuple[tuple[int, ...] | None, str | None]:
    """0-based layer-output tap ids from whichever TAP_FIELDS are set, each read by its own convention;
    two fields that disagree are refused. (None, None): the target's default taps."""
    got = {}
    for field, ids in found.items():
        if ids is None:
            continue
        offset, convention = TAP_FIELDS[field]
        if not (isinstance(ids, list) and len(ids) == 3 and
                all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise f.fail(field, f"should be three layer ids, got {ids!r}")
        if offset and min(ids) < offset:
            raise f.fail(field, f"holds {min(ids)}, but its ids are {convention}, and hidden_states[0] is the "
                         "embedding output, which xcompile does not tap")
        got[field] = tuple(t - offset for t in ids)
    if len(set(got.values())) > 1:
        (a, x), (b, y) = got.items()
        raise f.fail(b, f"{list(found[b])} and '{a}' {list(found[a])} name different layers ({list(y)} vs {list(x)} "
                     "as layer outputs); remove the wrong one")
    if not got:
        return None, None
    field = next(iter(got))
    return got[field], field


def tap_convention(field: str | None) -> str:
    """What the ids of a tap source count, for the manifest (``TAP_FIELDS``, ``--eagle3-taps``, or the default)."""
    return TAP_FIELDS[field][1] if field in TAP_FIELDS else TAP_CONVENTIONS[field or TAP_DEFAULT]


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
