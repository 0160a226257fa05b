"""Quantized linear weights kept quantized in an ONNX graph: each weight initializer W [N, K] that the export
streams as a ``QWeight`` (runtime/engines/qweight.py) is replaced by standard ops over new initializers,

    codes [N, K] ──► DequantizeLinear(scale) ──► fp32 W ──► Cast(graph dtype) ──► W's consumers
                     (axis, block_size: ONNX blocked quantization, opset >= 21)   (fp32 graphs: no Cast)

so the graph's weight is the reference's fp32-dequantized weight (``QWeight.dequantize``) rounded once to the
graph's dtype: DequantizeLinear computes q * s in its scale's dtype, fp32 here, where the product of an e4m3 or
int4 code and a scale is exact for bf16/fp16 scales and correctly rounded for fp32 ones (as the reference
computes it). Opset 24's DequantizeLinear has no ``output_dtype``, hence the Cast.

The forms, by what TensorRT's Dequantize layer takes (int4 codes signed, in blocks, zero points 0 only; fp8 codes
per tensor or per channel) and ONNX Runtime's CPU kernels run (all of these):

    fp8, one scale per tensor       FLOAT8E4M3FN codes, scalar scale
    fp8, one scale per row          FLOAT8E4M3FN codes, scale [N], axis 0 (per channel)
    fp8, other blocks               FLOAT8E4M3FN codes, scale [N, ceil(K/cols)], axis 1, block_size cols; ONNX blocks
                                    one axis only, so a [rows, cols] block's scale is repeated over its rows
    int4, every zero point 8        INT4 codes (code - 8, two per byte): the symmetric form
    int4, other zero points         the same INT4 codes, and the zero points as a correction on the activation
                                    side (asymmetric: AutoAWQ, compressed-tensors with symmetric false), below
    both int4 forms: axis 1, block_size cols (the whole row for per-channel scales), rows > 1 repeated as for fp8

Asymmetric int4. TensorRT's Dequantize takes zero points of 0 only and TensorRT-RTX's parser refuses UINT4
initializers, so the zero points z leave the weight: per block (row n, group g of `cols` inputs)

    (q - z) * s = (q - 8) * s - c[n, g],   c[n, g] = (z - 8) * s          (fp32: exact for bf16/fp16 scales)
    y = x W^T   = x W8^T - sum_g (sum_{k in g} x_k) * c[n, g]              W8 = the symmetric form's weight

    x [.., K] ─► Cast fp32 ─► [Pad K to G*cols] ─► Reshape [.., G, cols] ─► ReduceSum ─► [.., G] ─► MatMul c^T [G, N]
    ─► [.., N] fp32 ─► Cast(graph dtype) ─► Sub from the MatMul over W8 (which stays DequantizeLinear ─► MatMul)

so TensorRT still sees signed INT4 codes dequantized straight into the weight's MatMul, and c^T is one fp32 value
per block (the scales' size again). In fp32 graphs this is the reference's product up to fp32 rounding; in
fp16/bf16 graphs W8 is rounded to the graph dtype instead of W, and the MatMul's output and the correction are
rounded once more before the Sub (see docs/quantization.md for the tolerance this needs).

4-bit tensors are packed two per byte, element 2i in the low nibble of byte i (ONNX's INT4 layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

from xcompile.compile.errors import CompileError
from xcompile.runtime.engines.qweight import FP8, QWeight

_SIGNED_ZERO = 8            # an int4 code minus its zero point 8 is the signed int4 value (code XOR 8 as a nibble)


@dataclass(frozen=True)
class QInitializer:
    """One initializer the rewrite added, not yet registered in the graph: its value (the caller writes ``data``,
    points ``value.const_value`` at it and registers it) and its bytes."""

    value: ir.Value
    data: bytes


@dataclass(frozen=True)
class Form:
    """How one ``QWeight`` is written: a label for the manifest, DequantizeLinear's attributes and inputs, and for
    asymmetric int4 the zero points' correction c = (z - 8) * s [N, ceil(K/cols)] fp32 (None otherwise)."""

    label: str
    attrs: dict
    scale: torch.Tensor
    codes: torch.Tensor             # float8 (fp8), or uint8 4-bit values of the signed codes (int4, packed later)
    correction: torch.Tensor | None = None


def _pack_nibbles(values: torch.Tensor) -> bytes:
    """uint8 values 0..15, any shape -> ONNX's 4-bit layout: element 2i in the low nibble of byte i."""
    flat = values.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return (flat[0::2] | (flat[1::2] << 4)).numpy().tobytes()


def _per_row(grid: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """Per-block values [ceil(N/rows), G] repeated over each block's rows: [N, G] (ONNX blocks one axis)."""
    return grid.repeat_interleave(rows, 0)[:n].contiguous()


def form(q: QWeight) -> Form:
    """The form ``q`` is written in (the module docstring's table)."""
    n, k = q.shape
    rows, cols = q.block
    grid_n, grid_k = q.scale.shape
    if q.kind == FP8:
        if grid_n == 1 and grid_k == 1:
            return Form("float8e4m3fn per tensor", {}, q.scale.reshape(()), q.codes)
        if rows == 1 and grid_k == 1:
            return Form("float8e4m3fn per output channel", {"axis": 0}, q.scale.reshape(n), q.codes)
        block = min(cols, k)
        label = f"float8e4m3fn blocks of {block} along K" + (f", scales repeated over {rows} rows" if rows > 1 else "")
        return Form(label, {"axis": 1, "block_size": block}, _per_row(q.scale, rows, n), q.codes)
    block = min(cols, k)
    repeated = f", scales repeated over {rows} rows" if rows > 1 else ""
    attrs, scale, signed = {"axis": 1, "block_size": block}, _per_row(q.scale, rows, n), q.codes ^ _SIGNED_ZERO
    if bool((q.zero == _SIGNED_ZERO).all()):
        return Form(f"int4 blocks of {block} along K{repeated}", attrs, scale, signed)
    correction = _per_row((q.zero.float() - _SIGNED_ZERO) * q.scale, rows, n)
    return Form(f"int4 blocks of {block} along K, zero points subtracted on x's group sums{repeated}", attrs, scale,
                signed, correction)


def replace_weight(graph: ir.Graph, weight: ir.Value, q: QWeight) -> tuple[str, list[QInitializer]]:
    """Replace initializer ``weight`` [N, K] (graph dtype) of ``graph`` by DequantizeLinear (+ Cast) over new
    initializers holding ``q`` (asymmetric int4: and a correction after its MatMul); returns the form's label and
    the new initializers with their bytes."""
    name = weight.name
    f = form(q)
    matmul = _matmul_of(weight) if f.correction is not None else None
    code_type, code_bytes = ((ir.DataType.FLOAT8E4M3FN, f.codes.contiguous().view(torch.uint8).numpy().tobytes())
                             if q.kind == FP8 else (ir.DataType.INT4, _pack_nibbles(f.codes)))
    added = [_initializer(f"{name}_quantized", code_type, q.shape, code_bytes),
             _initializer(f"{name}_scale", ir.DataType.FLOAT, tuple(f.scale.shape),
                          f.scale.float().contiguous().numpy().tobytes())]
    dq = ir.node("DequantizeLinear", [a.value for a in added], f.attrs,
                 outputs=[ir.Value(name=f"{name}_dequantized", shape=ir.Shape(q.shape),
                                   type=ir.TensorType(ir.DataType.FLOAT))])
    nodes, out = [dq], dq.outputs[0]
    if weight.dtype != ir.DataType.FLOAT:
        nodes.append(_cast(out, weight.dtype, f"{name}_cast"))
        out = nodes[-1].outputs[0]
    weight.replace_all_uses_with(out)
    graph.insert_before(graph.node(0), nodes)
    del graph.initializers[name]
    if matmul is not None:
        added.append(_subtract_correction(graph, matmul, name, f.correction, min(q.block[1], q.shape[1])))
    return f.label, added


def _matmul_of(weight: ir.Value) -> ir.Node:
    """The MatMul(x, Transpose(weight)) that is ``weight``'s one use (how the export traces a linear)."""
    uses = list(weight.uses())
    transpose = uses[0].node if len(uses) == 1 else None
    if transpose is None or transpose.op_type != "Transpose" or tuple(transpose.attributes.get_ints("perm")) != (1, 0):
        raise CompileError(f"{weight.name}: asymmetric int4 needs the weight's one use to be Transpose -> MatMul "
                           f"(a linear), got {[u.node.op_type for u in uses]}")
    after = list(transpose.outputs[0].uses())
    if len(after) != 1 or after[0].node.op_type != "MatMul" or after[0].idx != 1:
        raise CompileError(f"{weight.name}: asymmetric int4 needs the transposed weight to be the right input of "
                           f"one MatMul, got {[(u.node.op_type, u.idx) for u in after]}")
    return after[0].node


def _subtract_correction(graph: ir.Graph, matmul: ir.Node, name: str, correction: torch.Tensor,
                         cols: int) -> QInitializer:
    """y = MatMul(x, W8^T) -> y - (x's sums over each group of ``cols`` inputs) @ c^T, inserted after ``matmul``;
    returns c^T's initializer [G, N] fp32."""
    x, y = matmul.inputs[0], matmul.outputs[0]
    assert x.shape is not None, f"{name}: the traced graph gives x's shape"
    n, groups = correction.shape
    k, rank, lead = x.shape[-1], len(x.shape), list(x.shape.dims[:-1])
    c_t = _initializer(f"{name}_zero_correction", ir.DataType.FLOAT, (groups, n),
                       correction.t().contiguous().numpy().tobytes())
    fp32 = lambda suffix, shape: ir.Value(name=f"{name}_{suffix}", shape=ir.Shape(shape),  # noqa: E731
                                          type=ir.TensorType(ir.DataType.FLOAT))
    nodes, xf = [], x
    if x.dtype != ir.DataType.FLOAT:
        nodes.append(_cast(x, ir.DataType.FLOAT, f"{name}_x_fp32"))
        xf = nodes[-1].outputs[0]
    if groups * cols != k:      # a partial last group: zeros add nothing to its sum
        pads = [0] * (2 * rank)
        pads[-1] = groups * cols - k
        nodes.append(ir.node("Pad", [xf, _constant(graph, f"{name}_x_pads", pads)],
                             outputs=[fp32("x_padded", [*lead, groups * cols])]))
        xf = nodes[-1].outputs[0]
    # Reshape's 0 keeps the input's dim: the leading (batch, tokens) dims stay symbolic
    nodes.append(ir.node("Reshape", [xf, _constant(graph, f"{name}_x_group_shape", [0] * (rank - 1) + [groups, cols])],
                         outputs=[fp32("x_groups", [*lead, groups, cols])]))
    nodes.append(ir.node("ReduceSum", [nodes[-1].outputs[0], _constant(graph, f"{name}_x_group_axis", [-1])],
                         {"keepdims": 0}, outputs=[fp32("x_group_sums", [*lead, groups])]))
    nodes.append(ir.node("MatMul", [nodes[-1].outputs[0], c_t.value], outputs=[fp32("zero_term", [*lead, n])]))
    term = nodes[-1].outputs[0]
    if y.dtype != ir.DataType.FLOAT:
        nodes.append(_cast(term, y.dtype, f"{name}_zero_term_cast"))
        term = nodes[-1].outputs[0]
    corrected = ir.Value(name=f"{name}_matmul_corrected", shape=y.shape, type=ir.TensorType(y.dtype))
    y.replace_all_uses_with(corrected, replace_graph_outputs=True)
    nodes.append(ir.node("Sub", [y, term], outputs=[corrected]))
    graph.insert_after(matmul, nodes)
    return c_t


def _cast(value: ir.Value, dtype: ir.DataType, name: str) -> ir.Node:
    return ir.node("Cast", [value], {"to": dtype},
                   outputs=[ir.Value(name=name, shape=value.shape, type=ir.TensorType(dtype))])


def _constant(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    """A small int64 1-D initializer of ``graph``, held in the .onnx itself (not in the data file)."""
    value = ir.Value(name=name, shape=ir.Shape([len(values)]), type=ir.TensorType(ir.DataType.INT64),
                     const_value=ir.tensor(np.array(values, dtype=np.int64), name=name))
    graph.register_initializer(value)
    return value


def _initializer(name: str, dtype: ir.DataType, shape: tuple[int, ...], data: bytes) -> QInitializer:
    return QInitializer(ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype)), data)
