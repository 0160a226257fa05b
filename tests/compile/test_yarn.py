"""YaRN RoPE scaling (Qwen3's long-context option) end to end on the CPU: config.json parsing and refusals,
the RoPE tables against transformers' ``_compute_yarn_parameters`` and rotary embedding, the PyTorch reference
against transformers' Qwen3ForCausalLM past the trained window (logits and greedy tokens), the manifest's
record of the scaling, and the ONNX export on ONNX Runtime through ``xcompile diff``.

The tiny YaRN model stretches a trained window of 32 positions 4 times (max_position_embeddings 128, as
transformers expects factor = max_position_embeddings / original_max_position_embeddings); generation runs
well past position 32. fp32 throughout; logits to 1e-4 absolute (test_qwen3.py's tolerance).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import tiny_engines as T
import torch
from click.testing import CliRunner
from fixtures import qwen3_config, step_inputs, write_eagle3_checkpoint, write_qwen3_checkpoint

from xcompile.compile.checkpoint import load_qwen3
from xcompile.compile.cli import main
from xcompile.compile.config import Qwen3Config, Yarn
from xcompile.compile.errors import CompileError
from xcompile.compile.families import family
from xcompile.compile.head_config import parse_eagle3
from xcompile.compile.hf_config import parse_qwen3
from xcompile.compile.models.layers import Rotary, yarn_inv_freq
from xcompile.runtime.enginedir.manifest import Manifest

TOL = 1e-4
TRAINED = 32                                    # the tiny model's original_max_position_embeddings
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED}
TINY_YARN = {"max_position_embeddings": 4 * TRAINED, "rope_scaling": YARN}
# Qwen3-8B's config.json with the rope_scaling its model card adds for 131,072 tokens
MODEL_CARD = {"max_position_embeddings": 40960, "rope_theta": 1e6, "head_dim": 128,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}


def write(tmp_path, data) -> object:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def refusal(fn, path) -> str:
    with pytest.raises(CompileError) as e:
        fn(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


# --------------------------------------------------------------------------------------------
# config.json


def test_model_card_yarn_is_parsed_with_transformers_defaults(tmp_path):
    cfg = parse_qwen3(write(tmp_path, qwen3_config(MODEL_CARD)))
    assert cfg.rope_scaling == Yarn(factor=4.0, original_max_position_embeddings=32768, beta_fast=32.0,
                                    beta_slow=1.0, mscale=None, mscale_all_dim=None, attention_factor=None,
                                    truncate=True)
    # config.json keeps 40960; the scaled RoPE covers 4 x 32768
    assert cfg.max_position_embeddings == 40960 and cfg.context_length == 131072
    assert "YaRN factor 4 x original_max_position_embeddings 32768" in cfg.context_source
    assert parse_qwen3(write(tmp_path, qwen3_config())).rope_scaling is None


def test_the_rope_parameters_transformers_5_writes_parse_alike(tmp_path):
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in qwen3_config(MODEL_CARD).items() if k not in ("architectures", "torch_dtype")}
    hf = transformers.Qwen3Config(**fields)
    hf.architectures = ["Qwen3ForCausalLM"]
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written and written["rope_parameters"]["rope_type"] == "yarn"
    cfg = parse_qwen3(tmp_path / "config.json")
    assert cfg.rope_theta == 1e6
    assert cfg.rope_scaling == parse_qwen3(write(tmp_path, qwen3_config(MODEL_CARD))).rope_scaling


def test_yarn_fields_and_transformers_fallbacks(tmp_path):
    full = {**YARN, "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0,
            "attention_factor": 1.5, "truncate": False}
    y = parse_qwen3(write(tmp_path, qwen3_config({"rope_scaling": full}))).rope_scaling
    assert (y.beta_fast, y.beta_slow, y.mscale, y.mscale_all_dim, y.attention_factor, y.truncate) == \
        (16.0, 2.0, 0.707, 1.0, 1.5, False)
    # no original_max_position_embeddings: max_position_embeddings (transformers' standardize_rope_params);
    # no factor: max_position_embeddings / original_max_position_embeddings
    y = parse_qwen3(write(tmp_path, qwen3_config({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))).rope_scaling
    assert (y.factor, y.original_max_position_embeddings) == (2.0, 512)
    y = parse_qwen3(write(tmp_path, qwen3_config({"rope_scaling": {"type": "yarn",
                                                                   "original_max_position_embeddings": 128}})))
    assert y.rope_scaling.factor == 4.0 and y.context_length == 512


@pytest.mark.parametrize("scaling, field, value", [
    ({"rope_type": "linear", "factor": 2.0}, "rope_scaling.rope_type", "'linear'"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type", "'dynamic'"),
    ({"type": "longrope", "short_factor": [1.0]}, "rope_scaling.type", "'longrope'"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_scaling.rope_type", "'llama3'"),
    ({**YARN, "low_freq_factor": 1.0}, "rope_scaling.low_freq_factor", "not a YaRN field"),
    ({**YARN, "partial_rotary_factor": 0.5}, "rope_scaling.partial_rotary_factor", "0.5"),
    ({**YARN, "factor": "4"}, "rope_scaling.factor", "should be float"),
    ({**YARN, "factor": float("inf")}, "rope_scaling.factor", "should be a finite number"),   # json's Infinity
    ({**YARN, "factor": float("nan")}, "rope_scaling.factor", "should be a finite number"),
    ({**YARN, "factor": 1e308}, "rope_scaling.factor", "passes the 16,777,216 xcompile takes"),
    ({**YARN, "mscale": float("inf")}, "rope_scaling.mscale", "finite number >= 0"),
    ({**YARN, "factor": 0.5}, "rope_scaling.factor", "at least 1"),
    ({**YARN, "beta_fast": 1.0, "beta_slow": 32.0}, "rope_scaling.beta_fast", "below beta_slow 32"),
])
def test_other_rope_scalings_are_refused_in_one_line(tmp_path, scaling, field, value):
    msg = refusal(parse_qwen3, write(tmp_path, qwen3_config({"rope_scaling": scaling})))
    assert f"'{field}'" in msg and value in msg
    # the same under transformers 5's key
    params = {**scaling, "rope_theta": 1e4}
    msg = refusal(parse_qwen3, write(tmp_path, qwen3_config({"rope_parameters": params})))
    assert f"'{field.replace('rope_scaling', 'rope_parameters')}'" in msg


def test_eagle3_heads_carry_their_own_rope_scaling(tmp_path):
    head = parse_eagle3(write_eagle3_checkpoint(tmp_path / "h", TINY_YARN, {"rope_scaling": YARN}) / "config.json")
    assert head.rope_scaling == Yarn(4.0, TRAINED)
    assert parse_eagle3(write_eagle3_checkpoint(tmp_path / "plain") / "config.json").rope_scaling is None
    path = write_eagle3_checkpoint(tmp_path / "l3", overrides={"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert "'rope_scaling.rope_type' is 'llama3'" in refusal(parse_eagle3, path / "config.json")
    # a head xcompile trains is saved with the scaling it computes
    from xcompile.compile.train_eagle3 import save_head
    yarn = Yarn(4.0, TRAINED, mscale=0.5)
    saved = save_head(T.build(32, head_dim=16, rope_scaling=yarn).eagle3, tmp_path / "trained")
    assert parse_eagle3(saved / "config.json").rope_scaling == yarn


def test_manifest_round_trips_the_scaling_and_old_manifests_load():
    cfg = Qwen3Config(256, 64, 128, 4, 4, 2, 16, rope_scaling=Yarn(4.0, TRAINED, mscale=1.0, mscale_all_dim=0.5))
    fields = json.loads(json.dumps(cfg.to_dict()))                     # as manifest.json holds it
    assert fields["rope_scaling"]["factor"] == 4.0
    assert family("qwen3").config_from(fields, "manifest") == cfg
    old = {k: v for k, v in fields.items() if k != "rope_scaling"}     # written before the field existed
    assert family("qwen3").config_from(old, "manifest").rope_scaling is None


# --------------------------------------------------------------------------------------------
# the RoPE tables


def hf_config(overrides: dict):
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in qwen3_config(overrides).items() if k not in ("architectures", "torch_dtype")}
    return transformers.Qwen3Config(**fields)


@pytest.mark.parametrize("scaling", [
    {},
    {"beta_fast": 8, "beta_slow": 2, "truncate": False},
    {"mscale": 1.0, "mscale_all_dim": 0.5},
    {"mscale": 0.8},                                                   # alone: ignored, as transformers reads it
    {"attention_factor": 1.25, "factor": 8.0},
])
def test_tables_equal_transformers_yarn(tmp_path, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    overrides = {**TINY_YARN, "rope_scaling": {**YARN, **scaling}}
    hf = hf_config(overrides)
    ours = parse_qwen3(write(tmp_path, qwen3_config(overrides)))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    freq, factor = yarn_inv_freq(16, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(freq, want_freq.double(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    # the tables every backend reads: cos/sin [positions, D/2] times the attention factor
    positions = torch.arange(128)[None]
    cos, sin = Qwen3RotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
    rotary = Rotary(16, 128, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(torch.cat((rotary.cos, rotary.cos), -1), cos[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.cat((rotary.sin, rotary.sin), -1), sin[0], rtol=0, atol=2e-5)


def test_model_card_frequencies_equal_transformers(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours = parse_qwen3(write(tmp_path, qwen3_config(MODEL_CARD)))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(MODEL_CARD), "cpu")
    freq, factor = yarn_inv_freq(128, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(freq, want_freq.double(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor) and factor == pytest.approx(0.1 * torch.tensor(4.0).log().item() + 1)
    # YaRN moves the low frequencies only: the fastest dimension keeps its frequency, the slowest is divided by 4
    plain = 1 / 1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    assert freq[0] == plain[0] and freq[-1] == pytest.approx(plain[-1] / 4)


# --------------------------------------------------------------------------------------------
# the PyTorch reference against transformers past the trained window


@pytest.fixture(scope="module")
def yarn_target(tmp_path_factory):
    return write_qwen3_checkpoint(tmp_path_factory.mktemp("yarn_target"), TINY_YARN, seed=7)


def hf_model(path):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Prefill then one-token decode steps on our static cache."""
    kv = model.new_kv()
    with torch.no_grad():
        logits, *_ = model(*step_inputs(prompt, 0).values(), *kv)
        out = [int(logits[0, -1].argmax())]
        for t in range(prompt.shape[1], prompt.shape[1] + n - 1):
            logits, *_ = model(*step_inputs(torch.tensor([[out[-1]]]), t).values(), *kv)
            out.append(int(logits[0, -1].argmax()))
    return out


def test_reference_matches_transformers_past_the_trained_window(yarn_target, tmp_path):
    hf = hf_model(yarn_target)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    ours = load_qwen3(yarn_target, 128)
    assert ours.cfg.rope_scaling == Yarn(4.0, TRAINED)
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        got, *_ = ours(*step_inputs(ids, 0).values(), *ours.new_kv())
    assert (got - want).abs().max() <= TOL                               # positions 0..99, trained window 32

    prompt = ids[:, :10]
    with torch.no_grad():
        hf_tokens = hf.generate(prompt, max_new_tokens=60, do_sample=False, min_new_tokens=60)[0, 10:].tolist()
    assert greedy(ours, prompt, 60) == hf_tokens                         # positions up to 69

    # the same weights with plain RoPE part from both: the check above sees YaRN
    plain_dir = write_qwen3_checkpoint(tmp_path / "plain", {"max_position_embeddings": 128}, seed=7, tokenizer=False)
    plain, *_ = load_qwen3(plain_dir, 128)(*step_inputs(ids, 0).values(),
                                           *ours.new_kv())
    assert (plain - want)[:, TRAINED:].abs().max() > 100 * TOL


# --------------------------------------------------------------------------------------------
# ONNX export on ONNX Runtime


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_export_carries_yarn_to_onnx_and_diff_passes_past_the_window(yarn_target, tmp_path):
    import onnx_ir as ir

    head = write_eagle3_checkpoint(tmp_path / "head", TINY_YARN, {"rope_scaling": YARN})
    out = tmp_path / "out"
    result = cli("export", "--model", yarn_target, "--eagle3", head, "--out", out, "--dtype", "fp32",
                 "--max-seq-len", 96)
    assert result.exit_code == 0, result.output
    manifest = Manifest.load(out)
    for role in ("target", "eagle3"):
        assert manifest.models[role].config["rope_scaling"]["factor"] == 4.0
    # the RotaryEmbedding's cos/sin caches are the YaRN tables (attention factor included)
    want = Rotary(16, 96, 10000.0, Yarn(4.0, TRAINED))
    inits = {n: v.const_value.numpy() for n, v in ir.load(out / "target.onnx").graph.initializers.items()
             if n.endswith(("rotary.cos", "rotary.sin"))}
    assert len(inits) == 2
    for name, table in inits.items():
        assert torch.equal(torch.from_numpy(table.copy()), want.cos if name.endswith("cos") else want.sin), name

    # teacher-forced steps on ORT against the reference, from position 30 to 52
    prompt = ",".join(str(i) for i in torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(1)).tolist())
    result = cli("diff", out, "--backend", "ort", "--prompt-ids", prompt, "--steps", 22, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and ("target", "decode22") in {(r["graph"], r["step"]) for r in report["results"]}
    for r in report["results"]:
        assert r["max_abs"] <= TOL, r


def test_max_seq_len_may_reach_yarns_context(tmp_path):
    src = write_qwen3_checkpoint(tmp_path / "src", {"max_position_embeddings": 40, "rope_scaling": YARN},
                                 tokenizer=False)
    result = cli("export", "--model", src, "--out", tmp_path / "out", "--max-seq-len", 129)
    assert result.exit_code == 2                    # an option the model cannot take
    line = result.stderr.strip()
    assert "\n" not in line and "--max-seq-len 129 exceeds 128 positions (YaRN factor 4 x " \
        "original_max_position_embeddings 32)" in line and str(src) in line


def test_synthetic_weights_take_qwen3s_model_card_yarn():
    """``xrun bench --synthetic NAME --yarn F``: the target's RoPE stretched by F over Qwen3's 32,768 trained
    positions (the model card's rope_scaling), its tables those of a checkpoint that carries it; the heads keep
    their own RoPE; without it a manifest past max_position_embeddings is refused."""
    from xcompile.compile.reference import reference_engines, synthetic_manifest, synthetic_positions

    assert synthetic_positions("qwen3-8b") == (40960, "max_position_embeddings 40960")
    assert synthetic_positions("qwen3-8b", 4.0)[0] == 131072
    card = Yarn(factor=4.0, original_max_position_embeddings=32768)           # transformers' defaults besides
    big = synthetic_manifest("qwen3-8b", 131072, yarn=4.0, mtp=True)          # no weights drawn
    assert big.models["target"].config["rope_scaling"] == asdict(card)
    assert big.models["eagle3"].config.get("rope_scaling") is None
    with pytest.raises(CompileError, match="max_seq_len 131072 exceeds qwen3-8b's max_position_embeddings 40960"):
        synthetic_manifest("qwen3-8b", 131072)
    tiny = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    manifest = synthetic_manifest("qwen3-8b", 64, "fp32", config=tiny, yarn=4.0)
    module = reference_engines(manifest, "cpu")["target"].module
    want = Rotary(16, 64, tiny.rope_theta, card)
    rotary = module.model.rotary
    assert torch.equal(rotary.cos, want.cos) and not torch.equal(rotary.cos, Rotary(16, 64, tiny.rope_theta).cos)
