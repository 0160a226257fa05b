"""MTP drafter: DeepSeek-V3's multi-token-prediction module for a Qwen3 target, with its own KV cache.

One module predicts the token after next (DeepSeek-V3 technical report §2.2, "Multi-Token Prediction"):

    h' = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])      embedding first, then the target feature (2H -> H)
    x  = Qwen3 decoder layer(h')                           its own attention over its own KV, q/k norms
    logits = head(shared_head.norm(x))                     the target's lm_head, or the rows of its draft vocabulary

``h_i`` is the target's last hidden: the raw residual stream after its last layer, before the final norm
(a tap of layer L-1; Manifest.tap_columns says which columns of hidden_taps). ``embed`` and ``head`` are the
target's tensors, shared, never stored in the module's checkpoint. A module may carry a draft vocabulary
(config.json ``draft_vocab_size``, tensor ``d2t`` as an EAGLE3 head's: target = draft + d2t[draft]): its head is
then those rows of the target's lm_head, gathered at load, the most frequent tokens of its training text, as
FR-Spec restricts a shared head (Zhao et al. 2025). On the Qwen3-8B shape the whole head is 1.24 GB a draft
step, 2.2x an EAGLE3 step (docs/performance.md, paradigms-8b); 32,000 rows read a fifth of it. Chained for
gamma > 1 as vLLM and SGLang chain one DeepSeek MTP layer: the module's own pre-norm output x is fed back as the next step's h. The
pairing is EAGLE3's: draft position t reads the feature at t and the token at t+1.

Parameter names are DeepSeek-V3's names for its MTP layer (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, and the decoder block's names flat beside them) without the ``model.layers.61.`` prefix.
The checkpoint (``xcompile train-mtp`` writes it) is a Qwen3-style config.json with architecture
``Qwen3MTPModule`` and one layer, and a model.safetensors of those names.

The graph (``mtp``) has the ``eagle3`` graph's inputs and outputs, logits over the module's ``draft_vocab`` (the
target vocabulary when it has none), its d2t in the engine dir's ``mtp_d2t.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from xcompile.compile.config import EAGLE3_DRAFT_VOCAB, Qwen3Config
from xcompile.compile.errors import CompileError
from xcompile.compile.hf_config import parse_qwen3, read_json
from xcompile.compile.models.eagle3 import check_d2t, target_ids
from xcompile.compile.models.keymap import ROPE_CACHE, KeyMap
from xcompile.compile.models.layers import RMSNorm, Rotary, make_step, select_rows
from xcompile.compile.models.qwen3 import _LAYER, DecoderLayer
from xcompile.runtime.enginedir.contract import MTP as GRAPH
from xcompile.runtime.enginedir.contract import GraphSpec, KVShape, graph_spec

KIND = "mtp"                        # manifest ModelEntry.kind (compile/families.py)
ARCHITECTURE = "Qwen3MTPModule"     # config.json ``architectures`` of a module xcompile trains

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def parse_mtp(path: Path, data: dict | None = None) -> Qwen3Config:
    """An MTP module's config.json: a Qwen3 config of one layer with architecture ``Qwen3MTPModule``."""
    path = Path(path)
    data = read_json(path) if data is None else data
    cfg = parse_qwen3(path, data, (ARCHITECTURE,))
    if cfg.num_hidden_layers != 1:
        raise CompileError(f"{path}: field 'num_hidden_layers' is {cfg.num_hidden_layers}; an MTP module is one "
                           "decoder layer (DeepSeek-V3's depth-1 module, chained at inference)")
    if cfg.attention_bias:
        raise CompileError(f"{path}: field 'attention_bias' is true; the MTP module's attention has no biases")
    return cfg


def draft_vocab_size(path: Path, data: dict, vocab_size: int) -> int | None:
    """config.json's optional ``draft_vocab_size`` (None: the module reads the whole target vocabulary)."""
    size = data.get("draft_vocab_size")
    if size is None or size == vocab_size:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size < vocab_size:
        raise CompileError(f"{path}: field 'draft_vocab_size' is {size!r}; expected a count of target tokens, 1 to "
                           f"{vocab_size} (the vocabulary), or no field for the whole vocabulary")
    return size


def synthetic_draft_vocab(cfg: Qwen3Config) -> int | None:
    """A synthetic module's draft vocabulary: EAGLE3's synthetic size (32,000) where the vocabulary is larger."""
    return EAGLE3_DRAFT_VOCAB if cfg.vocab_size > EAGLE3_DRAFT_VOCAB else None


def manifest_extra(target: Qwen3Config, draft_vocab: int | None) -> dict:
    """The module's manifest ``extra``: the target tap it reads and its draft vocabulary's size, if any."""
    return {"tap": last_layer_tap(target), **({"draft_vocab": draft_vocab} if draft_vocab else {})}


def mtp_config(target: Qwen3Config, intermediate_size: int | None = None) -> Qwen3Config:
    """The MTP module shape for ``target``: one layer of the target's attention shape (and MLP, unless
    ``intermediate_size``), without attention biases (the module has none)."""
    from dataclasses import replace
    return replace(target, num_hidden_layers=1, intermediate_size=intermediate_size or target.intermediate_size,
                   attention_bias=False)


def check_mtp_fits(cfg: Qwen3Config, target: Qwen3Config, where: str) -> None:
    """The module embeds with the target's table and reads its logits through the target's head."""
    for name in ("hidden_size", "vocab_size"):
        if getattr(cfg, name) != getattr(target, name):
            raise CompileError(f"{where}: field '{name}' is {getattr(cfg, name)}, the target's is "
                               f"{getattr(target, name)}; an MTP module shares the target's embedding and head: "
                               "train one for this target (xcompile train-mtp)")


def write_config(cfg: Qwen3Config, path: Path, draft_vocab: int | None = None) -> None:
    """The module's config.json (what parse_mtp and draft_vocab_size read back)."""
    data = {"architectures": [ARCHITECTURE], "model_type": "qwen3_mtp", **cfg.to_dict()}
    if draft_vocab is not None:
        data["draft_vocab_size"] = draft_vocab
    data["rope_scaling"] = cfg.rope_scaling.to_hf() if cfg.rope_scaling else None
    data.pop("tie_word_embeddings")                     # the target's to decide
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def key_map(cfg: Qwen3Config, tied: bool, draft_vocab: int | None = None) -> KeyMap:
    """Our names are the checkpoint's; the embedding and the head are the target's (``external``; with a draft
    vocabulary the head is a copy of its rows, never the embedding itself)."""
    names = [*_OWN, *_LAYER, *(["d2t"] if draft_vocab else [])]
    return KeyMap(
        {n: n for n in names},
        ignored={r"self_attn\.rotary_emb\.inv_freq": ROPE_CACHE,
                 r"(embed_tokens|shared_head\.head)\.weight": "the target's embedding and lm_head, shared"},
        external=frozenset({"embed_tokens.weight"} | (set() if tied and not draft_vocab
                                                      else {"shared_head.head.weight"})),
        checks={"d2t": lambda d2t, where: check_d2t(cfg.vocab_size, d2t, where)} if draft_vocab else {},
    )


class SharedHead(nn.Module):
    def __init__(self, cfg: Qwen3Config, rows: int):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, rows, bias=False)     # the target's lm_head (or its draft rows)


class MTP(DecoderLayer):
    """forward(input_ids [B,S], hidden_states [B,S,H], position_ids [B,S], write_index [B],
               tree_mask [B,S,W], logit_rows [B,R], past_key_0, past_value_0)
         -> logits [B,R,V], hidden_out [B,S,H] (pre-norm), present_key_0, present_value_0

    The decoder layer's parameters sit at the top level (DeepSeek's layout), so this is a DecoderLayer with
    the input projection and the shared head around it. ``tied``: the target ties lm_head to its embedding.
    ``draft_vocab``: the head holds that many of the target's rows (``head_rows``), logits over them.
    """

    kind = KIND

    def __init__(self, cfg: Qwen3Config, max_seq_len: int, tied: bool = False, draft_vocab: int | None = None):
        rotary = Rotary(cfg.head_dim, max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        super().__init__(cfg, rotary)
        self.cfg, self.max_seq_len, self.tied, self.draft_vocab = cfg, max_seq_len, tied, draft_vocab
        h = cfg.hidden_size
        self.rotary = rotary
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)     # the target's table, shared at load
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(cfg, draft_vocab or cfg.vocab_size)
        if draft_vocab:
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        elif tied:
            self.shared_head.head.weight = self.embed_tokens.weight

    def head_rows(self) -> torch.Tensor | None:
        """The target ids of the head's rows (draft + d2t[draft]); None: the whole vocabulary in order."""
        return target_ids(self.d2t) if self.draft_vocab else None

    @torch.no_grad()
    def gather_head(self, lm_head: torch.Tensor) -> None:
        """With a draft vocabulary: its rows of the target's ``lm_head`` into the module's own head, per d2t."""
        self.shared_head.head.weight.copy_(lm_head[self.head_rows()])

    def project(self, input_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """h' = eh_proj([enorm(embed(ids)), hnorm(hidden)]) [B, S, H]."""
        u = torch.cat((self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden_states)), dim=-1)
        return self.eh_proj(u)

    def forward(self, input_ids, hidden_states, position_ids, write_index, tree_mask, logit_rows, k_cache, v_cache):
        x = self.project(input_ids, hidden_states)
        c = self.cfg
        step = make_step(position_ids, write_index, tree_mask, self.max_seq_len, x.dtype, self.rotary,
                         c.num_attention_heads // c.num_key_value_heads)
        x, k_cache, v_cache = super().forward(x, step, k_cache, v_cache)
        logits = self.shared_head.head(self.shared_head.norm(select_rows(x, logit_rows)))
        return logits, x, k_cache, v_cache

    def new_kv(self, batch: int = 1, device=None, dtype=None) -> list[torch.Tensor]:
        c = self.cfg
        dtype = dtype or self.eh_proj.weight.dtype
        shape = (batch, c.num_key_value_heads, self.max_seq_len, c.head_dim)
        return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(2)]

    def key_map(self) -> KeyMap:
        return key_map(self.cfg, self.tied, self.draft_vocab)

    def graphs(self, role: str = GRAPH) -> list[tuple[str, nn.Module]]:
        return [(GRAPH, self)]

    def graph_spec(self, graph: str | None = None) -> GraphSpec:
        return graph_spec(GRAPH)

    def graph_dims(self, max_batch: int) -> dict[str, int]:
        c = self.cfg
        return {"batch": max_batch, "draft_vocab": self.draft_vocab or c.vocab_size, "hidden": c.hidden_size,
                "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "max_seq_len": self.max_seq_len}

    def kv_shape(self, max_seq_len: int | None = None, batch: int = 1) -> KVShape:
        c = self.cfg
        return KVShape(1, c.num_key_value_heads, c.head_dim, max_seq_len or self.max_seq_len, batch)


def last_layer_tap(target: Qwen3Config) -> int:
    """The tap the module reads: the output of the target's last layer (0-based)."""
    return target.num_hidden_layers - 1


def target_taps(taps: tuple[int, ...] | list[int], target: Qwen3Config) -> tuple[int, ...]:
    """A target's taps with an MTP module: ``taps`` (EAGLE3's) sorted, then the last layer's, which comes last
    (the order Manifest.tap_columns reads)."""
    return (*sorted(taps), last_layer_tap(target))
