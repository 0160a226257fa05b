"""ONNX export of the I/O contract's graphs: opset 24, static KV cache updated in place.

I/O (runtime/enginedir/contract.py is the source of truth; names, dtypes and order come from it):

    graph      inputs                                            outputs
    target     input_ids [B,S] i64, position_ids [B,S] i64,     logits [B,R,V], hidden_taps [B,S,3H or 4H],
               write_index [B] i64, tree_mask [B,S,S] bool,     present_key_i / present_value_i
               logit_rows [B,R] i64,                              (alias past_key_i / past_value_i)
               past_key_i / past_value_i [B,Hkv,S_max,D]
    draft      as target, without hidden_taps                   logits [B,R,V], present_*
    eagle3     input_ids, hidden_states [B,S,H], position_ids,  logits [B,R,V_draft], hidden_out [B,S,H],
               write_index, tree_mask [B,S,W], logit_rows,       present_key_0, present_value_0
               past_key_0, past_value_0
    eagle3_fc  hidden_taps [B,S,3H]                              hidden_states [B,S,H]
    mtp        as eagle3 (hidden: the target's last layer)       logits [B,R,V], hidden_out [B,S,H], present_*

Only S (``tokens``), R (``rows``) and the eagle3 / mtp mask's W (``mask_keys``) are dynamic; B = max_batch and S_max = max_seq_len are fixed
per engine. Floating tensors have the graph's dtype (fp32, fp16 or bf16; TensorRT 11 is strongly
typed, so the ONNX precision is the engine's). The KV write is TensorScatter, attention is
Attention with an explicit boolean mask, RoPE is RotaryEmbedding, norms are RMSNormalization
(compile/models/layers.py emits them while ``torch.onnx.is_in_onnx_export()``).

Weights never pass through the exporter twice: the module may live on the meta device; the graph
is traced with ``optimize=False`` (constant folding would rename and transpose weights), then each
initializer is written to ``<graph>.onnx.data`` one tensor at a time from a ``(name, tensor)``
stream (a checkpoint, a synthetic generator or a module's own state). Peak memory is the traced
graph plus the largest tensor: a Qwen3-8B bf16 target + EAGLE3 head from synthetic weights peaks
at 5.4 GB RSS and takes 3.5-4.5 min on 2 cores (benchmarks/export_8b.py).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
import torch
from torch import nn

from xcompile.compile import qdq
from xcompile.compile.errors import CompileError
from xcompile.compile.models.layers import ONNX_OPSET, Rotary
from xcompile.runtime.enginedir import integrity
from xcompile.runtime.enginedir.contract import CONTRACT_VERSION, DYNAMIC_DIMS, MODEL_DTYPE, GraphSpec
from xcompile.runtime.engines.base import DTYPE_NAMES, TORCH_DTYPES
from xcompile.runtime.engines.qweight import QWeight

# contract dtype name -> ONNX IR dtype, and IR dtype -> torch dtype (what a weight is written as)
_IR_DTYPES = {"float32": ir.DataType.FLOAT, "float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16,
              "int64": ir.DataType.INT64, "bool": ir.DataType.BOOL}
_TORCH_OF_IR = {ir_dtype: TORCH_DTYPES[name] for name, ir_dtype in _IR_DTYPES.items()}

# Example sizes for tracing. torch.export specialises dims of size 0/1, and a dim whose example
# equals another's may be unified with it, so the dynamic dims get distinct sizes >= 2.
_EXAMPLE = {"tokens": 5, "rows": 3, "mask_keys": 7}
# Offsets in the data file: 64 B for every tensor (SIMD loads), 64 KiB for tensors over 1 MiB so
# that runtimes may mmap them page-aligned (the layout onnx_ir used by default before 1.1).
_ALIGN, _ALIGN_LARGE, _LARGE = 64, 1 << 16, 1 << 20

Weights = Iterable[tuple[str, torch.Tensor | QWeight]]     # a QWeight: a quantized linear, kept quantized


@dataclass(frozen=True)
class ExportedGraph:
    """What the manifest records about one written graph."""

    graph: str
    onnx: Path
    spec: GraphSpec
    dims: dict
    onnx_record: dict           # size and hashes of the .onnx file (runtime/enginedir/integrity.py)
    data_record: dict           # of its external data; the .onnx embeds the data's sha256 as metadata
    quantized: dict[str, int]   # quantized form (compile/qdq.py's label) -> how many weights it holds in it


def module_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a module exports in: its parameters'."""
    return next(module.parameters()).dtype


def example_inputs(spec: GraphSpec, dims: dict, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One tensor per contract input: ids 0, positions 0..S-1, a causal tree mask, rows 0..R-1."""
    sizes = {**dims, **_EXAMPLE}
    out = []
    for t in spec.inputs:
        shape = tuple(sizes[d] for d in t.shape)
        if t.name == "tree_mask":
            x = torch.ones(shape, dtype=torch.bool, device=device).tril(shape[2] - shape[1])
        elif t.name in ("position_ids", "logit_rows"):
            x = torch.arange(shape[1], device=device).expand(shape).contiguous()
        elif t.dtype == "int64":
            x = torch.zeros(shape, dtype=torch.int64, device=device)
        else:
            x = torch.zeros(shape, dtype=dtype, device=device)
        out.append(x)
    return tuple(out)


def dynamic_shapes(module: nn.Module, spec: GraphSpec, max_seq_len: int) -> tuple:
    """``dynamic_shapes`` for torch.export: one shared Dim per dynamic contract dim (``tokens``,
    ``rows``, ``mask_keys``), every other axis static. Trailing KV inputs of a ``*kv`` forward are grouped as one tuple."""
    named = {d: torch.export.Dim(d, min=1, max=max_seq_len) for d in DYNAMIC_DIMS}
    per_input = [{i: named[d] for i, d in enumerate(t.shape) if d in named} for t in spec.inputs]
    params = list(inspect.signature(module.forward).parameters.values())
    if params and params[-1].kind is inspect.Parameter.VAR_POSITIONAL:
        fixed = len(params) - 1
        return (*per_input[:fixed], tuple(per_input[fixed:]))
    return tuple(per_input)


def trace(module: nn.Module, spec: GraphSpec, dims: dict, max_tokens: int) -> ir.Model:
    """torch.onnx.export (dynamo, opset 24, unoptimised) -> onnx_ir model, names from the contract."""
    _untouched_cpu_storage(module)
    args = example_inputs(spec, dims, module_dtype(module), next(module.parameters()).device)
    log = logging.getLogger("torch.onnx")
    level = log.level
    with warnings.catch_warnings():
        # the exporter's FutureWarnings and "torchvision is not installed" notes are not ours to fix
        warnings.simplefilter("ignore")
        log.setLevel(logging.ERROR)
        try:
            program = torch.onnx.export(
                module.eval(), args, dynamo=True, opset_version=ONNX_OPSET, optimize=False, verbose=False,
                input_names=spec.input_names, output_names=spec.output_names,
                dynamic_shapes=dynamic_shapes(module, spec, max_tokens),
            )
        except Exception as e:   # the exporter raises many types; report one line, keep the cause chained
            raise CompileError(f"{spec.graph}: torch.onnx.export failed: {str(e).splitlines()[0]}") from e
        finally:
            log.setLevel(level)
    model = program.model
    check_io(model, spec, module_dtype(module))
    ops = {n.op_type for n in model.graph}
    if spec.num_layers and not {"TensorScatter", "Attention", "RotaryEmbedding"} <= ops:
        # torch.onnx.export falls back to dynamo tracing when non-strict torch.export fails, and
        # dynamo takes the eager branches of layers.py: a valid graph, but no in-place KV cache
        raise CompileError(f"{spec.graph}: the exported graph lacks TensorScatter/Attention/RotaryEmbedding: "
                           "non-strict torch.export failed and the exporter fell back to dynamo, which traced "
                           "the eager path; torch.export.export(module, ..., strict=False) shows why")
    return model


def _untouched_cpu_storage(module: nn.Module) -> None:
    """Give a meta-device module uncommitted cpu storage, in place, keeping tied tensors tied.

    The fake impl of torch.onnx.ops.symbolic (our TensorScatter) allocates on cpu, and a cpu KV
    next to meta queries fails non-strict tracing (the exporter then falls back to dynamo, which
    traces the eager branches). Tracing never reads a weight, so empty cpu tensors cost address
    space only, no committed page (8B bf16: RSS ~1 GB). ``nn.Module.to_empty`` would untie weights.
    """
    owners: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str]]]] = {}
    for mod in module.modules():
        for attr, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            owners.setdefault(id(t), (t, []))[1].append((mod, attr))
    for t, places in owners.values():
        if t.is_meta:
            new = torch.empty_like(t, device="cpu")
            new = nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new
            for mod, attr in places:
                setattr(mod, attr, new)


def check_io(model: ir.Model, spec: GraphSpec, dtype: torch.dtype) -> None:
    """The traced graph's I/O names, dtypes and dynamic axes must equal the contract's."""
    model_dtype = _IR_DTYPES[DTYPE_NAMES[dtype]]
    sides = (("input", model.graph.inputs, spec.inputs), ("output", model.graph.outputs, spec.outputs))
    for kind, values, tensors in sides:
        got = [(v.name, v.dtype) for v in values]
        want = [(t.name, model_dtype if t.dtype == MODEL_DTYPE else _IR_DTYPES[t.dtype]) for t in tensors]
        if got != want:
            raise CompileError(f"{spec.graph}: exported {kind}s {got} differ from the contract's {want}")
        for v, t in zip(values, tensors):
            dynamic = [str(d) for d in v.shape if not isinstance(d, int)]
            if dynamic != [d for d in t.shape if d in DYNAMIC_DIMS]:
                raise CompileError(f"{spec.graph}: {kind} {v.name} has shape {v.shape}, contract {t.shape}")


# --------------------------------------------------------------------------------------------
# weights


def _canonical_names(module: nn.Module) -> dict[str, str]:
    """Every parameter/buffer name -> the first name of the same tensor (tied embeddings, the
    rotary tables shared by all layers)."""
    first: dict[int, str] = {}
    names = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names[name] = first.setdefault(id(t), name)
    return names


def computed_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Non-persistent buffers (RoPE cos/sin), recomputed so a meta-device module exports too."""
    for prefix, sub in module.named_modules():
        if isinstance(sub, Rotary):
            cos, sin = sub.computed_tables()
            yield f"{prefix}.cos", cos.to(sub.cos.dtype)
            yield f"{prefix}.sin", sin.to(sub.sin.dtype)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_weights(model: ir.Model, module: nn.Module, data_path: Path, weights: Weights) -> tuple[dict, dict[str, int]]:
    """Write every initializer of ``model`` into ``data_path`` from the ``(name, tensor)`` stream
    (names are ``module``'s parameter names; unused ones are skipped), one tensor at a time, and
    point the initializers at it. A stream item whose value is a ``QWeight`` (a quantized linear) replaces its
    initializer by DequantizeLinear over its codes and scales (compile/qdq.py; asymmetric int4 adds a
    zero-point correction after the linear's MatMul), written instead.
    Returns the data file's record (size and hashes, runtime/enginedir/integrity.py) and how many weights were
    written in each quantized form (compile/qdq.py's labels)."""
    canonical = _canonical_names(module)
    # initializers are named after one alias of their tensor; key them by the canonical name
    pending = {canonical.get(n, n): v for n, v in model.graph.initializers.items()}
    unknown = [n for n in pending if n not in canonical]
    if unknown:
        raise CompileError(f"{data_path.name}: graph constants {unknown[:3]} are not parameters of "
                           f"{type(module).__name__}; was the graph traced with optimize=True?")
    digest, offset, forms = integrity.Digest(), 0, {}
    with open(data_path, "wb") as f:

        def write(value: ir.Value, data: memoryview | bytes, dtype: ir.DataType, shape: ir.Shape) -> None:
            nonlocal offset
            pad = -offset % (_ALIGN_LARGE if len(data) > _LARGE else _ALIGN)
            f.write(b"\0" * pad)
            digest.update(b"\0" * pad)
            offset += pad
            f.write(data)
            digest.update(data)
            value.const_value = ir.ExternalTensor(data_path.name, offset, len(data), dtype, shape=shape,
                                                  name=value.name, base_dir=data_path.parent)
            offset += len(data)

        for name, tensor in itertools.chain(weights, computed_buffers(module)):
            # names outside this graph (the head's fc in the eagle3 step, d2t, aliases) are skipped
            value = pending.pop(canonical.get(name, name), None)
            if value is None:
                continue
            want = value.const_value
            if tuple(tensor.shape) != tuple(want.shape):
                raise CompileError(f"{data_path.name}: weight {name!r} has shape {tuple(tensor.shape)}, "
                                   f"the graph expects {tuple(want.shape)}")
            if isinstance(tensor, QWeight):
                label, added = qdq.replace_weight(model.graph, value, tensor)
                forms[label] = forms.get(label, 0) + 1
                for q in added:
                    write(q.value, q.data, q.value.dtype, q.value.shape)
                    model.graph.register_initializer(q.value)
                continue
            write(value, _tensor_bytes(tensor.to(_TORCH_OF_IR[want.dtype])), want.dtype, want.shape)
    if pending:
        raise CompileError(f"{data_path.name}: no weight given for {sorted(pending)[:5]} "
                           f"({len(pending)} missing); the checkpoint does not fill this graph")
    return digest.record(), forms


def export_graph(module: nn.Module, path: Path, *, max_tokens: int, weights: Weights | None = None,
                 max_batch: int = 1) -> ExportedGraph:
    """Export ``module`` (Qwen3 -> target/draft, Eagle3 -> eagle3, Eagle3FC -> eagle3_fc) to
    ``path`` (+ ``path.data``) in the module's dtype; ``tokens`` and ``rows`` range over 1..max_tokens.

    ``module`` may be on the meta device; then ``weights`` must stream every parameter the graph
    uses. Without ``weights`` the module's own parameters are written.
    """
    path = Path(path)
    spec, dims = module.graph_spec(), module.graph_dims(max_batch)     # the model family says which graph
    if weights is None:
        if any(t.is_meta for t in module.state_dict().values()):
            raise CompileError(f"{path.name}: a meta-device module needs a weight stream")
        weights = module.named_parameters()
    model = trace(module, spec, dims, max_tokens)
    data_path = path.with_name(path.name + ".data")
    data, quantized = write_weights(model, module, data_path, weights)
    model.metadata_props.update({"xcompile.graph": spec.graph, "xcompile.contract_version": str(CONTRACT_VERSION),
                                 "xcompile.external_data_sha256": data["sha256"]})
    model.producer_name = "xcompile"
    ir.save(model, path)
    return ExportedGraph(spec.graph, path, spec, dims, integrity.record_file(path), data, quantized)
