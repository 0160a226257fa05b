"""Qwen3 (dense) as one forward over S new tokens against preallocated per-layer KV buffers.

The call is the ``target`` graph of the I/O contract (runtime/enginedir/contract.py): prefill, decode and
chain/tree verify differ only in the inputs. Parameter names equal the HF checkpoint keys, so the
weight key map (``Qwen3.key_map``) is the identity plus the exceptions it spells out.
"""

from __future__ import annotations

import torch
from torch import nn

from xcompile.compile.config import Qwen3Config
from xcompile.compile.models.keymap import ROPE_CACHE, KeyMap
from xcompile.compile.models.layers import MLP, Attention, RMSNorm, Rotary, Step, make_step, select_rows
from xcompile.runtime.enginedir.contract import DRAFT, TARGET, GraphSpec, KVShape, graph_spec
from xcompile.runtime.engines.qweight import QWeight

KIND = "qwen3"          # manifest ModelEntry.kind (compile/families.py)

_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")


def key_map(cfg: Qwen3Config) -> KeyMap:
    """Qwen3ForCausalLM: HF keys are our names. Tied embeddings have no lm_head of their own."""
    layer = _LAYER + (_BIAS if cfg.attention_bias else ())
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    names += [f"model.layers.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in layer]
    ignored = {r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq": ROPE_CACHE}
    if cfg.tie_word_embeddings:
        ignored[r"lm_head\.weight"] = "tie_word_embeddings: the output projection is model.embed_tokens.weight"
    else:
        names.append("lm_head.weight")
    return KeyMap({n: n for n in names}, ignored)


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
        self.rotary = rotary = Rotary(cfg.head_dim, max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3(nn.Module):
    """Qwen3ForCausalLM with a static KV cache and EAGLE3 taps.

    forward(input_ids [B,S], position_ids [B,S], write_index [B], tree_mask [B,S,S] bool,
            logit_rows [B,R], *kv: past_key_0, past_value_0, ... [B,Hkv,S_max,D])
      -> logits [B,R,V], hidden_taps [B,S,3H] (if taps), present_key_0, present_value_0, ...

    ``taps`` are 0-based output-of-layer ids: the raw residual stream after those layers, before
    the final norm, concatenated low to high (docs/eagle3.md §1.2).
    """

    kind = KIND

    def __init__(self, cfg: Qwen3Config, max_seq_len: int, taps: tuple[int, ...] | None = None):
        super().__init__()
        self.cfg, self.max_seq_len = cfg, max_seq_len
        self.taps = tuple(sorted(taps)) if taps else ()     # duplicates allowed (tiny models)
        # a quantized checkpoint's linears as codes and scales (runtime/engines/qweight.py) by state name, for
        # the fast kernels, when the loader is asked to keep them (compile/reference.py); the parameters
        # always hold the weights dequantized
        self.quantized: dict[str, QWeight] = {}
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

    def key_map(self) -> KeyMap:
        return key_map(self.cfg)

    def graphs(self, role: str) -> list[tuple[str, nn.Module]]:
        """The contract graphs this module runs as in an engine dir: itself, as ``role`` (target or draft)."""
        return [(role, self)]

    def graph_spec(self, graph: str | None = None) -> GraphSpec:
        """The contract of ``graph`` for this module; by default a Qwen3 with taps is the target, without the draft."""
        return graph_spec(graph or (TARGET if self.taps else DRAFT), self.cfg.num_hidden_layers)

    def graph_dims(self, max_batch: int) -> dict[str, int]:
        """Concrete sizes of the contract's fixed symbolic dims."""
        c = self.cfg
        dims = {"batch": max_batch, "vocab": c.vocab_size, "hidden": c.hidden_size,
                "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "max_seq_len": self.max_seq_len}
        if self.taps:
            dims["taps_hidden"] = len(self.taps) * c.hidden_size
        return dims

    def kv_shape(self, max_seq_len: int | None = None, batch: int = 1) -> KVShape:
        c = self.cfg
        return KVShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_seq_len or self.max_seq_len,
                       batch)
