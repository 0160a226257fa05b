"""Quantized linear weights kept quantized in an ONNX graph: each weight initializer W [N, K] that the export
streams as a ``QWeight`` (runtime/engines/qweight.py) is replaced by standard ops over new initializers,

    codes [N, K] ──► DequantizeLinear(scale, [zero point]) ──► fp32 W ──► Cast(graph dtype) ──► W's consumers
                     (axis, block_size: ONNX blocked quantization, opset >= 21)            (fp32 graphs: no Cast)

so the graph's weight is the reference's fp32-dequantized weight (``QWeight.dequantize``) rounded once to the
graph's dtype: DequantizeLinear computes (q - z) * s in its scale's dtype, fp32 here, where the product of an
e4m3 or int4 code and a scale is exact for bf16/fp16 scales and correctly rounded for fp32 ones (as the
reference computes it). Opset 24's DequantizeLinear has no ``output_dtype``, hence the Cast.

The forms, by what TensorRT's Dequantize layer takes (int4 codes signed and symmetric, in blocks; fp8 codes per
tensor or per channel) and ONNX Runtime's CPU kernels run (all of these):

    fp8, one scale per tensor       FLOAT8E4M3FN codes, scalar scale
    fp8, one scale per row          FLOAT8E4M3FN codes, scale [N], axis 0 (per channel)
    fp8, other blocks               FLOAT8E4M3FN codes, scale [N, ceil(K/cols)], axis 1, block_size cols; ONNX blocks
                                    one axis only, so a [rows, cols] block's scale is repeated over its rows
    int4, every zero point 8        INT4 codes (code - 8, two per byte), no zero point: the symmetric form
    int4, other zero points         UINT4 codes and UINT4 zero points [N, ceil(K/cols)] (asymmetric, AWQ): ONNX
                                    Runtime runs it; TensorRT takes zero points of 0 only
    both int4 forms: axis 1, block_size cols (the whole row for per-channel scales), rows > 1 repeated as for fp8

4-bit tensors are packed two per byte, element 2i in the low nibble of byte i (ONNX's INT4/UINT4 layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
import torch

from xcompile.runtime.engines.qweight import FP8, QWeight

_SIGNED_ZERO = 8            # an int4 code minus its zero point 8 is the signed int4 value (code XOR 8 as a nibble)


@dataclass(frozen=True)
class QInitializer:
    """One initializer the rewrite added, not yet registered in the graph: its value (the caller writes ``data``,
    points ``value.const_value`` at it and registers it) and its bytes."""

    value: ir.Value
    data: bytes


def _pack_nibbles(values: torch.Tensor) -> bytes:
    """uint8 values 0..15, any shape -> ONNX's 4-bit layout: element 2i in the low nibble of byte i."""
    flat = values.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return (flat[0::2] | (flat[1::2] << 4)).numpy().tobytes()


def _per_row(grid: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """Per-block values [ceil(N/rows), G] repeated over each block's rows: [N, G] (ONNX blocks one axis)."""
    return grid.repeat_interleave(rows, 0)[:n].contiguous()


def form(q: QWeight) -> tuple[str, dict, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(a label for the manifest, DequantizeLinear's attributes, scale, zero point or None, codes) of ``q``,
    codes as uint8 4-bit values for int4 (packed by the caller) and float8 for fp8."""
    n, k = q.shape
    rows, cols = q.block
    grid_n, grid_k = q.scale.shape
    if q.kind == FP8:
        if grid_n == 1 and grid_k == 1:
            return "float8e4m3fn per tensor", {}, q.scale.reshape(()), None, q.codes
        if rows == 1 and grid_k == 1:
            return "float8e4m3fn per output channel", {"axis": 0}, q.scale.reshape(n), None, q.codes
        block = min(cols, k)
        label = f"float8e4m3fn blocks of {block} along K" + (f", scales repeated over {rows} rows" if rows > 1 else "")
        return label, {"axis": 1, "block_size": block}, _per_row(q.scale, rows, n), None, q.codes
    block = min(cols, k)
    repeated = f", scales repeated over {rows} rows" if rows > 1 else ""
    attrs = {"axis": 1, "block_size": block}
    if bool((q.zero == _SIGNED_ZERO).all()):
        return f"int4 blocks of {block} along K{repeated}", attrs, _per_row(q.scale, rows, n), None, \
            q.codes ^ _SIGNED_ZERO
    return (f"uint4 blocks of {block} along K with zero points{repeated}", attrs, _per_row(q.scale, rows, n),
            _per_row(q.zero, rows, n), q.codes)


def replace_weight(graph: ir.Graph, weight: ir.Value, q: QWeight) -> tuple[str, list[QInitializer]]:
    """Replace initializer ``weight`` [N, K] (graph dtype) of ``graph`` by DequantizeLinear (+ Cast) over new
    initializers holding ``q``; returns the form's label and the new initializers with their bytes."""
    name = weight.name
    label, attrs, scale, zero, codes = form(q)
    signed = label.startswith("int4")
    code_type = ir.DataType.FLOAT8E4M3FN if q.kind == FP8 else ir.DataType.INT4 if signed else ir.DataType.UINT4
    code_bytes = (codes.contiguous().view(torch.uint8).numpy().tobytes() if q.kind == FP8 else _pack_nibbles(codes))
    added = [_initializer(f"{name}_quantized", code_type, q.shape, code_bytes),
             _initializer(f"{name}_scale", ir.DataType.FLOAT, tuple(scale.shape),
                          scale.float().contiguous().numpy().tobytes())]
    if zero is not None:
        added.append(_initializer(f"{name}_zero_point", ir.DataType.UINT4, tuple(zero.shape),
                                  _pack_nibbles(zero)))
    dq = ir.node("DequantizeLinear", [a.value for a in added], attrs,
                 outputs=[ir.Value(name=f"{name}_dequantized", shape=ir.Shape(q.shape),
                                   type=ir.TensorType(ir.DataType.FLOAT))])
    nodes, out = [dq], dq.outputs[0]
    if weight.dtype != ir.DataType.FLOAT:
        cast = ir.node("Cast", [out], {"to": weight.dtype},
                       outputs=[ir.Value(name=f"{name}_cast", shape=ir.Shape(q.shape), type=ir.TensorType(weight.dtype))])
        nodes.append(cast)
        out = cast.outputs[0]
    weight.replace_all_uses_with(out)
    graph.insert_before(graph.node(0), nodes)
    del graph.initializers[name]
    return label, added


def _initializer(name: str, dtype: ir.DataType, shape: tuple[int, ...], data: bytes) -> QInitializer:
    return QInitializer(ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype)), data)
