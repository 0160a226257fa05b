"""EAGLE3 draft head: one Llama-style decoder layer over [embedding, hidden] with its own KV cache.

Semantics (docs/eagle3.md §2-3; SafeAILab/EAGLE cnets.py, AngelSlim llama3_eagle3.py):
  - ``fc`` (3H -> H) applies only to the target's tapped features; the head's own output (H) is fed
    back as is. ``fc`` is its own graph (``eagle3_fc``) so this step takes one hidden width.
  - q/k/v see concat[input_layernorm(embed(token)), hidden_norm(hidden)], embedding first; the
    attention residual is the hidden, not the embedding (``norm_before_residual``: hidden_norm(hidden),
    as speculators' Eagle3FirstLayerMixin and vLLM's llama_eagle3.py compute it); no q_norm/k_norm.
  - the fed-back hidden is pre-norm; ``norm`` only precedes ``lm_head`` (draft vocabulary).
  - draft ids map to target ids by offsets: target = draft + d2t[draft].
  - the embedding table is the target's ``model.embed_tokens`` (not in the head's checkpoint).
  - pairing: draft position t consumes the target feature at t and the token at t+1.
Parameter names equal the AngelSlim checkpoint keys (``midlayer.*``, ``fc``, ``norm``, ``lm_head``), so
the key map (``Eagle3.key_map``) is the identity plus the exceptions it spells out; speculators heads
name the layer ``layers.0.*`` (``Eagle3Config.layout``).
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from xcompile.compile.config import Eagle3Config
from xcompile.compile.errors import CompileError
from xcompile.compile.models.keymap import ROPE_CACHE, KeyMap, Reader
from xcompile.compile.models.layers import MLP, Attention, RMSNorm, Rotary, Step, make_step, select_rows
from xcompile.runtime.enginedir.contract import EAGLE3, EAGLE3_FC, GraphSpec, KVShape, graph_spec

KIND = "eagle3"         # manifest ModelEntry.kind (compile/families.py)

_NAMES = (
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
)


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """A draft vocabulary's target ids, draft + d2t[draft], on d2t's device (the runtime's target_table)."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d [vocab] bool: which target ids the draft vocabulary covers (target = draft + d2t[draft])."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[target_ids(d2t)] = True
    return t2d


def check_d2t(vocab_size: int, d2t: torch.Tensor, where: str) -> None:
    """A draft vocabulary's d2t (an EAGLE3 head's, an MTP module's) maps draft ids to distinct target ids."""
    ids = target_ids(d2t)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise CompileError(f"{where}: tensor 'd2t' maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, "
                           f"outside the target vocabulary [0, {vocab_size}); d2t holds offsets "
                           "(target = draft + d2t[draft])")
    if ids.unique().numel() != ids.numel():
        raise CompileError(f"{where}: tensor 'd2t' maps {ids.numel() - ids.unique().numel()} draft id(s) to a target "
                           "id another draft id has; a draft vocabulary is distinct target tokens: re-train or "
                           "re-write the map")


def key_map(cfg: Eagle3Config) -> KeyMap:
    """AngelSlim / EAGLE / SpecForge layout (docs/eagle3.md §5-6: ``midlayer.*``), or the
    speculators one (``layers.0.*``: speculators Eagle3Speculator, which vLLM loads after renaming
    ``midlayer.`` to ``layers.0.``, llama_eagle3.py load_weights). The embedding is the target's."""
    def t2d(read: Reader) -> torch.Tensor:
        return t2d_from_d2t(read("d2t"), cfg.vocab_size)

    layer = re.escape(cfg.layout)
    return KeyMap(
        {n: n.replace("midlayer.", f"{cfg.layout}.", 1) for n in _NAMES},
        ignored={
            r"(model\.)?embed_tokens\.weight": "the head embeds tokens with the target's table (docs/eagle3.md §6.2)",
            rf"{layer}\.self_attn\.rotary_emb\.inv_freq": ROPE_CACHE,
            # speculators training keeps a frozen copy of the verifier's final norm and lm_head (Eagle3DraftModel)
            r"verifier_(norm|lm_head)\.weight": "the target's own norm/lm_head, copied for training only",
        },
        external=frozenset({"embed_tokens.weight"}),
        # t2d is unused at inference (vLLM/sglang skip it); some heads do not ship it
        derived={"t2d": t2d},
        checks={"d2t": partial(check_d2t, cfg.vocab_size)},
    )


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config, rotary: Rotary):
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   cfg.rms_norm_eps, rotary, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, emb, hidden, step: Step, k_cache, v_cache):
        normed = self.hidden_norm(hidden)                                               # [B, S, H]
        u = torch.cat((self.input_layernorm(emb), normed), dim=-1)                      # [B, S, 2H]
        a, k_cache, v_cache = self.self_attn(u, step, k_cache, v_cache)
        # residual = the hidden, not the embedding; normed first with norm_before_residual
        x = (normed if self.norm_before_residual else hidden) + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache


class Eagle3(nn.Module):
    """forward(input_ids [B,S], hidden_states [B,S,H], position_ids [B,S], write_index [B],
               tree_mask [B,S,W], logit_rows [B,R], past_key_0, past_value_0)
         -> logits [B,R,draft_vocab], hidden_out [B,S,H] (pre-norm), present_key_0, present_value_0
    """

    kind = KIND

    def __init__(self, cfg: Eagle3Config, max_seq_len: int, rope_theta: float | None = None):
        super().__init__()
        self.cfg, self.max_seq_len = cfg, max_seq_len
        # θ: reference inference reads config.rope_theta; the training code used 10000 (§6.3)
        self.rope_theta = cfg.rope_theta if rope_theta is None else rope_theta
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)      # the target's table, shared at load
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = MidLayer(cfg, Rotary(cfg.head_dim, max_seq_len, self.rope_theta, cfg.rope_scaling))
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

    def key_map(self) -> KeyMap:
        return key_map(self.cfg)

    def graphs(self, role: str = EAGLE3) -> list[tuple[str, nn.Module]]:
        """The contract graphs of a head: the ``eagle3_fc`` projection, then the ``eagle3`` step."""
        return [(EAGLE3_FC, Eagle3FC(self)), (EAGLE3, self)]

    def graph_spec(self, graph: str | None = None) -> GraphSpec:
        return graph_spec(EAGLE3)

    def graph_dims(self, max_batch: int) -> dict[str, int]:
        c = self.cfg
        return {"batch": max_batch, "draft_vocab": c.draft_vocab_size, "hidden": c.hidden_size,
                "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "max_seq_len": self.max_seq_len}

    def kv_shape(self, max_seq_len: int | None = None, batch: int = 1) -> KVShape:
        c = self.cfg
        return KVShape(1, c.num_key_value_heads, c.head_dim, max_seq_len or self.max_seq_len, batch)


class Eagle3FC(nn.Module):
    """The ``eagle3_fc`` graph: forward(hidden_taps [B,S,3H]) -> hidden_states [B,S,H]."""

    def __init__(self, head: Eagle3):
        super().__init__()
        self.fc = head.fc

    def forward(self, hidden_taps):
        return self.fc(hidden_taps)

    def graph_spec(self, graph: str | None = None) -> GraphSpec:
        return graph_spec(EAGLE3_FC)

    def graph_dims(self, max_batch: int) -> dict[str, int]:
        return {"batch": max_batch, "taps_hidden": self.fc.in_features, "hidden": self.fc.out_features}

    def kv_shape(self, max_seq_len: int | None = None, batch: int = 1) -> None:
        return None
