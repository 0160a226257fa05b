"""Building blocks shared by the Qwen3 target and the EAGLE3 head.

Each block has a real eager path (the PyTorch reference and the torch runtime backend) and, under
``torch.onnx.is_in_onnx_export()``, emits the opset-24 op that TensorRT maps to a fused layer:
RMSNormalization, RotaryEmbedding, TensorScatter (in-place KV update) and Attention.
No shape ever depends on a tensor's values, so every call is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ONNX_OPSET = 24


def exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if exporting():
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)   # -> RMSNormalization
        # HF Qwen3RMSNorm order: fp32 statistics, cast back, then scale by the weight
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, head_dim/2] in fp32 (rotate-half convention, as HF Qwen3/Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return freqs.cos().float(), freqs.sin().float()


class Rotary(nn.Module):
    """RoPE on [B, H, S, D] with per-token positions [B, S] (tree nodes share a depth's position)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        cos, sin = rope_tables(head_dim, max_positions, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        if exporting():
            return torch.onnx.ops.rotary_embedding(x, cos, sin, position_ids)      # -> RotaryEmbedding
        c, s = cos[position_ids][:, None], sin[position_ids][:, None]               # [B, 1, S, D/2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def write_kv(cache: torch.Tensor, update: torch.Tensor, write_index: torch.Tensor) -> torch.Tensor:
    """Write update [B, Hkv, S, D] into cache [B, Hkv, S_max, D] at rows write_index[b] + 0..S-1.

    Eager: in place (the cache is a preallocated runtime buffer). Export: TensorScatter, which
    TensorRT lowers to an in-place KVCacheUpdate layer whose output aliases the cache input.
    """
    if exporting():
        return torch.onnx.ops.symbolic(
            "TensorScatter", (cache, update, write_index), {"axis": -2, "mode": "linear"},
            dtype=cache.dtype, shape=cache.shape, version=ONNX_OPSET,
        )
    b, h, s, d = update.shape
    rows = write_index[:, None] + torch.arange(s, device=update.device)            # [B, S]
    cache.scatter_(2, rows[:, None, :, None].expand(b, h, s, d), update)
    return cache


def attention_mask(write_index: torch.Tensor, tree_mask: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Boolean mask [B, 1, S, S_max]: query i sees every committed key (< write_index) and the new
    keys tree_mask[b, i, :] allows. Built from a constant arange(S_max): no value-dependent shapes."""
    b, s, _ = tree_mask.shape
    keys = torch.arange(max_seq_len, device=tree_mask.device)
    offset = keys[None, :] - write_index[:, None]                                  # [B, S_max]
    committed = offset < 0
    in_block = (offset >= 0) & (offset < s)
    index = offset.clamp(0, s - 1)[:, None, :].expand(b, s, max_seq_len)
    block = torch.gather(tree_mask, 2, index) & in_block[:, None, :]                # [B, S, S_max]
    return (committed[:, None, :] | block)[:, None]


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

    def forward(self, x, position_ids, write_index, mask, k_cache, v_cache):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)          # [B, H, S, D]
        q, k = self.rotary(q, position_ids), self.rotary(k, position_ids)
        k_cache = write_kv(k_cache, k, write_index)
        v_cache = write_kv(v_cache, v, write_index)
        # never is_causal with a cache: ONNX aligns it upper-left; the explicit mask is right
        if exporting():
            y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)  # -> Attention
        else:
            y = grouped_attention(q, k_cache, v_cache, mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1)), k_cache, v_cache


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GQA without repeating the cache: the g query heads that share a KV head ride along the query
    axis. q [B, Hkv*g, S, D], k/v [B, Hkv, S_max, D], mask [B, 1, S, S_max] -> [B, Hkv*g, S, D].
    Any SDPA kernel (flash/mem-efficient/math) then reads each KV head once."""
    b, h, s, d = q.shape
    kv_heads = k.shape[1]
    g = h // kv_heads
    q = q.reshape(b, kv_heads, g * s, d)                          # head j*g+i -> row block i of kv head j
    mask = mask[:, :, None].expand(b, 1, g, s, mask.shape[-1]).reshape(b, 1, g * s, mask.shape[-1])
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return y.reshape(b, h, s, d)


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
