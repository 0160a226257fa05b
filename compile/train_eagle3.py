"""Distil an EAGLE3 head from a Qwen3 target with the "training-time test" recipe (compile/train.py).

docs/eagle3.md §8 (EAGLE ``traineagle3/cnets.py``, AngelSlim ``eagle3_trainer.py``):
  - the target (frozen) gives its three taps F [B, T, 3H] and logits for a window of tokens x;
  - pairing (§3): draft index t consumes F_t and token x_{t+1} and predicts x_{t+2};
  - ``ttt_steps`` unrolled steps: step 0 runs on fc(F), step j > 0 on step j-1's pre-norm output
    with the tokens shifted j further (index t reads x_{t+1+j}, predicts x_{t+2+j}, RoPE position t+j);
    step j at index t attends to step-0 keys at indices <= t and to steps 1..j keys at index t only,
    which is what a draft chain/tree sees at inference (prefix + ancestors + itself);
  - loss_j = soft cross-entropy against the target distribution restricted to the draft vocabulary
    and renormalised, at positions whose target argmax is in it; total = sum_j 0.8^j loss_j;
  - draft vocabulary = the N most frequent tokens of the data, ascending; d2t[i] = tok[i] - i;
  - the embedding table is the target's, frozen.
The head is written in the AngelSlim layout that ``checkpoint.load_eagle3`` reads. The loop, the files-in /
dir-out path and the acceptance check are compile/train.py's, shared with ``xcompile train-mtp``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from xcompile.compile.checkpoint import load_eagle3
from xcompile.compile.config import Eagle3Config, Qwen3Config, synthetic_eagle3_config
from xcompile.compile.errors import CompileOptionError
from xcompile.compile.models.eagle3 import Eagle3, target_ids
from xcompile.compile.train import (
    HEAD_INIT_STD,
    Recipe,
    StepLoss,
    TrainOptions,
    TrainResult,
    check_target,
    train_files,
    train_head,
)
from xcompile.compile.ttt import soft_targets, target_features, ttt_attention, ttt_loss

# --------------------------------------------------------------------------------------------
# the recipe's pieces


def draft_vocabulary(windows: torch.Tensor, vocab_size: int, size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent tokens of ``windows`` (ties: lower id first; unseen ids fill up),
    ascending -> (tokens [N] int64, d2t [N] int64 = tokens - arange, t2d [V] bool)."""
    if not 0 < size <= vocab_size:
        raise CompileOptionError(f"--draft-vocab {size} must be between 1 and the target's vocab_size {vocab_size}")
    counts = torch.bincount(windows.flatten(), minlength=vocab_size)
    top = torch.sort(counts, descending=True, stable=True).indices[:size]        # stable: ties by id
    tokens = torch.sort(top).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[tokens] = True
    return tokens, tokens - torch.arange(size), t2d


def ttt_forward(head: Eagle3, input_ids: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Unrolled draft steps on a window. input_ids [B, T], taps [B, T, 3H] -> per step j draft-vocab
    logits [B, T, Vd]; index t of step j predicts x_{t+2+j} (indices t > T-3-j are padding, ignore them).

    The head's own submodules, in MidLayer's order, with the per-step K/V concatenated under
    ``ttt_mask`` instead of a KV cache (the cache layout cannot hold one entry per step and index)."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    hidden = head.project(taps)                                                   # [B, T, H]
    keys, values, logits = [], [], []
    for j in range(steps):
        tokens = F.pad(input_ids[:, 1 + j:], (0, 1 + j))                          # index t -> x_{t+1+j}
        u = torch.cat((layer.input_layernorm(head.embed_tokens(tokens)), layer.hidden_norm(hidden)), dim=-1)
        x = hidden + ttt_attention(attn, u, positions, j, keys, values)           # residual = hidden
        hidden = x + layer.mlp(layer.post_attention_layernorm(x))                 # pre-norm, fed back
        logits.append(head.lm_head(head.norm(hidden)))
    return logits


# --------------------------------------------------------------------------------------------
# the head and its loss


def head_config(target_cfg: Qwen3Config, draft_vocab: int) -> Eagle3Config:
    """A one-layer head of the target's attention/MLP shape (as AngelSlim builds them); RoPE θ is the
    target's, and inference reads it back from the head's config (§6.3), so train and serve agree."""
    return replace(synthetic_eagle3_config(target_cfg), draft_vocab_size=draft_vocab)


def new_head(target, draft_vocab: int, windows: torch.Tensor, max_seq_len: int, seed: int) -> Eagle3:
    """A freshly initialised head sharing the target's (frozen) embedding, with the draft vocabulary
    of ``windows``. fp32 master weights on the target's device."""
    torch.manual_seed(seed)
    cfg = head_config(target.cfg, min(draft_vocab, target.cfg.vocab_size))
    head = Eagle3(cfg, max_seq_len)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=HEAD_INIT_STD)
    tokens, d2t, t2d = draft_vocabulary(windows, cfg.vocab_size, cfg.draft_vocab_size)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    head.to(next(target.parameters()).device)
    head.embed_tokens.weight = target.model.embed_tokens.weight                  # shared, frozen
    return head


def eagle3_loss(target, head: Eagle3, opts: TrainOptions) -> StepLoss:
    """The head's TTT loss against the target's distribution over the draft vocabulary."""
    tokens = target_ids(head.d2t)

    def loss(ids: torch.Tensor, kv: list[torch.Tensor]):
        logits, taps = target_features(target, ids, kv)
        soft = soft_targets(logits, tokens, head.t2d)
        del logits
        return ttt_loss(ttt_forward(head, ids, taps, opts.ttt_steps), soft, tokens)
    return loss


def train_eagle3(target, windows: torch.Tensor, opts: TrainOptions, heldout: torch.Tensor | None = None,
                 log: Callable[[str], None] = print) -> TrainResult:
    """Distil a head from ``target`` (a ``models.qwen3.Qwen3`` with the head's taps; bf16 on CUDA, where
    the head trains under bf16 autocast) on packed token windows [N, seq_len]. Returns the trained
    head (fp32 master weights) and its log."""
    check_target(target, windows, opts, "train_eagle3")
    head = new_head(target, opts.draft_vocab, windows, windows.shape[1] + opts.ttt_steps, opts.seed)
    whole = (f", the target's whole vocabulary: --draft-vocab {opts.draft_vocab} asks for more"
             if opts.draft_vocab > target.cfg.vocab_size else "")
    log(f"train-eagle3: draft vocab {len(head.d2t)} (covers {float(head.t2d.cpu()[windows].float().mean()):.1%} of "
        f"the data{whole})")
    return train_head(target, head, eagle3_loss(target, head, opts), windows, opts, heldout, log)


# --------------------------------------------------------------------------------------------
# files in, head dir out


def save_head(head: Eagle3, out: str | Path, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None) -> Path:
    """Write ``head`` as an AngelSlim-layout checkpoint dir: config.json (``Eagle3LlamaForCausalLM``)
    and model.safetensors with fc, midlayer.*, norm, lm_head, d2t, t2d (no embedding: the target's)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    c = head.cfg
    config = {
        "architectures": [c.architecture], "model_type": "llama", "target_model_type": "qwen3",
        "torch_dtype": str(dtype).removeprefix("torch."), "attention_bias": False, "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "head_dim": c.head_dim,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": head.rope_theta,
        "rope_scaling": c.rope_scaling.to_hf() if c.rope_scaling else None,                # what the head computes
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
    }
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
               for name, t in head.state_dict().items() if not name.startswith("embed_tokens.")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if metadata is not None:
        (out / "xcompile_train.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return out


EAGLE3_RECIPE = Recipe("train-eagle3", lambda cfg: cfg.default_tap_layers, train_eagle3, save_head,
                       lambda out, target: load_eagle3(out, target, target.max_seq_len))


def train_eagle3_files(model: str | Path, data: str | Path, out: str | Path, opts: TrainOptions,
                       heldout_data: str | Path | None = None, regenerate: bool = False,
                       max_new_tokens: int = 256, log: Callable[[str], None] = print,
                       revision: str | None = None, force: bool = False) -> TrainResult:
    """``xcompile train-eagle3``: ``train_files`` with the EAGLE3 recipe (the head config's default taps)."""
    return train_files(EAGLE3_RECIPE, model, data, out, opts, heldout_data, regenerate, max_new_tokens, log,
                       revision, force)


