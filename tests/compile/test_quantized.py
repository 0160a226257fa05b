"""Quantized Qwen3 checkpoints (compile/quantization.py, compile/checkpoint/quantized.py): FP8 with block
scales, AutoAWQ's GEMM layout and compressed-tensors, written by tests/quantize.py from each format's
specification, loaded dequantized, exported and diffed.

The reference is the formats' own library, compressed-tensors (a dev dependency), which runs on the CPU:
its FP8BlockDequantizer for quant_method fp8, its AutoAWQConverter followed by its dequantizer for AWQ, and
its dequantizer for its own formats. The library computes in its scales' dtype (fp32 for FP8 blocks, fp16
for AWQ, bf16 for the compressed-tensors fixtures), so the loaded weights are compared bit for bit in that
dtype; xcompile computes in fp32 and rounds once, so both are the correctly rounded (q - z) * s there.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from fixtures import TINY_DRAFT, refused, step_inputs, write_eagle3_checkpoint, write_qwen3_checkpoint
from quantize import AWQ_CONFIG, CT_FP8_CONFIG, FP8_CONFIG, ct_config, write_quantized_checkpoint
from safetensors.torch import load_file, save_file

from xcompile.compile.checkpoint import load_qwen3, module_state
from xcompile.compile.cli import main

MAX_SEQ = 32
# hidden 96, intermediate 192: input widths that a group of 48 divides but 128 does not
WIDE = {"hidden_size": 96, "intermediate_size": 192, "head_dim": 24}

FORMATS = {
    "fp8-block-128": (FP8_CONFIG, None),                                  # every dim < 128: one partial block
    "fp8-block-48x24": ({**FP8_CONFIG, "weight_block_size": [48, 24]}, None),    # partial blocks at the edges
    "awq-g32": ({**AWQ_CONFIG, "group_size": 32}, None),
    "awq-g48": ({**AWQ_CONFIG, "group_size": 48}, WIDE),
    "ct-fp8-channel": (CT_FP8_CONFIG, None),
    "ct-fp8-block-48x24": (ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block",
                                                         "block_structure": [48, 24]}), None),
    "ct-int4-g48": (ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group",
                                                 "group_size": 48}), WIDE),
    "ct-int4-asym-g32": (ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group",
                                                      "group_size": 32, "symmetric": False}), None),
    "ct-int4-channel": (ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "channel"}), None),
}


def xcompile(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Format name -> (quantized checkpoint dir, its unquantized fp32 twin), written on first use."""
    made = {}

    def get(name: str):
        if name not in made:
            config, overrides = FORMATS[name]
            root = tmp_path_factory.mktemp(name)
            made[name] = (write_quantized_checkpoint(root / "quantized", config, overrides),
                          write_qwen3_checkpoint(root / "dense", overrides, tokenizer=False))
        return made[name]
    return get


def state(path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return module_state(load_qwen3(path, MAX_SEQ, dtype=dtype))


def stored_dtype(config: dict) -> torch.dtype:
    """The fixtures' dtype of the tensors left unquantized (AutoAWQ saves fp16)."""
    return torch.float16 if config["quant_method"] == "awq" else torch.bfloat16


def library_convert(src, dst, converter):
    """``converter`` (a compressed-tensors Converter) applied to a single-file checkpoint dir, as its
    convert_checkpoint does file by file (which cannot save the partial-block results: not contiguous)."""
    from compressed_tensors.entrypoints.convert.convert_file import write_checkpoint_quantization_config

    shutil.copytree(src, dst)
    tensors = converter.process(load_file(dst / "model.safetensors"))
    save_file({k: t.contiguous() for k, t in tensors.items()}, dst / "model.safetensors")
    write_checkpoint_quantization_config(dst, [converter])
    return dst


@pytest.mark.parametrize("name", FORMATS)
def test_loaded_weights_equal_the_librarys_dequantization(name, checkpoints, tmp_path):
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    path, _ = checkpoints(name)
    config = FORMATS[name][0]
    if name.startswith("fp8"):
        dtype = torch.float32
        # every module with a weight_scale_inv, as compressed-tensors 0.20's from_pretrained finds them (0.19, which
        # llm-compressor 0.14 pins, takes them as targets only)
        targets = [k.removesuffix(".weight_scale_inv") for k in load_file(path / "model.safetensors")
                   if k.endswith(".weight_scale_inv")]
        dense = library_convert(path, tmp_path / "dense", FP8BlockDequantizer(
            targets=targets, weight_block_size=tuple(config["weight_block_size"]), dtype=dtype))
    elif name.startswith("awq"):
        dtype = torch.float16
        converted = library_convert(path, tmp_path / "ct", AutoAWQConverter.from_pretrained(str(path)))
        # the library's compressed-tensors rewrite of the AWQ checkpoint loads to the same weights, in any dtype
        assert json.loads((converted / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
        assert all(torch.equal(a, b) for a, b in zip(state(path).values(), state(converted).values()))
        dense = library_convert(converted, tmp_path / "dense", CompressedTensorsDequantizer(converted, dtype=dtype))
    else:
        dtype = torch.bfloat16
        # the library matches targets by name alone, so its "Linear" would take the embedding for a linear
        dense = library_convert(path, tmp_path / "dense", CompressedTensorsDequantizer(
            path, ignore=["model.embed_tokens"], dtype=dtype))
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    ours, reference = state(path, dtype), state(dense, dtype)
    assert ours.keys() == reference.keys()
    for key in ours:
        assert torch.equal(ours[key], reference[key]), key


@pytest.mark.parametrize("name", FORMATS)
def test_quantized_logits_stay_within_the_quantization_error(name, checkpoints):
    """The weights carry the format's error (fp8 e4m3: 3 mantissa bits, at most 2^-4 relative per weight;
    int4: half a step of a 16-level grid, ~10 % RMS), the rest is the checkpoint's float tensors as they are,
    and the logits' RMS error stays within 6x the weights' (this random 4-layer model amplifies a relative
    weight error 4.2-5.1x in every format)."""
    path, dense = checkpoints(name)
    q, d = load_qwen3(path, MAX_SEQ), load_qwen3(dense, MAX_SEQ)
    qs, ds = module_state(q), module_state(d)
    linears = [k for k in qs if k.endswith("_proj.weight")]
    weight_error = max(float((qs[k] - ds[k]).norm() / ds[k].norm()) for k in linears)
    assert weight_error <= (0.04 if "fp8" in name else 0.2), weight_error
    assert all(torch.equal(qs[k], ds[k].to(stored_dtype(FORMATS[name][0])).float()) for k in qs if k not in linears)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, ref = (m(*step_inputs(ids).values(), *m.new_kv(2))[0] for m in (q, d))
    logits_error = float((got - ref).norm() / ref.norm())
    assert logits_error <= 6 * weight_error, (logits_error, weight_error)


# ---------------------------------------------------------------------------------------------
# export: the graphs hold the dequantized weights; the manifest records the scheme


@pytest.mark.parametrize("name, draft", [("awq-g48", None), ("fp8-block-48x24", "awq-g32"),
                                         ("ct-int4-asym-g32", "ct-fp8-channel")])
def test_export_of_a_quantized_checkpoint_runs_on_ort_and_diff_passes(name, draft, checkpoints, tmp_path):
    """A quantized target (and draft model) exports end to end, and ``xcompile diff`` on ONNX Runtime passes
    against the PyTorch reference, which dequantizes the same checkpoint again."""
    target = checkpoints(name)[0]
    args = ["--draft-model", write_quantized_checkpoint(tmp_path / "draft", FORMATS[draft][0], TINY_DRAFT)] \
        if draft else []
    out = tmp_path / "engine"
    result = xcompile("export", "--model", target, "--out", out, "--dtype", "fp32", "--max-seq-len", MAX_SEQ, *args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["models"]["target"]["extra"]["quantization"]
    method = FORMATS[name][0]["quant_method"]
    assert record["method"] == method and record["loaded_as"] == "quantized"
    assert record["unquantized"] == ["lm_head"] and [w["modules"] for w in record["weights"]] == [4 * 7]
    if draft:
        assert manifest["models"]["draft"]["extra"]["quantization"]["method"] == FORMATS[draft][0]["quant_method"]
    result = xcompile("diff", out, "--backend", "ort", "--prompt", "hello world the cat is", "--steps", 2, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and {r["graph"] for r in report["results"]} >= {"target", *(["draft"] if draft else [])}
    assert all(r["max_abs"] <= 1e-4 for r in report["results"])


@pytest.mark.parametrize("config, keep, unquantized", [
    ({**FP8_CONFIG, "modules_to_not_convert": ["down_proj", "model.layers.1"]},
     ("down_proj", *(f"layers.1.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"))), 4 + 6),
    ({**AWQ_CONFIG, "group_size": 32, "modules_to_not_convert": ["mlp.up"]}, ("up_proj",), 4),
    ({**CT_FP8_CONFIG, "ignore": ["lm_head", "re:.*v_proj$", "model.layers.0.mlp.gate_proj"]},
     ("v_proj", "layers.0.mlp.gate_proj"), 5),
])
def test_modules_left_unquantized_load_from_their_float_weights(config, keep, unquantized, tmp_path):
    """modules_to_not_convert by each method's own rule (transformers' module-boundary prefix or suffix for
    fp8, AutoAWQ's substring for awq; compressed-tensors' ignore: exact names and re: patterns)."""
    path = write_quantized_checkpoint(tmp_path / "q", config, keep=keep)
    dense = write_qwen3_checkpoint(tmp_path / "dense", tokenizer=False)
    qs, ds = state(path), state(dense)
    kept = [k for k in qs if k.endswith("_proj.weight") and k.removesuffix(".weight").endswith(keep)]
    assert len(kept) == unquantized and all(torch.equal(qs[k], ds[k].to(stored_dtype(config)).float()) for k in kept)
    result = xcompile("export", "--model", path, "--out", tmp_path / "out", "--dtype", "fp32", "--max-seq-len", 16)
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "manifest.json").read_text())["models"]["target"]["extra"]["quantization"]
    assert len(record["unquantized"]) == unquantized + 1 and record["weights"][0]["modules"] == 28 - unquantized


def test_a_modules_to_not_convert_layer_id_is_not_a_prefix_of_another(tmp_path):
    """transformers' rule for fp8: 'model.layers.1' skips layer 1, not layer 10; lm_head is never quantized."""
    from xcompile.compile.quantization import parse_quantization

    q = parse_quantization(tmp_path / "config.json", {"quantization_config": {
        **FP8_CONFIG, "modules_to_not_convert": ["model.layers.1", "o_proj"]}})
    assert q.scheme_for("model.layers.1.mlp.up_proj") is None
    assert q.scheme_for("model.layers.2.self_attn.o_proj") is None
    assert q.scheme_for("model.layers.10.mlp.up_proj") is not None and q.scheme_for("lm_head") is None


# ---------------------------------------------------------------------------------------------
# refusals: one line naming the field (config) or the tensor and its file; exit 1, no traceback


def with_config(src, dst, change) -> str:
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    change(data["quantization_config"])
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def group(q: dict) -> dict:
    return q["config_groups"]["group_0"]


@pytest.mark.parametrize("name, change, needles", [
    ("awq-g32", lambda q: q.update(quant_method="gptq"), ["quantization_config.quant_method: 'gptq' is not supported",
                                                          "fp8, awq, compressed-tensors"]),
    ("awq-g32", lambda q: q.update(bits=3), ["quantization_config.bits: 3 is not supported; xcompile reads 4-bit AWQ"]),
    ("awq-g32", lambda q: q.update(version="gemv"), ["quantization_config.version: 'gemv'", "GEMM"]),
    ("awq-g32", lambda q: q.update(zero_point=False), ["quantization_config.zero_point: False is not supported"]),
    ("awq-g32", lambda q: q.update(backend="llm-awq"), ["quantization_config.backend: 'llm-awq'"]),
    ("awq-g32", lambda q: q.update(group_size=0), ["quantization_config.group_size", "positive"]),
    ("awq-g32", lambda q: q.update(packing="reversed"), ["quantization_config.packing", "not a field xcompile knows"]),
    ("fp8-block-128", lambda q: q.update(fmt="e5m2"), ["quantization_config.fmt: 'e5m2'", "e4m3"]),
    ("fp8-block-128", lambda q: q.update(activation_scheme="static"), ["quantization_config.activation_scheme: "
                                                                       "'static' is not supported", "input scales"]),
    ("fp8-block-128", lambda q: q.pop("weight_block_size"), ["quantization_config.weight_block_size is missing"]),
    ("fp8-block-128", lambda q: q.update(weight_block_size=[128]), ["quantization_config.weight_block_size",
                                                                    "two positive integers"]),
    ("fp8-block-128", lambda q: q.update(scale_fmt="ue8m0"), ["quantization_config.scale_fmt: 'ue8m0'"]),
    ("fp8-block-128", lambda q: q.update(modules_to_convert=["model.embed_tokens"]),
     ["quantization_config.modules_to_convert"]),
    ("ct-fp8-channel", lambda q: q.update(format="int-quantized"), ["quantization_config.format: 'int-quantized'",
                                                                     "'float-quantized'", "'pack-quantized'"]),
    ("ct-fp8-channel", lambda q: q.update(quantization_status="frozen"), ["quantization_config.quantization_status"]),
    ("ct-fp8-channel", lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
     ["quantization_config.kv_cache_scheme", "KV-cache"]),
    ("ct-fp8-channel", lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}),
     ["quantization_config.sparsity_config"]),
    ("ct-fp8-channel", lambda q: group(q)["input_activations"].update(dynamic=False),
     ["quantization_config.config_groups.group_0.input_activations.dynamic: False", "static"]),
    ("ct-fp8-channel", lambda q: group(q).update(output_activations={"num_bits": 8}),
     ["quantization_config.config_groups.group_0.output_activations"]),
    ("ct-fp8-channel", lambda q: group(q)["weights"].update(strategy="token"),
     ["quantization_config.config_groups.group_0.weights.strategy: 'token'"]),
    ("ct-fp8-channel", lambda q: group(q)["weights"].update(symmetric=False),
     ["quantization_config.config_groups.group_0.weights.symmetric"]),
    ("ct-fp8-channel", lambda q: group(q).update(targets=["Embedding"]),
     ["quantization_config.config_groups.group_0.targets: 'Embedding'"]),
    ("ct-int4-g48", lambda q: group(q)["weights"].update(num_bits=8),
     ["quantization_config.config_groups.group_0.weights.num_bits: 8 is not supported", "4-bit"]),
    ("ct-int4-g48", lambda q: group(q)["weights"].update(actorder="group"),
     ["quantization_config.config_groups.group_0.weights.actorder: 'group'", "weight_g_idx"]),
    ("ct-int4-g48", lambda q: group(q)["weights"].update(strategy="tensor_group"),
     ["quantization_config.config_groups.group_0.weights.strategy: 'tensor_group'"]),
])
def test_unsupported_quantization_configs_are_refused_naming_the_field(name, change, needles, checkpoints,
                                                                         tmp_path):
    path = with_config(checkpoints(name)[0], tmp_path / "q", change)
    line = refused(xcompile("export", "--model", path, "--out", tmp_path / "out"), *needles, code=1)
    assert str(path / "config.json") in line and not (tmp_path / "out").exists()


def with_tensors(src, dst, change) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def set_to(key: str, value: float):
    def change(t):
        t[key] = t[key].clone()
        t[key].view(-1)[1] = value
    return change


L0 = "model.layers.0"


@pytest.mark.parametrize("name, change, needles", [
    ("fp8-block-48x24", lambda t: t.update({f"{L0}.mlp.up_proj.weight_scale_inv": torch.ones(2, 2)}),
     [f"'{L0}.mlp.up_proj.weight_scale_inv' has shape [2, 2], expected [3, 3]", "[48, 24] block"]),
    ("fp8-block-48x24", set_to(f"{L0}.mlp.up_proj.weight_scale_inv", float("nan")),
     [f"'{L0}.mlp.up_proj.weight_scale_inv' holds 1 NaN/Inf scale(s)"]),
    ("awq-g32", set_to(f"{L0}.self_attn.k_proj.scales", float("inf")), [f"'{L0}.self_attn.k_proj.scales'", "NaN/Inf"]),
    ("fp8-block-48x24", set_to(f"{L0}.self_attn.o_proj.weight", float("nan")),
     [f"'{L0}.self_attn.o_proj.weight' holds 1 NaN code(s)"]),
    ("ct-int4-asym-g32", set_to(f"{L0}.mlp.down_proj.weight_scale", 0.0),
     [f"'{L0}.mlp.down_proj.weight_scale' holds 1 zero scale(s)"]),
    ("awq-g32", lambda t: t.update({f"{L0}.mlp.up_proj.scales": t[f"{L0}.mlp.up_proj.scales"][:1]}),
     [f"'{L0}.mlp.up_proj.scales' has shape [1, 128], expected [2, 128]"]),
    ("ct-int4-g48", lambda t: t.update({f"{L0}.mlp.up_proj.weight_shape": torch.tensor([192, 48])}),
     [f"'{L0}.mlp.up_proj.weight_shape' holds [192, 48], expected [192, 96]"]),
    ("fp8-block-128", lambda t: t.update({f"{L0}.mlp.up_proj.weight": t[f"{L0}.mlp.up_proj.weight"].bfloat16()}),
     [f"'{L0}.mlp.up_proj.weight' is torch.bfloat16, expected torch.float8_e4m3fn"]),
    ("fp8-block-128", lambda t: t.pop(f"{L0}.mlp.up_proj.weight_scale_inv"),
     [f"missing tensor '{L0}.mlp.up_proj.weight_scale_inv'"]),
    ("fp8-block-128", lambda t: t.update({f"{L0}.mlp.up_proj.input_scale": torch.ones(())}),
     [f"unexpected tensor '{L0}.mlp.up_proj.input_scale'"]),
])
def test_inconsistent_quantized_tensors_are_refused_naming_tensor_and_file(name, change, needles, checkpoints,
                                                                             tmp_path):
    path = with_tensors(checkpoints(name)[0], tmp_path / "q", change)
    # -q: a value (a scale, weight_shape) is checked as its linear is read, after export has begun
    line = refused(xcompile("export", "-q", "--model", path, "--out", tmp_path / "out"), *needles, code=1)
    assert str(path) in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, needles", [
    ({**AWQ_CONFIG, "group_size": 48}, ["'model.layers.0.self_attn.q_proj.scales'", "group_size 48 does not divide the "
                                        "64 input features of model.layers.0.self_attn.q_proj"]),
    (ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 48}),
     ["'model.layers.0.self_attn.q_proj.weight_scale'", "group_size 48 does not divide"]),
])
def test_a_group_size_that_does_not_divide_the_input_is_refused(config, needles, checkpoints, tmp_path):
    # the WIDE checkpoint (inputs 96 and 192) under a config that claims the tiny shape's inputs (64 and 128)
    path = write_qwen3_checkpoint(tmp_path / "q")
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "quantization_config": config}))
    refused(xcompile("export", "--model", path, "--out", tmp_path / "out"), *needles, str(path), code=1)


def test_a_quantized_eagle3_head_is_refused(tmp_path, checkpoints):
    target = checkpoints("awq-g32")[0]
    head = write_eagle3_checkpoint(tmp_path / "head", overrides={"quantization_config": AWQ_CONFIG})
    refused(xcompile("export", "--model", target, "--eagle3", head, "--out", tmp_path / "out"),
            "quantization_config", "a head loads in its float dtype", code=1)
