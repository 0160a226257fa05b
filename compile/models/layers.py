"""Building blocks shared by the Qwen3 target and the EAGLE3 head.

Each block has a real eager path (the PyTorch reference and the torch runtime backend) and, under
``torch.onnx.is_in_onnx_export()``, emits the opset-24 op that TensorRT maps to a fused layer:
RMSNormalization, RotaryEmbedding, TensorScatter (in-place KV update) and Attention.
No shape ever depends on a tensor's values, so every call is CUDA-graph capturable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from xcompile.compile.config import Yarn
from xcompile.runtime.engines.base import KV_FP8, fp8_codes

ONNX_OPSET = 24


def exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one op: RMSNormalization in ONNX, a fused kernel on CUDA (fp32 statistics, as HF Qwen3RMSNorm)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def yarn_inv_freq(head_dim: int, theta: float, yarn: Yarn) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies [head_dim/2] (fp64) and attention factor, as transformers'
    ``_compute_yarn_parameters`` computes them (in fp32 there): dimensions that turn fewer than ``beta_slow``
    times over the trained context are interpolated (frequency / factor), those turning more than ``beta_fast``
    times keep their frequency, and a linear ramp over the dimension index blends the two between."""
    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits ``rotations`` times into the trained context
        return head_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / \
            (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                                   # transformers' guard against 0/0
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    inv_freq = (1 / (yarn.factor * pos_freqs)) * ramp + (1 / pos_freqs) * (1 - ramp)
    attention = yarn.attention_factor
    if attention is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention = _yarn_mscale(yarn.factor, yarn.mscale) / _yarn_mscale(yarn.factor, yarn.mscale_all_dim)
        else:
            attention = _yarn_mscale(yarn.factor, 1.0)
    return inv_freq, attention


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN paper eq. 21: 0.1 mscale ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(head_dim: int, max_positions: int, theta: float, scaling: Yarn | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, head_dim/2] in fp32 (rotate-half convention, as HF Qwen3/Llama), computed in
    fp64. With YaRN both carry its attention factor (HF multiplies cos and sin by it), so every consumer of
    the tables (eager, the ONNX RotaryEmbedding caches, the fast kernels) applies YaRN unchanged."""
    if scaling is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        attention = 1.0
    else:
        inv_freq, attention = yarn_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return (freqs.cos() * attention).float(), (freqs.sin() * attention).float()


class Rotary(nn.Module):
    """RoPE on [B, H, S, D] with per-token positions [B, S] (tree nodes share a depth's position)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Yarn | None = None):
        super().__init__()
        # the tables are rebuilt from these after a meta-device build (computed_tables)
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        cos, sin = self.computed_tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def computed_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh fp32 cos/sin [max_positions, D/2] on the CPU."""
        return rope_tables(self.head_dim, self.max_positions, self.theta, self.scaling)

    def tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, S, D] for these positions, halves duplicated (HF's cat(freqs, freqs)):
        gathered once per forward and shared by every layer."""
        cos, sin = self.cos[position_ids][:, None], self.sin[position_ids][:, None]
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = tables
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin                         # rotate-half

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if exporting():
            cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
            return torch.onnx.ops.rotary_embedding(x, cos, sin, position_ids)      # -> RotaryEmbedding
        return self.apply(x, self.tables(position_ids, x.dtype))


def write_kv(cache: torch.Tensor, update: torch.Tensor, step: "Step") -> torch.Tensor:
    """Write update [B, Hkv, S, D] into cache [B, Hkv, S_max, D] at rows write_index[b] + 0..S-1.

    Eager: in place (the cache is a preallocated runtime buffer). Export: TensorScatter, which
    TensorRT lowers to an in-place KVCacheUpdate layer whose output aliases the cache input.
    """
    if exporting():
        return torch.onnx.ops.symbolic(
            "TensorScatter", (cache, update, step.write_index), {"axis": -2, "mode": "linear"},
            dtype=cache.dtype, shape=cache.shape, version=ONNX_OPSET,
        )
    rows = step.kv_rows.expand(update.shape)
    if cache.dtype == KV_FP8:
        cache.view(torch.uint8).scatter_(2, rows, fp8_codes(update))
        return cache
    return cache.scatter_(2, rows, update)


def read_kv(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache (or the slice of it a pass reads) in the compute dtype: an FP8 cache's codes converted, exactly."""
    return cache.to(dtype) if cache.dtype == KV_FP8 else cache


def attention_mask(write_index: torch.Tensor, tree_mask: torch.Tensor, max_seq_len: int, dtype: torch.dtype
                   ) -> torch.Tensor:
    """Additive mask [B, 1, S, S_max] (0 = visible, -inf = hidden) by the I/O contract's rule: the
    columns of tree_mask [B, S, W] are keys origin..origin+W-1, origin = write_index + S - W; query i
    sees every key before origin and the keys tree_mask[b, i, :] allows (W = S: every committed key
    and the new ones the mask allows). Built from a constant arange(S_max), so no shape depends on
    values. Additive rather than boolean: TensorRT-RTX 1.7 fails to build graphs whose attention
    layers share one boolean mask."""
    b, s, w = tree_mask.shape
    keys = torch.arange(max_seq_len, device=tree_mask.device)
    offset = keys[None, :] - (write_index[:, None] + (s - w))                      # [B, S_max]: column of key
    before = offset < 0
    in_mask = (offset >= 0) & (offset < w)
    index = offset.clamp(0, w - 1)[:, None, :].expand(b, s, max_seq_len)
    block = torch.gather(tree_mask, 2, index) & in_mask[:, None, :]                # [B, S, S_max]
    visible = (before[:, None, :] | block)[:, None]
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


@dataclass
class Step:
    """What every layer of one forward shares, computed once per forward rather than per layer."""

    position_ids: torch.Tensor                  # [B, S]
    write_index: torch.Tensor                   # [B]
    mask: torch.Tensor | None                   # additive; eager: grouped [B, 1, g*S, S_max] (grouped_attention),
                                                # or None for a causal prompt pass (``live``)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None   # eager: cos/sin [B, 1, S, D]
    kv_rows: torch.Tensor | None = None         # eager: cache rows written, [B, 1, S, 1]
    live: int | None = None                     # eager causal prompt pass: it sees keys 0..live-1 (causal_attention)


def make_step(position_ids: torch.Tensor, write_index: torch.Tensor, tree_mask: torch.Tensor, max_seq_len: int,
              dtype: torch.dtype, rotary: "Rotary", groups: int) -> Step:
    if exporting():
        return Step(position_ids, write_index, attention_mask(write_index, tree_mask, max_seq_len, dtype))
    b, s = position_ids.shape
    rows = write_index[:, None] + torch.arange(s, device=position_ids.device)      # [B, S]
    rope, kv_rows = rotary.tables(position_ids, dtype), rows[:, None, :, None]
    if causal_prompt(tree_mask):
        return Step(position_ids, write_index, None, rope, kv_rows, live=int(write_index[0]) + s)
    mask = attention_mask(write_index, tree_mask, max_seq_len, dtype)
    return Step(position_ids, write_index, group_mask(mask, groups), rope, kv_rows)


# A causal pass of more than MATMUL_ATTENTION_MAX_QUERIES tokens of one sequence (a prompt) attends over the live
# keys through SDPA's causal kernels (flash on a GPU), never building the additive mask over the whole cache: for
# a 32,000-token prompt that mask was [g*S, S_max] = 8 GB of bf16, and the kernels behind it read every slot.
CAUSAL_CHECK_ROWS = 2048        # rows of tree_mask checked at a time (a block's temporary: 2048 x S bools)


def causal_prompt(tree_mask: torch.Tensor) -> bool:
    """Whether tree_mask [1, S, S] is the causal triangle of a prompt pass of S > MATMUL_ATTENTION_MAX_QUERIES
    tokens: row i holds i + 1 visible keys and none past column i (so exactly 0..i), checked in row blocks."""
    b, s, w = tree_mask.shape
    if b != 1 or s != w or s <= MATMUL_ATTENTION_MAX_QUERIES:
        return False
    m = tree_mask[0]
    if not torch.equal(m.sum(-1), torch.arange(1, s + 1, device=m.device)):
        return False
    return not any(bool(torch.triu(m[r:r + CAUSAL_CHECK_ROWS], diagonal=r + 1).any())
                   for r in range(0, s, CAUSAL_CHECK_ROWS))


def causal_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, live: int) -> torch.Tensor:
    """q [1, Hq, S, D], the S newest of ``live`` keys, causal over the caches' first ``live`` rows [1, Hkv, live, D]
    (the KV heads shared by groups of query heads, as SDPA's enable_gqa reads them) -> [1, Hq, S, D]."""
    s = q.shape[2]
    k, v = read_kv(k_cache[:, :, :live], q.dtype), read_kv(v_cache[:, :, :live], q.dtype)
    if live == s:                               # from an empty cache: upper-left and lower-right causal agree
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s, live), enable_gqa=True)


class Attention(nn.Module):
    """GQA self-attention over a static KV cache; q_norm/k_norm per head for Qwen3, none for EAGLE3."""

    def __init__(self, in_dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 eps: float, rotary: Rotary, qk_norm: bool, bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)     # HF Qwen3: o_proj bias too
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm
        self.rotary = rotary

    def forward(self, x: torch.Tensor, step: Step, k_cache: torch.Tensor, v_cache: torch.Tensor):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)          # [B, H, S, D]
        if step.rope is None:
            q, k = self.rotary(q, step.position_ids), self.rotary(k, step.position_ids)
        else:
            q, k = Rotary.apply(q, step.rope), Rotary.apply(k, step.rope)
        k_cache = write_kv(k_cache, k, step)
        v_cache = write_kv(v_cache, v, step)
        # never is_causal with a cache: ONNX aligns it upper-left; the explicit mask is right
        if exporting():
            y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=step.mask, enable_gqa=True)
        elif step.mask is None:
            y = causal_attention(q, k_cache, v_cache, step.live)
        else:
            y = grouped_attention(q, read_kv(k_cache, q.dtype), read_kv(v_cache, q.dtype), step.mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1)), k_cache, v_cache


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, 1, S, K] -> [B, 1, g*S, K]: the mask of grouped_attention's query layout."""
    b, _, s, k = mask.shape
    return mask[:, :, None].expand(b, 1, groups, s, k).reshape(b, 1, groups * s, k)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GQA without repeating the cache: the g query heads that share a KV head ride along the query
    axis. q [B, Hkv*g, S, D], k/v [B, Hkv, K, D], mask [B, 1, S, K] or already grouped
    [B, 1, g*S, K] (bool or additive) -> [B, Hkv*g, S, D]. Any SDPA kernel then reads each KV head once."""
    b, h, s, d = q.shape
    kv_heads = k.shape[1]
    g = h // kv_heads
    q = q.reshape(b, kv_heads, g * s, d)                          # head j*g+i -> row block i of kv head j
    if mask.shape[-2] != g * s:
        mask = group_mask(mask, g)
    if s <= MATMUL_ATTENTION_MAX_QUERIES and mask.is_floating_point():
        y = matmul_attention(q, k, v, mask)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return y.reshape(b, h, s, d)


# Decode/verify steps (few queries, the whole static cache as keys): plain batched matmuls (cuBLAS
# spreads the cache reads over the SMs), as HF's eager attention computes. Prefill keeps SDPA.
# Measured in the model on an H200 (CHANGELOG.md, 2026-11-29): attention is a small share of a decode step.
MATMUL_ATTENTION_MAX_QUERIES = 64


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with an fp32 softmax (HF eager attention's numerics).
    q [B, H, Q, D], k/v [B, H, K, D], additive mask [B, 1, Q, K] -> [B, H, Q, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(mask)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def select_rows(h: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
    """h [B, S, H], logit_rows [B, R] -> [B, R, H]."""
    return torch.gather(h, 1, logit_rows[:, :, None].expand(-1, -1, h.shape[-1]))
