"""Quantized weights stay quantized in the exported graphs (compile/qdq.py): DequantizeLinear over the codes,
scales and zero points, so the data file holds no float copy of a quantized linear; ONNX Runtime runs the graphs
and ``xcompile diff`` passes against the reference, which dequantizes the same checkpoint in PyTorch; ``diff
--unquantized`` reports agreement with the unquantized model; TensorRT-RTX builds the forms TensorRT takes."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from fixtures import TINY_DRAFT, refused, write_qwen3_checkpoint
from quantize import AWQ_CONFIG, CT_FP8_CONFIG, FP8_CONFIG, ct_config, write_quantized_checkpoint

from xcompile.compile import qdq
from xcompile.compile.cli import main
from xcompile.runtime.engines.qweight import FP8, INT4, quantize

MAX_SEQ = 32
WIDE = {"hidden_size": 96, "intermediate_size": 192, "head_dim": 24}
LINEARS_PER_LAYER = 7


def ct_int4(group: int, symmetric: bool = True) -> dict:
    return ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group,
                                        "symmetric": symmetric})


# name -> (quantization_config, config overrides, the form every linear of the tiny target is written in)
TARGETS = {
    "fp8-block-48x24": ({**FP8_CONFIG, "weight_block_size": [48, 24]}, None,
                        "float8e4m3fn blocks of 24 along K, scales repeated over 48 rows"),
    "awq-g32": ({**AWQ_CONFIG, "group_size": 32}, None, "uint4 blocks of 32 along K with zero points"),
    "ct-int4-sym-g48": (ct_int4(48), WIDE, "int4 blocks of 48 along K"),
    "ct-int4-asym-g32": (ct_int4(32, symmetric=False), None, "uint4 blocks of 32 along K with zero points"),
    "ct-fp8-channel": (CT_FP8_CONFIG, None, "float8e4m3fn per output channel"),
}
CODE_TYPES = {"float8e4m3fn": ir.DataType.FLOAT8E4M3FN, "int4": ir.DataType.INT4, "uint4": ir.DataType.UINT4}


def xcompile(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def export(model, out, *args, dtype="fp32"):
    result = xcompile("export", "--model", model, "--out", out, "--dtype", dtype, "--max-seq-len", MAX_SEQ, *args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "manifest.json").read_text())


def proj_weights(model: ir.Model) -> dict[str, ir.Value]:
    return {n: v for n, v in model.graph.initializers.items() if n.endswith("_proj.weight")}


@pytest.mark.parametrize("name", TARGETS)
def test_quantized_linears_are_dequantize_linear_nodes_and_diff_passes_on_ort(name, tmp_path):
    config, overrides, form = TARGETS[name]
    path = write_quantized_checkpoint(tmp_path / "q", config, overrides)
    manifest = export(path, tmp_path / "engine")
    dense = export(write_qwen3_checkpoint(tmp_path / "dense", overrides, tokenizer=False), tmp_path / "dense-engine")
    assert "quantization" not in dense["models"]["target"]["extra"]
    record = manifest["models"]["target"]["extra"]["quantization"]
    linears = 4 * LINEARS_PER_LAYER
    assert record["loaded_as"] == "quantized" and record["graphs"] == {"target": {form: linears}}

    graph = ir.load(tmp_path / "engine" / "target.onnx")
    dq = [n for n in graph.graph if n.op_type == "DequantizeLinear"]
    assert len(dq) == linears and not proj_weights(graph)       # no float copy of a quantized weight is left
    assert {n.inputs[0].dtype for n in dq} == {CODE_TYPES[form.split()[0]]}
    assert all(n.inputs[1].dtype == ir.DataType.FLOAT for n in dq)
    assert all((len(n.inputs) == 3) == ("zero points" in form) for n in dq)
    # the codes take 1 (fp8) or 1/2 (int4) byte per weight instead of 4; scales and alignment add a little
    dense_graph = ir.load(tmp_path / "dense-engine" / "target.onnx")
    float_bytes = sum(v.const_value.nbytes for v in proj_weights(dense_graph).values())
    code_bytes = sum(n.inputs[0].const_value.nbytes for n in dq)
    assert code_bytes == float_bytes // (4 if form.startswith("float8") else 8)
    size, dense_size = ((tmp_path / d / "target.onnx.data").stat().st_size for d in ("engine", "dense-engine"))
    assert dense_size - float_bytes + code_bytes < size < dense_size - float_bytes + 1.6 * code_bytes

    result = xcompile("diff", tmp_path / "engine", "--backend", "ort", "--steps", 2, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and all(r["max_abs"] <= 1e-4 for r in report["results"]) and report["unquantized"] is None


def test_a_quantized_draft_model_keeps_its_weights_quantized_and_diff_passes(tmp_path):
    target = write_quantized_checkpoint(tmp_path / "target", {**FP8_CONFIG, "weight_block_size": [32, 32]})
    draft = write_quantized_checkpoint(tmp_path / "draft", ct_int4(32), TINY_DRAFT)
    manifest = export(target, tmp_path / "engine", "--draft-model", draft, dtype="fp16")
    graphs = manifest["models"]["draft"]["extra"]["quantization"]["graphs"]
    assert graphs == {"draft": {"int4 blocks of 32 along K": 2 * LINEARS_PER_LAYER}}
    assert manifest["models"]["target"]["extra"]["quantization"]["graphs"] == {
        "target": {"float8e4m3fn blocks of 32 along K, scales repeated over 32 rows": 4 * LINEARS_PER_LAYER}}
    # fp16 graphs: DequantizeLinear computes in fp32, a Cast rounds the weight once to fp16
    graph = ir.load(tmp_path / "engine" / "draft.onnx")
    casts = [n for n in graph.graph if n.op_type == "Cast" and n.inputs[0].producer() is not None
             and n.inputs[0].producer().op_type == "DequantizeLinear"]
    assert len(casts) == 2 * LINEARS_PER_LAYER and {n.outputs[0].dtype for n in casts} == {ir.DataType.FLOAT16}
    result = xcompile("diff", tmp_path / "engine", "--backend", "ort", "--steps", 2, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and {r["graph"] for r in report["results"]} == {"target", "draft"}


# ---------------------------------------------------------------------------------------------
# the graph's weight is the reference's fp32 dequantization rounded once to the graph's dtype, bit for bit


@pytest.mark.parametrize("kind, block, label", [
    (FP8, (1, 40), "float8e4m3fn per output channel"),
    (FP8, (40, 40), "float8e4m3fn per tensor"),
    (FP8, (7, 9), "float8e4m3fn blocks of 9 along K, scales repeated over 7 rows"),     # partial edge blocks
    (FP8, (1, 16), "float8e4m3fn blocks of 16 along K"),
    (INT4, (1, 8), "uint4 blocks of 8 along K with zero points"),
    (INT4, (3, 16), "uint4 blocks of 16 along K with zero points, scales repeated over 3 rows"),
    (INT4, (1, 40), "uint4 blocks of 40 along K with zero points"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_dequantize_linear_weight_equals_the_reference_dequantization_rounded_once(kind, block, label, dtype,
                                                                                     tmp_path):
    w = torch.randn(21, 40, generator=torch.Generator().manual_seed(0))    # odd N x K: a padded last int4 byte
    q = quantize(w, kind, block)
    assert dequantized_by_ort(q, dtype, tmp_path, label).equal(q.dequantize().to(dtype))


def test_int4_codes_with_zero_points_of_8_take_the_signed_form(tmp_path):
    q = quantize(torch.randn(21, 40, generator=torch.Generator().manual_seed(1)), INT4, (1, 8))
    q = type(q)(INT4, q.codes, q.scale, q.block, torch.full_like(q.zero, 8))
    assert dequantized_by_ort(q, torch.float32, tmp_path, "int4 blocks of 8 along K").equal(q.dequantize())


def dequantized_by_ort(q, dtype, tmp_path, label) -> torch.Tensor:
    """A graph of one weight initializer -> Identity, rewritten by compile/qdq.py and run on ONNX Runtime."""
    ir_dtype = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16,
                torch.bfloat16: ir.DataType.BFLOAT16}[dtype]
    weight = ir.Value(name="w", shape=ir.Shape(q.shape), type=ir.TensorType(ir_dtype),
                      const_value=ir.tensor(np.zeros(q.shape, np.float32), dtype=ir.DataType.FLOAT))
    out = ir.Value(name="out", shape=ir.Shape(q.shape), type=ir.TensorType(ir_dtype))
    graph = ir.Graph([], [out], nodes=[ir.node("Identity", [weight], outputs=[out])], initializers=[weight],
                     opset_imports={"": 24})
    got, added = qdq.replace_weight(graph, weight, q)
    assert got == label
    with open(tmp_path / "w.data", "wb") as f:
        for a in added:
            a.value.const_value = ir.ExternalTensor("w.data", f.tell(), len(a.data), a.value.dtype,
                                                    shape=a.value.shape, name=a.value.name, base_dir=tmp_path)
            f.write(a.data)
            graph.register_initializer(a.value)
    ir.save(ir.Model(graph, ir_version=11), tmp_path / "w.onnx")
    session = ort.InferenceSession(str(tmp_path / "w.onnx"), providers=["CPUExecutionProvider"])
    out = torch.empty(q.shape, dtype=dtype)
    bind = session.io_binding()     # numpy has no bfloat16: ORT writes into a torch buffer (element type 16: bf16)
    bind.bind_output("out", "cpu", 0, {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: 16}[dtype],
                     q.shape, out.data_ptr())
    session.run_with_iobinding(bind)
    return out


# ---------------------------------------------------------------------------------------------
# diff --unquantized


@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    """An AWQ target exported, its unquantized twin, and an unquantized export."""
    root = tmp_path_factory.mktemp("awq")
    export(write_quantized_checkpoint(root / "q", {**AWQ_CONFIG, "group_size": 32}), root / "engine")
    dense = write_qwen3_checkpoint(root / "dense", tokenizer=False)
    export(dense, root / "dense-engine")
    return root


def test_diff_reports_agreement_with_the_unquantized_model(awq):
    result = xcompile("diff", awq / "engine", "--steps", 3, "--unquantized", awq / "dense", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    u = report["unquantized"]
    # prefill's last row and three decode rows; int4 weights move the random tiny model's logits by ~1-3
    assert report["passed"] and u["checkpoint"] == str(awq / "dense") and u["rows"] == 4
    assert 0 <= u["top1"] <= 1 and 0.01 < u["max_abs"] < 10
    table = xcompile("diff", awq / "engine", "--steps", 3, "--unquantized", awq / "dense").stdout
    assert f"target vs the unquantized model ({awq / 'dense'}): top-1 agreement {u['top1']:.3f} over 4" in table
    # without the option the report has no such entry
    same = xcompile("diff", awq / "dense-engine", "--steps", 3, "--json")
    assert same.exit_code == 0 and json.loads(same.stdout)["unquantized"] is None


def test_diff_unquantized_is_refused_where_it_cannot_compare(awq, tmp_path):
    refused(xcompile("diff", awq / "dense-engine", "--unquantized", awq / "dense"), "--unquantized",
            "target holds no quantized weights", code=2)
    refused(xcompile("diff", awq / "engine", "--unquantized", awq / "q"), "--unquantized",
            f"{awq / 'q' / 'config.json'} has a quantization_config", code=2)
    wide = write_qwen3_checkpoint(tmp_path / "wide", WIDE, tokenizer=False)
    refused(xcompile("diff", awq / "engine", "--unquantized", wide), "--unquantized",
            "hidden_size 96 (the target's 64)", code=2)
    refused(xcompile("diff", awq / "engine", "--unquantized", tmp_path / "none"), "--unquantized",
            f"{tmp_path / 'none' / 'config.json'} not found", code=2)


# ---------------------------------------------------------------------------------------------
# TensorRT-RTX builds on the CPU what TensorRT's Dequantize layer takes; asymmetric int4 it refuses


rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="needs TensorRT-RTX")


@rtx
@pytest.mark.trt
@pytest.mark.parametrize("config", [ct_int4(64), {**FP8_CONFIG, "weight_block_size": [32, 32]}, CT_FP8_CONFIG],
                         ids=["int4-sym-g64", "fp8-block-32x32", "fp8-channel"])
def test_tensorrt_rtx_builds_the_symmetric_int4_and_fp8_graphs(config, tmp_path):
    export(write_quantized_checkpoint(tmp_path / "q", config), tmp_path / "engine", dtype="bf16")
    result = xcompile("build", tmp_path / "engine", "--trt", "rtx", "--compute-capability", "8.9",
                      "--max-draft-tokens", 7)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "engine" / "target.engine").stat().st_size > 0


@rtx
@pytest.mark.trt
def test_tensorrt_rtx_refuses_asymmetric_int4_naming_the_initializer(tmp_path):
    export(write_quantized_checkpoint(tmp_path / "q", {**AWQ_CONFIG, "group_size": 64}), tmp_path / "engine",
           dtype="bf16")
    result = xcompile("build", tmp_path / "engine", "--trt", "rtx", "--compute-capability", "8.9")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output     # stdout: progress
    assert "the TensorRT-RTX parser rejected the graph" in errors[0]
    assert "model.layers.0.self_attn.q_proj.weight_quantized" in errors[0]
