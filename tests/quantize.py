"""Quantized tiny Qwen3 checkpoints, written from each format's specification (not from xcompile's loader):
a random tiny model (fixtures.qwen3_tensors) whose decoder-layer linears are quantized and stored as

    fp8   Qwen/Qwen3-8B-FP8: weight float8_e4m3fn [N, K], weight_scale_inv fp32 per [bn, bk] block
          (scale = block amax / 448, partial blocks at the right and bottom)
    awq   Qwen/Qwen3-8B-AWQ, AutoAWQ's GEMM layout (WQLinear_GEMM.from_linear): per group of g inputs
          scale = (max - min) / 15 in fp16, zero = round(-min / scale), q = round(w / scale) + zero in
          [0, 15]; qweight int32 [K, N/8] holds column 8c + AWQ_ORDER[i] in bits 4i..4i+3 of word c,
          qzeros int32 [K/g, N/8] likewise, scales fp16 [K/g, N]
    ct-fp8   RedHatAI/Qwen3-8B-FP8-dynamic (compressed-tensors float-quantized): weight e4m3, weight_scale
          bf16 [N, 1] = row amax / 448, dynamic per-token fp8 input activations
    ct-int4  ...-quantized.w4a16 (pack-quantized): q in [-8, 7] per group of g inputs, weight_packed
          int32 [N, ceil(K/8)] holding q + 8 of input i in bits 4(i % 8).. of word i // 8, weight_scale
          bf16 [N, K/g], weight_shape; asymmetric adds weight_zero_point packed the same way along N

The embedding, norms and lm_head stay in the float dtype, as in the published checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from fixtures import qwen3_config, qwen3_tensors, write_qwen3_checkpoint, write_weights

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
FP8_MAX = 448.0                   # largest finite float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}


def ct_config(fmt: str, weights: dict, activations: dict | None = None) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it (one group over every Linear)."""
    args = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "observer": "minmax",
            "observer_kwargs": {}, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**args, **weights},
                                          "input_activations": activations, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}


CT_FP8_CONFIG = ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
                          {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
CT_INT4_CONFIG = ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128})


def blocks(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Per-block values [ceil(N/rows), ceil(K/cols)] spread back over [N, K]."""
    n, k = t.shape[0] * rows, t.shape[1] * cols
    return t.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


def quantize_fp8_block(w: torch.Tensor, rows: int, cols: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 codes [N, K] and one scale (in ``dtype``) per [rows, cols] block."""
    n, k = w.shape
    grid = torch.zeros(-(-n // rows), -(-k // cols))
    for r in range(grid.shape[0]):
        for c in range(grid.shape[1]):
            grid[r, c] = w[r * rows:(r + 1) * rows, c * cols:(c + 1) * cols].abs().max() / FP8_MAX
    grid = grid.to(dtype)
    q = (w / blocks(grid.float(), rows, cols)[:n, :k]).to(torch.float8_e4m3fn)
    return q, grid


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] values in [0, 15] -> int32 [R, N/8], column 8c + AWQ_ORDER[i] in bits 4i of word c."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for c in range(words.shape[1]):
        for i in range(8):
            words[:, c] |= values[:, 8 * c + AWQ_ORDER[i]].to(torch.int64) << (4 * i)
    return _int32(words)


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, K] values in [-8, 7] -> int32 [R, ceil(K/8)], value + 8 of column i in bits 4(i % 8) of word i // 8."""
    words = torch.zeros(values.shape[0], -(-values.shape[1] // 8), dtype=torch.int64)
    for i in range(values.shape[1]):
        words[:, i // 8] |= (values[:, i].to(torch.int64) + 8) << (4 * (i % 8))
    return _int32(words)


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def quantize_awq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    scales = ((g.amax(-1) - g.amin(-1)).clamp(min=1e-5) / 15).half()             # [N, K/g]
    zeros = (-torch.round(g.amin(-1) / scales.float())).clamp(0, 15)
    q = (torch.round(g / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, 15).reshape(n, k)
    return {"qweight": pack_awq(q.T.contiguous()), "qzeros": pack_awq(zeros.T.contiguous()),
            "scales": scales.T.contiguous()}


def quantize_int4(w: torch.Tensor, group: int, symmetric: bool = True) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    if symmetric:
        scale, zero = (g.abs().amax(-1) / 7).bfloat16(), torch.zeros(n, k // group)
    else:
        scale = ((g.amax(-1) - g.amin(-1)) / 15).bfloat16()
        zero = (torch.round(-g.amin(-1) / scale.float()) - 8).clamp(-8, 7)
    q = (torch.round(g / scale.float().unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(-8, 7).reshape(n, k)
    out = {"weight_packed": pack_int4_rows(q), "weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    if not symmetric:
        out["weight_zero_point"] = pack_int4_rows(zero.T.contiguous()).T.contiguous()
    return out


def quantize(w: torch.Tensor, config: dict) -> dict[str, torch.Tensor]:
    """The stored tensors (suffix -> tensor) of linear weight ``w`` under quantization_config ``config``."""
    method = config["quant_method"]
    if method == "fp8":
        q, s = quantize_fp8_block(w, *config["weight_block_size"])
        return {"weight": q, "weight_scale_inv": s}
    if method == "awq":
        return quantize_awq(w, config["group_size"] if config["group_size"] > 0 else w.shape[1])
    weights = config["config_groups"]["group_0"]["weights"]
    if config["format"] == "float-quantized" and weights["strategy"] == "block":
        q, s = quantize_fp8_block(w, *weights["block_structure"], dtype=torch.bfloat16)
        return {"weight": q, "weight_scale": s}
    if config["format"] == "float-quantized":
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).bfloat16()
        return {"weight": (w / scale.float()).to(torch.float8_e4m3fn), "weight_scale": scale}
    group = weights["group_size"] if weights["strategy"] == "group" else w.shape[1]
    return quantize_int4(w, group, weights.get("symmetric", True))


def write_quantized_checkpoint(path: Path, config: dict, overrides: dict | None = None, seed: int = 0,
                               dtype: torch.dtype = torch.bfloat16, keep: tuple[str, ...] = ()) -> Path:
    """A tiny Qwen3 checkpoint dir (tokenizer included) whose decoder-layer linears are stored quantized under
    ``config``, but for the modules ending with one of ``keep``; the rest in ``dtype``. Its unquantized twin
    is ``write_qwen3_checkpoint(path, overrides, seed)`` (fp32)."""
    path = write_qwen3_checkpoint(path, overrides, seed)
    tensors = {}
    for key, t in qwen3_tensors(qwen3_config(overrides), seed).items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS and not module.endswith(keep):
            tensors |= {f"{module}.{suffix}": v for suffix, v in quantize(t.to(dtype).float(), config).items()}
        else:
            tensors[key] = t.to(torch.float16 if config["quant_method"] == "awq" else dtype)
    (path / "model.safetensors").unlink()
    write_weights(path, tensors)
    data = json.loads((path / "config.json").read_text())
    data |= {"quantization_config": config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    return path
