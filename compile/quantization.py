"""Quantized checkpoints: ``quantization_config`` of config.json parsed into a frozen ``Quantization``.

Three methods, as quantized Qwen3 checkpoints ship them (one storage layout per linear weight [N, K]):

    fp8                 FP8_BLOCK   weight e4m3 [N, K] + weight_scale_inv [ceil(N/bn), ceil(K/bk)]: w = q * s per
                                    block, partial blocks at the right and bottom (Qwen/Qwen3-8B-FP8; DeepSeek-V3)
    awq                 AWQ_GEMM    AutoAWQ's WQLinear_GEMM: qweight int32 [K, N/8], qzeros int32 [K/g, N/8],
                                    scales [K/g, N]: w[n, k] = (q - z) * s of k's group (Qwen/Qwen3-8B-AWQ)
    compressed-tensors  CT_FLOAT    weight e4m3 [N, K] + weight_scale per channel / tensor / group / block
                        CT_PACKED   weight_packed int32 [N, K/8] (int4 + 8, element i in bits 4i..4i+3),
                                    weight_scale [N, K/g], weight_shape, optional weight_zero_point
                                    (RedHatAI/Qwen3-8B-FP8-dynamic, ...-quantized.w4a16; llm-compressor)

The PyTorch reference dequantizes the weights at load (compile/checkpoint/quantized.py) and the export keeps them
quantized, DequantizeLinear in the graphs (compile/qdq.py): both compute in the model's dtype (W8A16 / W4A16). Dynamic activation quantization (fp8 ``activation_scheme: dynamic``, compressed-tensors
``input_activations.dynamic: true``) carries no tensor in the checkpoint: its runtimes quantize each
activation on the fly, and xcompile computes it unquantized, which the manifest records. Every field that
would change the weights or needs a tensor xcompile does not read (static activation scales, KV-cache
scales, act-order indices, sparsity, transforms) is refused naming the field, never ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from xcompile.compile.errors import CompileError

FP8, AWQ, CT = "fp8", "awq", "compressed-tensors"
FP8_BLOCK, AWQ_GEMM, CT_FLOAT, CT_PACKED = "fp8-block", "awq-gemm", "float-quantized", "pack-quantized"
LM_HEAD = "lm_head"

# fields of other loaders' runtimes that do not change the stored weights (transformers' AwqConfig and
# FineGrainedFP8Config, compressed-tensors' calibration and bookkeeping fields)
_RUNTIME_ONLY = {
    FP8: {"dequantize"},
    AWQ: {"do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config"},
    CT: {"global_compression_ratio", "version"},
}
_CT_ARGS_INFO = {"observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


@dataclass(frozen=True)
class WeightScheme:
    """How one linear weight [N, K] is stored. ``block``: rows and columns sharing one scale (0: the whole
    dim, so (1, 0) is per channel and (0, 0) per tensor)."""

    layout: str                     # FP8_BLOCK, AWQ_GEMM, CT_FLOAT or CT_PACKED
    bits: int                       # 8 (float8 e4m3) or 4 (int4)
    block: tuple[int, int]
    zero_point: bool = False        # asymmetric int4: a zero point per block

    def to_dict(self) -> dict:
        return {"layout": self.layout, "bits": self.bits, "block": list(self.block), "zero_point": self.zero_point}


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's ``quantization_config``: which linear modules are stored how.

    groups        (group name, scheme, targets) in the config's order; a target is ``Linear`` (every
                  linear) or a pattern
    ignore        patterns of modules left in the checkpoint's float dtype
    Patterns are regexes matched from the start of a checkpoint module name (``re.match``): each method's own
    matching rule translated at parse time (``_fp8``, ``_awq``, ``_ct_pattern``).
    """

    method: str
    groups: tuple[tuple[str, WeightScheme, tuple[str, ...]], ...]
    ignore: tuple[str, ...]
    activations: str | None         # how the checkpoint's runtimes quantize activations (dynamic only)
    config: Path

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of checkpoint module ``module`` (a linear layer), or None where it is not quantized."""
        if any(re.match(p, module) for p in self.ignore):
            return None
        for _, scheme, targets in self.groups:
            if any(t == "Linear" or re.match(t, module) for t in targets):
                return scheme
        return None

    def record(self, linears: list[str]) -> dict:
        """What the manifest records (``models.<name>.extra.quantization``) for a model whose linear layers
        are ``linears`` (checkpoint module names)."""
        schemes = [self.scheme_for(m) for m in linears]
        return {"method": self.method, "loaded_as": "quantized", "activations": self.activations,
                "weights": [{**s.to_dict(), "modules": sum(x is s for x in schemes)} for _, s, _ in self.groups],
                "unquantized": [m for m, s in zip(linears, schemes) if s is None]}


def parse_quantization(path: Path, data: dict) -> Quantization | None:
    """The ``quantization_config`` of config.json ``data`` (read from ``path``), None when absent."""
    config = data.get("quantization_config")
    if config is None:
        return None
    f = _Config(Path(path), config, "quantization_config")
    method = f.get("quant_method", str, required=True)
    if method not in _PARSERS:
        raise f.unsupported("quant_method", method, f"xcompile reads {', '.join(_PARSERS)}")
    return _PARSERS[method](f)


class _Config:
    """Typed access to one object of quantization_config; errors name the file and the field path."""

    def __init__(self, path: Path, data, prefix: str):
        self.path, self.data, self.prefix = path, data, prefix
        if not isinstance(data, dict):
            raise CompileError(f"{path}: {prefix} should be an object, got {data!r}")

    def fail(self, name: str, why: str) -> CompileError:
        return CompileError(f"{self.path}: {self.prefix}.{name}{why}")

    def unsupported(self, name: str, value, what: str) -> CompileError:
        return self.fail(name, f": {value!r} is not supported; {what}")

    def get(self, name: str, kind, default=None, *, required: bool = False):
        value = self.data.get(name)
        if value is None:
            if required:
                raise self.fail(name, " is missing")
            return default
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise self.fail(name, f" should be {getattr(kind, '__name__', 'of another type')}, got {value!r}")
        return value

    def sub(self, name: str) -> _Config:
        return _Config(self.path, self.data[name], f"{self.prefix}.{name}")

    def only(self, known: set[str]) -> None:
        """Refuse a field xcompile does not know: it may change the weights' meaning."""
        unknown = sorted(set(self.data) - known)
        if unknown:
            raise self.fail(unknown[0], f" ({self.data[unknown[0]]!r}) is not a field xcompile knows; it cannot tell "
                            "whether it changes the weights, so it refuses the checkpoint")

    def patterns(self, name: str) -> list[str]:
        value = self.get(name, list, [])
        if not all(isinstance(p, str) and p for p in value):
            raise self.fail(name, f" should be a list of module names, got {value!r}")
        return value


def _regex(f: _Config, name: str, pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise f.fail(name, f": {pattern!r} is not a valid pattern ({e})") from None
    return pattern


def _fp8(f: _Config) -> Quantization:
    """quant_method fp8 (transformers' FineGrainedFP8Config; vLLM's Fp8Config with weight_block_size)."""
    f.only({"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
            "ignored_layers", "modules_to_convert", "scale_fmt", "expert_dtype"} | _RUNTIME_ONLY[FP8])
    if f.get("fmt", str, "e4m3") != "e4m3":
        raise f.unsupported("fmt", f.data["fmt"], "xcompile reads float8 e4m3 weights (fmt e4m3)")
    if f.get("activation_scheme", str, "dynamic").lower() != "dynamic":
        raise f.unsupported("activation_scheme", f.data["activation_scheme"], "xcompile reads FP8 checkpoints "
                            "without activation scales (dynamic); static ones need the input scales it does not apply")
    if f.data.get("weight_block_size") is None:
        raise f.fail("weight_block_size", " is missing: vLLM then reads one scale per tensor and transformers "
                     "blocks of [128, 128]; xcompile reads block-scaled FP8: add the block size the checkpoint has")
    block = f.get("weight_block_size", list)
    if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise f.fail("weight_block_size", f" should be two positive integers [rows, columns], got {block!r}")
    if f.get("scale_fmt", str, "float") != "float":
        raise f.unsupported("scale_fmt", f.data["scale_fmt"], "xcompile reads float scales (scale_fmt float)")
    if f.get("expert_dtype", str, "fp8") != "fp8":
        raise f.unsupported("expert_dtype", f.data["expert_dtype"], "a dense Qwen3 has no experts")
    if f.get("modules_to_convert", list, []):
        raise f.unsupported("modules_to_convert", f.data["modules_to_convert"], "xcompile reads quantized linear "
                            "layers only (embeddings stay in the checkpoint's float dtype)")
    # transformers' rule (quantizers_utils.should_convert_module): a name matches from its start up to a
    # module boundary, as a regex, or as a suffix; the output projection is never quantized (vLLM's
    # lm_head is not a linear of the method)
    skip = [(name, p) for name in ("modules_to_not_convert", "ignored_layers") for p in f.patterns(name)]
    ignore = [rf"(?:{_regex(f, name, p)})(?:(?<=\.)|(?=\.|$))|.*{re.escape(p)}$" for name, p in skip]
    scheme = WeightScheme(FP8_BLOCK, 8, (block[0], block[1]))
    return Quantization(FP8, (("weights", scheme, ("Linear",)),), (rf"{LM_HEAD}$", *ignore), "dynamic", f.path)


def _awq(f: _Config) -> Quantization:
    """quant_method awq in AutoAWQ's GEMM layout (transformers' AwqConfig, vLLM's AWQConfig)."""
    f.only({"quant_method", "bits", "group_size", "zero_point", "version", "backend", "modules_to_not_convert"}
           | _RUNTIME_ONLY[AWQ])
    if f.get("bits", int, 4) != 4:
        raise f.unsupported("bits", f.data["bits"], "xcompile reads 4-bit AWQ")
    if f.get("version", str, "gemm").lower() != "gemm":
        raise f.unsupported("version", f.data["version"], "xcompile reads AutoAWQ's GEMM layout (version gemm)")
    if f.get("backend", str, "autoawq").lower() != "autoawq":
        raise f.unsupported("backend", f.data["backend"], "xcompile reads AutoAWQ's packing (backend autoawq)")
    if f.get("zero_point", bool, True) is not True:
        raise f.unsupported("zero_point", False, "xcompile reads AutoAWQ GEMM checkpoints with zero points, the "
                            "only ones AutoAWQ's GEMM layout writes")
    group = f.get("group_size", int, 128)
    if group <= 0 and group != -1:
        raise f.fail("group_size", f" should be a positive group size or -1 (one group per row), got {group}")
    # AutoAWQ and vLLM skip a linear whose name contains an entry (exclude_layers_to_not_quantize, is_layer_skipped_awq)
    ignore = [rf".*{re.escape(p)}" for p in f.patterns("modules_to_not_convert")]
    scheme = WeightScheme(AWQ_GEMM, 4, (1, max(group, 0)), zero_point=True)
    return Quantization(AWQ, (("weights", scheme, ("Linear",)),), (rf"{LM_HEAD}$", *ignore), None, f.path)


def _ct(f: _Config) -> Quantization:
    """quant_method compressed-tensors (its QuantizationConfig; written by llm-compressor, read by vLLM)."""
    f.only({"quant_method", "config_groups", "format", "quantization_status", "ignore", "kv_cache_scheme",
            "sparsity_config", "transform_config", "moe_sparsity_config"} | _RUNTIME_ONLY[CT])
    for name in ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config"):
        if f.data.get(name):
            raise f.unsupported(name, f.data[name], "xcompile reads quantized weights only (no KV-cache scales, "
                                "sparsity or transforms)")
    if f.get("quantization_status", str, required=True) != "compressed":
        raise f.unsupported("quantization_status", f.data["quantization_status"], "xcompile reads compressed "
                            "checkpoints (quantization_status compressed)")
    groups, activations = [], set()
    for name in f.get("config_groups", dict, required=True):
        g = f.sub("config_groups").sub(name)
        g.only({"targets", "weights", "input_activations", "output_activations", "format"})
        targets = tuple(t if t == "Linear" else _ct_pattern(g, "targets", t) for t in g.patterns("targets"))
        if not targets:
            raise g.fail("targets", " is empty")
        if g.data.get("output_activations") is not None:
            raise g.unsupported("output_activations", g.data["output_activations"], "xcompile reads weight "
                                "quantization (with dynamic input activations at most)")
        if g.data.get("input_activations") is not None:
            activations.add(_ct_activations(g.sub("input_activations")))
        if g.data.get("weights") is None:
            raise g.fail("weights", " is missing; xcompile reads weight quantization")
        fmt_from = g if g.data.get("format") is not None else f      # a group's format overrides the top level's
        groups.append((name, _ct_weights(g.sub("weights"), fmt_from.get("format", str, required=True), fmt_from),
                       targets))
    ignore = tuple(_ct_pattern(f, "ignore", p) for p in f.patterns("ignore"))
    return Quantization(CT, tuple(groups), ignore, " and ".join(sorted(activations)) or None, f.path)


def _ct_pattern(f: _Config, field: str, pattern: str) -> str:
    # compressed-tensors' match_name: "re:" + a regex matched from the start, else the exact module name
    if pattern.startswith("re:"):
        return _regex(f, field, pattern.removeprefix("re:"))
    if not re.fullmatch(r"[\w.]+", pattern) or "." not in pattern and pattern != LM_HEAD:
        raise f.unsupported(field, pattern, "xcompile matches linear layers by 'Linear', a module name or 're:' + "
                            "a regex (a class name other than Linear names no quantizable weight of Qwen3)")
    return re.escape(pattern) + "$"


def _ct_activations(a: _Config) -> str:
    if a.data.get("dynamic") is not True:
        raise a.unsupported("dynamic", a.data.get("dynamic"), "xcompile computes activations in the model's dtype; "
                            "it accepts dynamic activation quantization (no scales in the checkpoint), not static")
    return f"dynamic {a.data.get('type', 'int')}{a.data.get('num_bits', 8)} per {a.data.get('strategy', 'token')}"


def _ct_weights(w: _Config, fmt: str, fmt_from: _Config) -> WeightScheme:
    w.only({"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder"}
           | _CT_ARGS_INFO)
    if w.data.get("dynamic", False) is not False:
        raise w.unsupported("dynamic", w.data["dynamic"], "xcompile reads weights with stored scales")
    if w.data.get("actorder") not in (None, False, "weight", "static"):
        raise w.unsupported("actorder", w.data["actorder"], "xcompile reads weights in their natural column order "
                            "(actorder null or weight); group act-order needs the weight_g_idx it does not apply")
    kind, bits = w.get("type", str, "int"), w.get("num_bits", int, 8)
    strategy, symmetric = w.get("strategy", str, "tensor"), w.get("symmetric", bool, True)
    if fmt == CT_FLOAT or (fmt == "naive-quantized" and kind == "float"):
        if (kind, bits) != ("float", 8):
            raise w.unsupported("num_bits", bits, f"xcompile reads float8 weights in {fmt!r}")
        if not symmetric:
            raise w.unsupported("symmetric", False, "xcompile reads symmetric float8 weights")
        layout, blocks = CT_FLOAT, ("channel", "tensor", "group", "block")
    elif fmt == CT_PACKED:
        if (kind, bits) != ("int", 4):
            raise w.unsupported("num_bits" if kind == "int" else "type", bits if kind == "int" else kind,
                                "xcompile reads 4-bit int weights in 'pack-quantized'")
        layout, blocks = CT_PACKED, ("channel", "group")
    else:
        raise fmt_from.unsupported("format", fmt, f"xcompile reads compressed-tensors formats {CT_FLOAT!r} (float8) "
                                f"and {CT_PACKED!r} (int4)")
    if strategy not in blocks:
        raise w.unsupported("strategy", strategy, f"xcompile reads {' / '.join(blocks)} scales in {fmt!r}")
    if strategy == "group":
        size = w.get("group_size", int, required=True)
        if size <= 0:
            raise w.fail("group_size", f" should be positive, got {size}")
        block = (1, size)
    elif strategy == "block":
        shape = w.get("block_structure", list, required=True)
        if len(shape) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in shape):
            raise w.fail("block_structure", f" should be two positive integers [rows, columns], got {shape!r}")
        block = (shape[0], shape[1])
    else:
        block = (1, 0) if strategy == "channel" else (0, 0)
    return WeightScheme(layout, bits, block, zero_point=not symmetric)


_PARSERS = {FP8: _fp8, AWQ: _awq, CT: _ct}
