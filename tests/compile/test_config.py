"""config.json parsing: both rope_theta spellings, both tap-id spellings, and errors that name the
file and the field."""

from __future__ import annotations

import json

import pytest
from fixtures import eagle3_config, qwen3_config

from xcompile.compile.config import KNOWN_MODELS, synthetic_eagle3_config
from xcompile.compile.errors import CompileError
from xcompile.compile.head_config import check_eagle3_fits, parse_eagle3
from xcompile.compile.hf_config import parse_generation_config, parse_qwen3


def write(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def error(fn, *args) -> str:
    with pytest.raises(CompileError) as e:
        fn(*args)
    return str(e.value)


def test_qwen3_fields(tmp_path):
    cfg = parse_qwen3(write(tmp_path, qwen3_config({"tie_word_embeddings": True, "rms_norm_eps": 1e-5})))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (256, 64, 4, 16)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps) == (4, 2, 1e-5)
    assert cfg.tie_word_embeddings and not cfg.attention_bias


def test_rope_theta_top_level_and_rope_parameters(tmp_path):
    assert parse_qwen3(write(tmp_path, qwen3_config({"rope_theta": 5000}))).rope_theta == 5000.0
    nested = qwen3_config({"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}})
    assert "rope_theta" not in nested
    assert parse_qwen3(write(tmp_path, nested)).rope_theta == 20000.0
    head = eagle3_config(qwen3_config(), {"rope_theta": None, "rope_parameters": {"rope_theta": 3e5}})
    assert parse_eagle3(write(tmp_path, head)).rope_theta == 3e5
    # an EAGLE Llama config without rope_theta means Llama's default base
    assert parse_eagle3(write(tmp_path, {k: v for k, v in head.items() if not k.startswith("rope")})).rope_theta == 1e4


def test_head_dim_defaults_to_hidden_over_heads(tmp_path):
    data = qwen3_config()
    del data["head_dim"]
    assert parse_qwen3(write(tmp_path, data)).head_dim == 16


def test_eagle3_fields(tmp_path):
    cfg = parse_eagle3(write(tmp_path, eagle3_config(qwen3_config())))
    assert (cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size) == (64, 256, 64, 64)
    assert cfg.tap_layers is None and cfg.architecture == "Eagle3LlamaForCausalLM"
    sf = eagle3_config(qwen3_config(), {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": None})
    cfg = parse_eagle3(write(tmp_path, sf))
    assert cfg.architecture == "LlamaForCausalLMEagle3" and cfg.draft_vocab_size == 256    # defaults to vocab


def test_eagle3_tap_ids_top_level_and_eagle_config(tmp_path):
    # top level: HF hidden_states indices (vLLM, speculators) -> layer outputs one lower
    top = eagle3_config(qwen3_config(), {"eagle_aux_hidden_state_layer_ids": [2, 18, 33]})
    cfg = parse_eagle3(write(tmp_path, top))
    assert cfg.tap_layers == (1, 17, 32) and cfg.tap_field == "eagle_aux_hidden_state_layer_ids"
    # eagle_config: layer-output ids (SGLang, SpecForge), as they are
    nested = eagle3_config(qwen3_config(), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3],
                                                             "use_aux_hidden_state": True}})
    cfg = parse_eagle3(write(tmp_path, nested))
    assert cfg.tap_layers == (0, 2, 3) and cfg.tap_field == "eagle_config.eagle_aux_hidden_state_layer_ids"
    # both, naming the same layers in their own conventions
    both = top | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}}
    assert parse_eagle3(write(tmp_path, both)).tap_layers == (1, 17, 32)


@pytest.mark.parametrize("change, field, why", [
    ({"hidden_size": None}, "hidden_size", "is missing"),
    ({"num_hidden_layers": "4"}, "num_hidden_layers", "should be int"),
    ({"vocab_size": True}, "vocab_size", "should be int"),
    ({"vocab_size": 0}, "vocab_size", "should be positive"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide num_attention_heads"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings", "should be bool"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_scaling.rope_type", "'default' and 'yarn'"),
    ({"architectures": ["LlamaForCausalLM"]}, "architectures", "dense Qwen3"),
    ({"architectures": []}, "architectures", "is missing"),
    ({"model_type": "llama"}, "model_type", "transformers would build that model type, not Qwen3"),
    # variants the graphs would not compute, refused rather than exported as plain Qwen3
    ({"hidden_act": "gelu"}, "hidden_act", "SiLU-gated MLP"),
    ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window", "full attention in every layer"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types", "makes layer 1 'sliding_attention'"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps", "a finite number >= 0"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps", "a finite number >= 0"),
    # a null transformers would not read as the default: refused, not silently another model
    ({"rope_theta": None}, "rope_theta", "is null; give its value, or remove the field to take the default"),
    ({"rms_norm_eps": None}, "rms_norm_eps", "is null"),
    ({"max_position_embeddings": None}, "max_position_embeddings", "is null"),
])
def test_qwen3_errors_name_file_and_field(tmp_path, change, field, why):
    path = write(tmp_path, qwen3_config(change))
    msg = error(parse_qwen3, path)
    assert str(path) in msg and f"'{field}'" in msg and why in msg


@pytest.mark.parametrize("change, field, why", [
    ({"num_hidden_layers": 2}, "num_hidden_layers", "must be 1"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, "eagle_aux_hidden_state_layer_ids", "three layer ids"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, -2, 3]}},
     "eagle_config.eagle_aux_hidden_state_layer_ids", "three layer ids"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures", "an EAGLE3 head is one of"),
    ({"intermediate_size": None}, "intermediate_size", "is missing"),
    ({"rope_theta": None}, "rope_theta", "is null"),
])
def test_eagle3_errors_name_file_and_field(tmp_path, change, field, why):
    path = write(tmp_path, eagle3_config(qwen3_config(), change))
    msg = error(parse_eagle3, path)
    assert str(path) in msg and f"'{field}'" in msg and why in msg


def test_unreadable_files(tmp_path):
    assert error(parse_qwen3, tmp_path / "config.json") == f"{tmp_path / 'config.json'}: file not found"
    (tmp_path / "config.json").write_text("{")
    assert "not valid JSON" in error(parse_qwen3, tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1]")
    assert "expected a JSON object" in error(parse_qwen3, tmp_path / "config.json")


def test_generation_config(tmp_path):
    assert parse_generation_config(write(tmp_path, {"eos_token_id": [5, 7]}, "g.json")).eos_token_ids == (5, 7)
    assert parse_generation_config(write(tmp_path, {"eos_token_id": 5}, "g.json")).eos_token_ids == (5,)
    assert parse_generation_config(tmp_path / "absent.json", {"eos_token_id": 9}).eos_token_ids == (9,)
    path = write(tmp_path, {"eos_token_id": ["</s>"]}, "g.json")
    msg = error(parse_generation_config, path)
    assert str(path) in msg and "'eos_token_id'" in msg


def test_default_taps_and_known_models():
    qwen3_8b = KNOWN_MODELS["qwen3-8b"].config
    # outputs of layers 1, 17, 32 = HF hidden_states [2, 18, 33] (docs/eagle3.md §1.2)
    assert qwen3_8b.default_tap_layers == (1, 17, 32)
    assert (qwen3_8b.num_hidden_layers, qwen3_8b.hidden_size, qwen3_8b.tie_word_embeddings) == (36, 4096, False)
    head = synthetic_eagle3_config(qwen3_8b)
    assert (head.draft_vocab_size, head.hidden_size, head.target_hidden_size) == (32000, 4096, 4096)
    assert KNOWN_MODELS["qwen3-8b"].eagle3_repo_id == "AngelSlim/Qwen3-8B_eagle3"


def test_check_eagle3_fits(tmp_path):
    target = parse_qwen3(write(tmp_path, qwen3_config()))
    head_path = write(tmp_path, eagle3_config(qwen3_config()), "head.json")
    head = parse_eagle3(head_path)
    check_eagle3_fits(head, target, head_path, (0, 2, 3))
    other_vocab = parse_eagle3(write(tmp_path, eagle3_config(qwen3_config({"vocab_size": 300})), "h2.json"))
    assert "vocab_size 300 differs from the target's 256" in error(check_eagle3_fits, other_vocab, target, head_path,
                                                                   (0, 2, 3))
    assert "exceed the target's 4 layers" in error(check_eagle3_fits, head, target, head_path, (0, 2, 4))
