"""EAGLE3 draft head: one Llama-style decoder layer over [embedding, hidden] with its own KV cache.

Semantics (reference/eagle3_semantics.md §2-3; SafeAILab/EAGLE cnets.py, AngelSlim llama3_eagle3.py):
  - ``fc`` (3H -> H) applies only to the target's tapped features; the head's own output (H) is fed
    back as is. ``fc`` is its own graph (``eagle3_fc``) so this step takes one hidden width.
  - q/k/v see concat[input_layernorm(embed(token)), hidden_norm(hidden)], embedding first; the
    attention residual is the hidden, not the embedding; no q_norm/k_norm.
  - the fed-back hidden is pre-norm; ``norm`` only precedes ``lm_head`` (draft vocabulary).
  - draft ids map to target ids by offsets: target = draft + d2t[draft].
  - the embedding table is the target's ``model.embed_tokens`` (not in the head's checkpoint).
  - pairing: draft position t consumes the target feature at t and the token at t+1.
Parameter names equal the AngelSlim checkpoint keys (``midlayer.*``, ``fc``, ``norm``, ``lm_head``).
"""

from __future__ import annotations

import torch
from torch import nn

from xcompile.compile.config import Eagle3Config
from xcompile.compile.models.layers import MLP, Attention, RMSNorm, Rotary, Step, make_step, select_rows


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config, rotary: Rotary):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   cfg.rms_norm_eps, rotary, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, emb, hidden, step: Step, k_cache, v_cache):
        u = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)   # [B, S, 2H]
        a, k_cache, v_cache = self.self_attn(u, step, k_cache, v_cache)
        x = hidden + a                                  # residual = hidden, not the embedding
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache


class Eagle3(nn.Module):
    """forward(input_ids [B,S], hidden_states [B,S,H], position_ids [B,S], write_index [B],
               tree_mask [B,S,S], logit_rows [B,R], past_key_0, past_value_0)
         -> logits [B,R,draft_vocab], hidden_out [B,S,H] (pre-norm), present_key_0, present_value_0
    """

    def __init__(self, cfg: Eagle3Config, max_seq_len: int, rope_theta: float | None = None):
        super().__init__()
        self.cfg, self.max_seq_len = cfg, max_seq_len
        # θ: reference inference reads config.rope_theta; the training code used 10000 (§6.3)
        self.rope_theta = cfg.rope_theta if rope_theta is None else rope_theta
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)      # the target's table, shared at load
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = MidLayer(cfg, Rotary(cfg.head_dim, max_seq_len, self.rope_theta))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def project(self, hidden_taps: torch.Tensor) -> torch.Tensor:
        """Target taps [B, S, 3H] -> hidden [B, S, H] (the ``eagle3_fc`` graph)."""
        return self.fc(hidden_taps)

    def forward(self, input_ids, hidden_states, position_ids, write_index, tree_mask, logit_rows, k_cache, v_cache):
        emb = self.embed_tokens(input_ids)
        c = self.cfg
        step = make_step(position_ids, write_index, tree_mask, self.max_seq_len, emb.dtype,
                         self.midlayer.self_attn.rotary, c.num_attention_heads // c.num_key_value_heads)
        x, k_cache, v_cache = self.midlayer(emb, hidden_states, step, k_cache, v_cache)
        logits = self.lm_head(self.norm(select_rows(x, logit_rows)))
        return logits, x, k_cache, v_cache

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def new_kv(self, batch: int = 1, device=None, dtype=None) -> list[torch.Tensor]:
        c = self.cfg
        dtype = dtype or self.fc.weight.dtype
        shape = (batch, c.num_key_value_heads, self.max_seq_len, c.head_dim)
        return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(2)]


class Eagle3FC(nn.Module):
    """The ``eagle3_fc`` graph: forward(hidden_taps [B,S,3H]) -> hidden_states [B,S,H]."""

    def __init__(self, head: Eagle3):
        super().__init__()
        self.fc = head.fc

    def forward(self, hidden_taps):
        return self.fc(hidden_taps)
