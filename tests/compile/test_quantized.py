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
from fixtures import step_inputs, write_qwen3_checkpoint
from quantize import AWQ_CONFIG, CT_FP8_CONFIG, FP8_CONFIG, ct_config, write_quantized_checkpoint
from safetensors.torch import load_file, save_file

from xcompile.compile.checkpoint import load_qwen3, module_state

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
        dense = library_convert(path, tmp_path / "dense", FP8BlockDequantizer.from_pretrained(
            path, weight_block_size=tuple(config["weight_block_size"]), dtype=dtype))
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

