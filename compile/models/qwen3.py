"""Qwen3 (dense) as one forward over S new tokens against preallocated per-layer KV buffers.

The call is the ``target`` graph of the I/O contract (runtime/contract.py): prefill, decode and
chain/tree verify differ only in the inputs. Parameter names equal the HF checkpoint keys, so the
weight key map is the identity (compile/checkpoint.py).
"""

from __future__ import annotations

import torch
from torch import nn

from xcompile.compile.config import Qwen3Config
from xcompile.compile.models.layers import MLP, Attention, RMSNorm, Rotary, Step, make_step, select_rows


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.hidden_size, cfg.num_attention_heads,
                                   cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, rotary,
                                   qk_norm=True, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, step: Step, k_cache, v_cache):
        a, k_cache, v_cache = self.self_attn(self.input_layernorm(x), step, k_cache, v_cache)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache


class Qwen3Body(nn.Module):
    """``model.*`` of the HF checkpoint."""

    def __init__(self, cfg: Qwen3Config, max_seq_len: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = rotary = Rotary(cfg.head_dim, max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3(nn.Module):
    """Qwen3ForCausalLM with a static KV cache and EAGLE3 taps.

    forward(input_ids [B,S], position_ids [B,S], write_index [B], tree_mask [B,S,S] bool,
            logit_rows [B,R], *kv: past_key_0, past_value_0, ... [B,Hkv,S_max,D])
      -> logits [B,R,V], hidden_taps [B,S,3H] (if taps), present_key_0, present_value_0, ...

    ``taps`` are 0-based output-of-layer ids: the raw residual stream after those layers, before
    the final norm, concatenated low to high (reference/eagle3_semantics.md §1.2).
    """

    def __init__(self, cfg: Qwen3Config, max_seq_len: int, taps: tuple[int, ...] | None = None):
        super().__init__()
        self.cfg, self.max_seq_len = cfg, max_seq_len
        self.taps = tuple(sorted(taps)) if taps else ()     # duplicates allowed (tiny models)
        assert all(0 <= t < cfg.num_hidden_layers for t in self.taps), self.taps
        self.model = Qwen3Body(cfg, max_seq_len)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, position_ids, write_index, tree_mask, logit_rows, *kv):
        assert len(kv) == 2 * self.cfg.num_hidden_layers, len(kv)
        x = self.model.embed_tokens(input_ids)
        c = self.cfg
        step = make_step(position_ids, write_index, tree_mask, self.max_seq_len, x.dtype, self.model.rotary,
                         c.num_attention_heads // c.num_key_value_heads)
        tapped, present = {}, []
        for i, layer in enumerate(self.model.layers):
            x, k, v = layer(x, step, kv[2 * i], kv[2 * i + 1])
            present += [k, v]
            if i in self.taps:
                tapped[i] = x
        logits = self.lm_head(self.model.norm(select_rows(x, logit_rows)))
        if self.taps:
            return (logits, torch.cat([tapped[t] for t in self.taps], dim=-1), *present)
        return (logits, *present)

    def new_kv(self, batch: int = 1, device=None, dtype=None) -> list[torch.Tensor]:
        """Zeroed KV buffers [B, Hkv, S_max, D] for every layer, in call order."""
        c = self.cfg
        dtype = dtype or self.lm_head.weight.dtype
        shape = (batch, c.num_key_value_heads, self.max_seq_len, c.head_dim)
        return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(2 * c.num_hidden_layers)]
