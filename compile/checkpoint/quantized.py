"""Quantized linear weights in the key map: a linear stored as codes and scales (and zero points) becomes one
``Packed`` entry of the key map, read into the canonical form of runtime/engines/qweight.py and dequantized
from it, one linear at a time, so an 8B checkpoint still streams in 24 GB of RAM. The formats and their
fields are in compile/quantization.py.

The arithmetic runs in fp32, as transformers and compressed-tensors dequantize, and the weight source
rounds the result once to the model's dtype: (q - z) * s is exact in fp32 for int4 codes with fp16 or bf16
scales, and so is an e4m3 code times a bf16 scale; with fp32 scales it is fp32's correctly rounded product.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from xcompile.compile.checkpoint.files import Checkpoint
from xcompile.compile.checkpoint.keymap import module_state
from xcompile.compile.errors import CompileError
from xcompile.compile.models.keymap import KeyMap, Packed, Reader, Stored
from xcompile.compile.quantization import AWQ_GEMM, CT_FLOAT, CT_PACKED, FP8_BLOCK, Quantization, WeightScheme
from xcompile.runtime.engines.qweight import FP8, INT4, QWeight

Fail = Callable[[str, str], CompileError]       # (checkpoint key, why) -> the error naming its file
Where = Callable[[str], str]                    # checkpoint key -> the file that holds it

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_E4M3 = (torch.float8_e4m3fn,)
_INT32 = (torch.int32,)
# AutoAWQ's WQLinear_GEMM.from_linear writes column 8c + AWQ_ORDER[i] of a group of eight into bits 4i..4i+3
# of word c (AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]); column 8c + j is therefore nibble AWQ_REVERSE_ORDER[j]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
_NIBBLES = torch.arange(0, 32, 4, dtype=torch.int32)


def linear_weights(key_map: KeyMap, model: nn.Module) -> list[tuple[str, str]]:
    """(state name, checkpoint module name) of every linear layer's own weight in ``key_map`` (a tied output
    projection is the embedding's, not a weight of its own)."""
    found = []
    for module, mod in model.named_modules():
        key = key_map.tensors.get(f"{module}.weight", "")
        if isinstance(mod, nn.Linear) and key.endswith(".weight"):
            found.append((f"{module}.weight", key.removesuffix(".weight")))
    return found


def quantized_key_map(key_map: KeyMap, q: Quantization, model: nn.Module, checkpoint: Checkpoint) -> KeyMap:
    """``key_map`` with every linear weight that ``q`` quantizes read from its stored tensors and dequantized."""
    def fail(key: str, why: str) -> CompileError:
        where = checkpoint.file(key) if key in checkpoint else checkpoint.path
        return CompileError(f"{where}: tensor '{key}': {why} ({q.config})")

    state = module_state(model)
    tensors, packed = dict(key_map.tensors), dict(key_map.packed)
    for name, module in linear_weights(key_map, model):
        scheme = q.scheme_for(module)
        if scheme is not None:
            packed[name] = _LAYOUTS[scheme.layout](module, scheme, tuple(state[name].shape), fail)
            del tensors[name]
    return replace(key_map, tensors=tensors, packed=packed)


def _scales(read: Reader, where: Where, key: str) -> torch.Tensor:
    """A scale tensor; a NaN, Inf or zero scale makes its whole block NaN or zero: refused by name."""
    s = read(key)
    bad = ~torch.isfinite(s) | (s == 0)
    if bool(bad.any()):
        kind = "NaN/Inf" if not bool(torch.isfinite(s).all()) else "zero"
        raise CompileError(f"{where(key)}: tensor '{key}' holds {int(bad.sum())} {kind} scale(s) of {s.numel()}; "
                           "every block needs a finite, non-zero scale: the checkpoint is corrupt")
    return s


def _e4m3_codes(read: Reader, where: Where, key: str) -> torch.Tensor:
    """float8 e4m3 codes; a NaN code (bytes 0x7F, 0xFF: no quantizer writes them) is refused by name."""
    q = read(key)
    nan = (q.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        raise CompileError(f"{where(key)}: tensor '{key}' holds {int(nan.sum())} NaN code(s) of {q.numel()}; "
                           "a quantized weight has finite codes only: the checkpoint is corrupt")
    return q


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [R, W] -> their eight 4-bit fields, lowest bits first, as [R, 8W] unsigned values."""
    return ((packed.unsqueeze(-1) >> _NIBBLES) & 0xF).reshape(packed.shape[0], -1)


def _group(module: str, scheme: WeightScheme, k: int, key: str, fail: Fail) -> int:
    """The group width along the input (the whole row for per-channel scales); it must divide K."""
    g = scheme.block[1] or k
    if k % g:
        raise fail(key, f"group_size {g} does not divide the {k} input features of {module}; groups must tile a row")
    return g


def _fp8_block(module: str, scheme: WeightScheme, shape: tuple[int, int], fail: Fail) -> Packed:
    """quant_method fp8: weight e4m3 [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)]; w = q * s per block."""
    (n, k), (bn, bk) = shape, scheme.block
    weight = Stored(f"{module}.weight", (n, k), _E4M3, f"the float8 codes of {module}")
    scale = Stored(f"{module}.weight_scale_inv", (-(-n // bn), -(-k // bk)), _FLOATS,
                   f"one scale per [{bn}, {bk}] block of the [{n}, {k}] weight, partial blocks at the edges")

    def quantized(read: Reader, where: Where) -> QWeight:
        return QWeight(FP8, _e4m3_codes(read, where, weight.key), _scales(read, where, scale.key).float(), (bn, bk))
    return Packed((weight, scale), quantized)


def _awq_gemm(module: str, scheme: WeightScheme, shape: tuple[int, int], fail: Fail) -> Packed:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N]; w[n, k] = (q - z) * s of k's group."""
    n, k = shape
    if n % 8:
        raise fail(f"{module}.qweight", f"AWQ packs 8 output features per int32, and {module} has {n}")
    g = _group(module, scheme, k, f"{module}.scales", fail)
    qweight = Stored(f"{module}.qweight", (k, n // 8), _INT32, f"int4 codes of the [{n}, {k}] weight, 8 per int32")
    qzeros = Stored(f"{module}.qzeros", (k // g, n // 8), _INT32, f"int4 zero points per group of {g} inputs")
    scales = Stored(f"{module}.scales", (k // g, n), _FLOATS, f"one scale per group of {g} inputs")

    def quantized(read: Reader, where: Where) -> QWeight:
        q = _unpack_int4(read(qweight.key))[:, _awq_order(n)]          # [K, N]
        z = _unpack_int4(read(qzeros.key))[:, _awq_order(n)]           # [K/g, N]
        s = _scales(read, where, scales.key)                           # [K/g, N]
        return QWeight(INT4, _u8(q.T), s.T.float().contiguous(), (1, g), _u8(z.T))
    return Packed((qweight, qzeros, scales), quantized)


def _u8(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.uint8).contiguous()


def _awq_order(n: int) -> torch.Tensor:
    """Column j of the unpacked nibbles of AutoAWQ's words, for each output feature j < n."""
    return (torch.arange(0, n, 8).unsqueeze(1) + torch.tensor(AWQ_REVERSE_ORDER)).reshape(-1)


def _ct_float(module: str, scheme: WeightScheme, shape: tuple[int, int], fail: Fail) -> Packed:
    """compressed-tensors float-quantized: weight e4m3 [N, K] and weight_scale per tensor [1], per channel
    [N, 1], per group [N, K/g] or per block [ceil(N/bn), ceil(K/bk)]; w = q * s."""
    (n, k), (bn, bk) = shape, scheme.block
    if bn == 1 and bk:                              # groups must divide K (compressed-tensors' _process_group)
        _group(module, scheme, k, f"{module}.weight_scale", fail)
    grid = (-(-n // (bn or n)), -(-k // (bk or k)))
    weight = Stored(f"{module}.weight", (n, k), _E4M3, f"the float8 codes of {module}")
    scale = Stored(f"{module}.weight_scale", (1,) if grid == (1, 1) and not bn else grid, _FLOATS,
                   f"one scale per [{bn or n}, {bk or k}] block of the [{n}, {k}] weight")

    def quantized(read: Reader, where: Where) -> QWeight:
        s = _scales(read, where, scale.key).reshape(grid)
        return QWeight(FP8, _e4m3_codes(read, where, weight.key), s.float(), (bn or n, bk or k))
    return Packed((weight, scale), quantized)


def _ct_packed(module: str, scheme: WeightScheme, shape: tuple[int, int], fail: Fail) -> Packed:
    """compressed-tensors pack-quantized int4: weight_packed [N, ceil(K/8)] (value + 8, element i in bits
    4(i % 8).. of word i // 8), weight_scale [N, K/g], weight_shape [N, K], and when asymmetric
    weight_zero_point [ceil(N/8), K/g] packed the same way along N; w = (q - z) * s."""
    n, k = shape
    g = _group(module, scheme, k, f"{module}.weight_scale", fail)
    packed = Stored(f"{module}.weight_packed", (n, -(-k // 8)), _INT32, f"int4 codes of the [{n}, {k}] weight")
    scale = Stored(f"{module}.weight_scale", (n, k // g), _FLOATS, f"one scale per group of {g} inputs")
    size = Stored(f"{module}.weight_shape", (2,), (torch.int64, torch.int32), "the weight's [N, K]")
    zero = Stored(f"{module}.weight_zero_point", (-(-n // 8), k // g), _INT32, "int4 zero points, 8 rows per int32")

    def quantized(read: Reader, where: Where) -> QWeight:
        if read(size.key).tolist() != [n, k]:
            raise CompileError(f"{where(size.key)}: tensor '{size.key}' holds {read(size.key).tolist()}, expected "
                               f"[{n}, {k}], the shape of {module}")
        q = _unpack_int4(read(packed.key))[:, :k]                      # [N, K], the signed value + 8
        s = _scales(read, where, scale.key).float()                    # [N, K/g]
        # the stored zero point is signed + 8 too, so (q - 8) - (z - 8) = q - z; symmetric: z = 0, stored 8
        z = _unpack_int4(read(zero.key).T.contiguous())[:, :n].T if scheme.zero_point else torch.full_like(s, 8)
        return QWeight(INT4, _u8(q), s, (1, g), _u8(z))
    return Packed((packed, scale, size, zero) if scheme.zero_point else (packed, scale, size), quantized)


_LAYOUTS = {FP8_BLOCK: _fp8_block, AWQ_GEMM: _awq_gemm, CT_FLOAT: _ct_float, CT_PACKED: _ct_packed}
