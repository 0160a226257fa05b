"""Quantized weights stay quantized in the exported graphs (compile/qdq.py): DequantizeLinear over the codes,
scales (and for asymmetric int4 a zero-point correction after the linear's MatMul), so the data file holds no float
copy of a quantized linear; ONNX Runtime runs the graphs and ``xcompile diff`` passes against the reference, which
dequantizes the same checkpoint in PyTorch; ``diff --unquantized`` reports agreement with the unquantized model;
TensorRT-RTX builds every form."""

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
from xcompile.compile.errors import CompileError
from xcompile.runtime.engines.qweight import FP8, INT4, quantize

MAX_SEQ = 32
WIDE = {"hidden_size": 96, "intermediate_size": 192, "head_dim": 24}
LINEARS_PER_LAYER = 7


def ct_int4(group: int, symmetric: bool = True) -> dict:
    return ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group,
                                        "symmetric": symmetric})


ASYMMETRIC = "int4 blocks of {} along K, zero points subtracted on x's group sums"

# name -> (quantization_config, config overrides, the form every linear of the tiny target is written in)
TARGETS = {
    "fp8-block-48x24": ({**FP8_CONFIG, "weight_block_size": [48, 24]}, None,
                        "float8e4m3fn blocks of 24 along K, scales repeated over 48 rows"),
    "awq-g32": ({**AWQ_CONFIG, "group_size": 32}, None, ASYMMETRIC.format(32)),
    "ct-int4-sym-g48": (ct_int4(48), WIDE, "int4 blocks of 48 along K"),
    "ct-int4-asym-g32": (ct_int4(32, symmetric=False), None, ASYMMETRIC.format(32)),
    "ct-fp8-channel": (CT_FP8_CONFIG, None, "float8e4m3fn per output channel"),
}
CODE_TYPES = {"float8e4m3fn": ir.DataType.FLOAT8E4M3FN, "int4": ir.DataType.INT4}


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
    assert all(len(n.inputs) == 2 for n in dq)         # no zero points: TensorRT's Dequantize takes only zeros
    # asymmetric int4: each linear's MatMul is followed by Sub(y, (x's group sums) @ c^T)
    corrections = [n for n in graph.graph if n.op_type == "Sub" and n.outputs[0].name.endswith("_matmul_corrected")]
    assert len(corrections) == (linears if "zero points" in form else 0)
    assert all(n.inputs[0].producer().op_type == "MatMul" for n in corrections)
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


def test_asymmetric_int4_in_fp16_graphs_passes_diff_at_the_fp16_tolerances(tmp_path):
    target = write_quantized_checkpoint(tmp_path / "target", {**AWQ_CONFIG, "group_size": 32})
    draft = write_quantized_checkpoint(tmp_path / "draft", ct_int4(32, symmetric=False), TINY_DRAFT)
    manifest = export(target, tmp_path / "engine", "--draft-model", draft, dtype="fp16")
    assert manifest["models"]["target"]["extra"]["quantization"]["graphs"] == {
        "target": {ASYMMETRIC.format(32): 4 * LINEARS_PER_LAYER}}
    assert manifest["models"]["draft"]["extra"]["quantization"]["graphs"] == {
        "draft": {ASYMMETRIC.format(32): 2 * LINEARS_PER_LAYER}}
    result = xcompile("diff", tmp_path / "engine", "--backend", "ort", "--steps", 2, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    # the default fp16 logits tolerance is 0.12; the extra roundings (docs/quantization.md) stay far inside it
    assert report["passed"] and {r["graph"] for r in report["results"]} == {"target", "draft"}
    assert all(r["max_abs"] <= 0.03 for r in report["results"] if r["output"] == "logits")


# ---------------------------------------------------------------------------------------------
# the graph's weight is the reference's fp32 dequantization rounded once to the graph's dtype, bit for bit


@pytest.mark.parametrize("kind, block, label", [
    (FP8, (1, 40), "float8e4m3fn per output channel"),
    (FP8, (40, 40), "float8e4m3fn per tensor"),
    (FP8, (7, 9), "float8e4m3fn blocks of 9 along K, scales repeated over 7 rows"),     # partial edge blocks
    (FP8, (1, 16), "float8e4m3fn blocks of 16 along K"),
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


IR_DTYPES = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16, torch.bfloat16: ir.DataType.BFLOAT16}
ORT_ELEMENT = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: 16}     # 16: ORT's bf16


def dequantized_by_ort(q, dtype, tmp_path, label) -> torch.Tensor:
    """A graph of one weight initializer -> Identity, rewritten by compile/qdq.py and run on ONNX Runtime."""
    weight = ir.Value(name="w", shape=ir.Shape(q.shape), type=ir.TensorType(IR_DTYPES[dtype]),
                      const_value=ir.tensor(np.zeros(q.shape, np.float32), dtype=ir.DataType.FLOAT))
    out = ir.Value(name="out", shape=ir.Shape(q.shape), type=ir.TensorType(IR_DTYPES[dtype]))
    graph = ir.Graph([], [out], nodes=[ir.node("Identity", [weight], outputs=[out])], initializers=[weight],
                     opset_imports={"": 24})
    got, added = qdq.replace_weight(graph, weight, q)
    assert got == label
    return run_on_ort(graph, added, tmp_path, {}, torch.empty(q.shape, dtype=dtype))


def linear_by_ort(q, x, tmp_path) -> tuple[torch.Tensor, ir.Graph, str]:
    """x [1, T, K] @ W^T as the export traces a linear (MatMul(x, Transpose(W)), T symbolic), W rewritten by
    compile/qdq.py, run on ONNX Runtime in x's dtype; returns y [1, T, N], the rewritten graph and its label."""
    (n, k), dtype, tokens = q.shape, IR_DTYPES[x.dtype], ir.SymbolicDim("tokens")
    weight = ir.Value(name="w", shape=ir.Shape(q.shape), type=ir.TensorType(dtype),
                      const_value=ir.tensor(np.zeros(q.shape, np.float32), dtype=ir.DataType.FLOAT))
    xv = ir.Value(name="x", shape=ir.Shape([1, tokens, k]), type=ir.TensorType(dtype))
    wt = ir.Value(name="w_t", shape=ir.Shape([k, n]), type=ir.TensorType(dtype))
    y = ir.Value(name="y", shape=ir.Shape([1, tokens, n]), type=ir.TensorType(dtype))
    graph = ir.Graph([xv], [y], nodes=[ir.node("Transpose", [weight], {"perm": [1, 0]}, outputs=[wt]),
                                       ir.node("MatMul", [xv, wt], outputs=[y])],
                     initializers=[weight], opset_imports={"": 24})
    label, added = qdq.replace_weight(graph, weight, q)
    return run_on_ort(graph, added, tmp_path, {"x": x}, torch.empty(1, x.shape[1], n, dtype=x.dtype)), graph, label


def run_on_ort(graph, added, tmp_path, inputs: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Write ``added`` to a data file as the export does, run ``graph`` on ONNX Runtime's CPU and return its one
    output in ``out`` (numpy has no bfloat16: ORT reads and writes torch buffers)."""
    with open(tmp_path / "w.data", "wb") as f:
        for a in added:
            a.value.const_value = ir.ExternalTensor("w.data", f.tell(), len(a.data), a.value.dtype,
                                                    shape=a.value.shape, name=a.value.name, base_dir=tmp_path)
            f.write(a.data)
            graph.register_initializer(a.value)
    ir.save(ir.Model(graph, ir_version=11), tmp_path / "w.onnx")
    session = ort.InferenceSession(str(tmp_path / "w.onnx"), providers=["CPUExecutionProvider"])
    bind = session.io_binding()
    for name, t in inputs.items():
        bind.bind_input(name, "cpu", 0, ORT_ELEMENT[t.dtype], list(t.shape), t.data_ptr())
    bind.bind_output(graph.outputs[0].name, "cpu", 0, ORT_ELEMENT[out.dtype], list(out.shape), out.data_ptr())
    session.run_with_iobinding(bind)
    return out


# ---------------------------------------------------------------------------------------------
# asymmetric int4: (q - z) s = (q - 8) s - (z - 8) s, the second term subtracted after the MatMul on x's group sums

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11}


@pytest.mark.parametrize("block, label", [
    ((1, 8), ASYMMETRIC.format(8)),
    ((3, 16), ASYMMETRIC.format(16) + ", scales repeated over 3 rows"),     # K = 40: a partial last group, padded
    ((1, 40), ASYMMETRIC.format(40)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])     # ORT's CPU has no bf16 MatMul
def test_an_asymmetric_int4_linear_equals_the_reference_up_to_the_graph_dtypes_rounding(block, label, dtype,
                                                                                        tmp_path):
    gen = torch.Generator().manual_seed(2)
    q = quantize(torch.randn(21, 40, generator=gen), INT4, block)
    assert not bool((q.zero == 8).all())
    x = torch.randn(1, 5, 40, generator=gen).to(dtype)
    got, graph, got_label = linear_by_ort(q, x, tmp_path)
    assert got_label == label
    # the weight left in the graph is the symmetric form's: signed INT4 codes, no zero point, straight into MatMul
    dq = [n for n in graph if n.op_type == "DequantizeLinear"]
    assert len(dq) == 1 and dq[0].inputs[0].dtype == ir.DataType.INT4 and len(dq[0].inputs) == 2
    assert {n.op_type for n in graph} >= {"ReduceSum", "Sub"} and ("Pad" in {n.op_type for n in graph}) == (
        40 % block[1] != 0)

    # the reference: x @ W^T with W = (q - z) s in fp32, rounded once to the graph dtype (the weight and the output)
    ref = (x @ q.dequantize().to(dtype).T).double()
    # ours rounds (q - 8) s to the graph dtype instead, then the MatMul's output, the correction and the Sub: with
    # the reference's two roundings, six of at most u times sum_k |x_k| (|(q - 8) s| + |(z - 8) s|) each. fp32:
    # both sum K = 40 products in their own orders, bounded by K u times the same sum.
    w8 = ((q.codes.float() - 8) * q.expand(q.scale)).double()
    c = ((q.zero.float() - 8) * q.scale).double()
    magnitude = x.double().abs() @ (w8.abs() + q.expand(c).abs()).T
    bound = (2 * 40 if dtype == torch.float32 else 6) * UNIT_ROUNDOFF[dtype] * magnitude
    assert ((got.double() - ref).abs() <= bound).all()
    # and the bound is not loose by orders of magnitude: the reference itself is that far from the exact product
    exact = x.double() @ q.dequantize().double().T
    assert (got.double() - exact).abs().max() < 4 * (ref - exact).abs().max()


def test_asymmetric_int4_is_refused_where_the_weight_is_not_a_linears(tmp_path):
    q = quantize(torch.randn(21, 40, generator=torch.Generator().manual_seed(3)), INT4, (1, 8))
    with pytest.raises(CompileError, match=r"w: asymmetric int4 needs the weight's one use to be Transpose -> MatMul"):
        dequantized_by_ort(q, torch.float32, tmp_path, None)


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
# TensorRT-RTX builds every form on the CPU: signed int4 and fp8 codes for its Dequantize layer, the asymmetric
# int4 correction of standard ops beside them


rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="needs TensorRT-RTX")


@rtx
@pytest.mark.trt
@pytest.mark.parametrize("config, form", [
    (ct_int4(64), "int4 blocks of 64 along K"),
    ({**AWQ_CONFIG, "group_size": 64}, ASYMMETRIC.format(64)),
    (ct_int4(64, symmetric=False), ASYMMETRIC.format(64)),
    ({**FP8_CONFIG, "weight_block_size": [32, 32]}, "float8e4m3fn blocks of 32 along K, scales repeated over 32 rows"),
    (CT_FP8_CONFIG, "float8e4m3fn per output channel"),
], ids=["int4-sym-g64", "awq-g64", "int4-asym-g64", "fp8-block-32x32", "fp8-channel"])
def test_tensorrt_rtx_builds_the_int4_and_fp8_graphs(config, form, tmp_path):
    manifest = export(write_quantized_checkpoint(tmp_path / "q", config), tmp_path / "engine", dtype="bf16")
    assert manifest["models"]["target"]["extra"]["quantization"]["graphs"] == {"target": {form: 4 * LINEARS_PER_LAYER}}
    # no UINT4 initializer (the TensorRT-RTX parser refuses them) and no zero point
    graph = ir.load(tmp_path / "engine" / "target.onnx").graph
    assert ir.DataType.UINT4 not in {v.dtype for v in graph.initializers.values()}
    assert all(len(n.inputs) == 2 for n in graph if n.op_type == "DequantizeLinear")
    result = xcompile("build", tmp_path / "engine", "--trt", "rtx", "--compute-capability", "8.9",
                      "--max-draft-tokens", 7)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "engine" / "target.engine").stat().st_size > 0
