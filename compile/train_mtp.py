"""Train an MTP module (compile/models/mtp.py) for a frozen Qwen3 target: ``xcompile train-mtp``.

The EAGLE3 trainer's recipe and habits (compile/train.py: TTT unroll, loop, staged output, held-out
evaluation, acceptance through the runtime), with the MTP module in the head's place:
  - the target (frozen) gives its last layer's output h [B, T, H] (its one tap, layer L-1) and its logits;
  - step 0 at index t reads h_t and token x_{t+1} and predicts x_{t+2}; step j > 0 reads step j-1's pre-norm
    output and x_{t+1+j}, as the chained module does at inference (DeepSeek-V3 trains one depth; chaining
    one module for gamma > 1, as vLLM and SGLang do, is what the unroll teaches it);
  - a draft vocabulary (``--draft-vocab``, EAGLE3's: the N most frequent tokens of the data) picks the rows of
    the target's lm_head the module reads; loss_j = soft cross-entropy against the target's distribution at
    t+1+j over those tokens (over the whole vocabulary when N reaches it);
  - the embedding and lm_head (rows) are the target's, frozen; the rest starts at std 0.02 (norms at 1).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from xcompile.compile.checkpoint import build_mtp, load_mtp
from xcompile.compile.errors import CompileError
from xcompile.compile.models import mtp
from xcompile.compile.models.eagle3 import t2d_from_d2t
from xcompile.compile.synthetic import SyntheticSource
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
from xcompile.compile.train_eagle3 import draft_vocabulary
from xcompile.compile.ttt import soft_targets, target_features, ttt_attention, ttt_loss

SHARED = ("embed_tokens.weight", "shared_head.head.weight")     # the target's tensors, never written


def ttt_forward(module: mtp.MTP, input_ids: torch.Tensor, last: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Unrolled MTP steps on a window. input_ids [B, T], last [B, T, H] (the target's last layer output) -> per
    step j logits [B, T, Vd] over the module's head rows; index t of step j predicts x_{t+2+j} (indices
    t > T-3-j are padding).

    The module's own submodules in its forward's order, with the per-step K/V concatenated under ``ttt_mask``
    instead of a KV cache (compile/train_eagle3.py's ttt_forward, with q/k norms and the eh_proj input)."""
    attn = module.self_attn
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    hidden = last
    keys, values, logits = [], [], []
    for j in range(steps):
        tokens = F.pad(input_ids[:, 1 + j:], (0, 1 + j))                          # index t -> x_{t+1+j}
        x = module.project(tokens, hidden)                                         # [B, T, H]
        x = x + ttt_attention(attn, module.input_layernorm(x), positions, j, keys, values)
        hidden = x + module.mlp(module.post_attention_layernorm(x))                # pre-norm, fed back
        logits.append(module.shared_head.head(module.shared_head.norm(hidden)))
    return logits


def mtp_loss(target, module: mtp.MTP, opts: TrainOptions) -> StepLoss:
    """The module's TTT loss against the target's next-token distribution over its head's tokens."""
    rows = module.head_rows()
    vocab = torch.arange(module.cfg.vocab_size, device=module.eh_proj.weight.device) if rows is None else rows
    covered = None if rows is None else t2d_from_d2t(module.d2t, module.cfg.vocab_size)

    def loss(ids: torch.Tensor, kv: list[torch.Tensor]):
        logits, last = target_features(target, ids, kv)
        soft = soft_targets(logits) if rows is None else soft_targets(logits, rows, covered)
        del logits
        return ttt_loss(ttt_forward(module, ids, last, opts.ttt_steps), soft, vocab)
    return loss


def new_mtp(target, max_seq_len: int, seed: int, windows: torch.Tensor | None = None,
            draft_vocab: int | None = None) -> mtp.MTP:
    """A fresh module for ``target`` (one layer of its shape) sharing its embedding and lm_head (with
    ``draft_vocab``: the rows of the most frequent tokens of ``windows``): linears at std 0.02 and norms at 1
    (seeded), fp32 master weights on the target's device, trainable but for the target's tensors."""
    vocab = draft_vocab if draft_vocab and draft_vocab < target.cfg.vocab_size else None
    module = build_mtp(SyntheticSource("mtp-init", seed, HEAD_INIT_STD), mtp.mtp_config(target.cfg), target,
                       max_seq_len, vocab)
    if vocab:
        _, d2t, _ = draft_vocabulary(windows, target.cfg.vocab_size, vocab)
        module.d2t.copy_(d2t)
        module.gather_head(target.lm_head.weight)
    shared = {id(p) for p in target.parameters()} | {id(module.shared_head.head.weight)}
    for owner in module.modules():
        for attr, p in list(owner.named_parameters(recurse=False)):
            if id(p) not in shared:
                setattr(owner, attr, nn.Parameter(p.detach().float(), requires_grad=True))
    return module.train()


def train_mtp(target, windows: torch.Tensor, opts: TrainOptions, heldout: torch.Tensor | None = None,
              log: Callable[[str], None] = print) -> TrainResult:
    """Train a module for ``target`` (a Qwen3 tapping its last layer alone; bf16 on CUDA, where the module trains
    under bf16 autocast) on packed token windows [N, seq_len]."""
    check_target(target, windows, opts, "train_mtp")
    if target.taps != (mtp.last_layer_tap(target.cfg),):
        raise CompileError(f"train_mtp needs the target tapping its last layer alone, got taps {list(target.taps)}")
    module = new_mtp(target, windows.shape[1] + opts.ttt_steps, opts.seed, windows, opts.draft_vocab)
    rows = module.head_rows()
    vocab = (f"whole vocabulary ({target.cfg.vocab_size})" if rows is None else
             f"draft vocabulary {len(rows)} of {target.cfg.vocab_size} (covers "
             f"{float(torch.isin(windows, rows.cpu()).float().mean()):.1%} of the data's tokens)")
    log(f"train-mtp: one {target.cfg.hidden_size}-wide layer over the target's last hidden, {vocab}")
    return train_head(target, module, mtp_loss(target, module, opts), windows, opts, heldout, log)


def save_mtp(module: mtp.MTP, out: str | Path, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None
             ) -> Path:
    """Write ``module`` as config.json (``Qwen3MTPModule``) and model.safetensors without the target's tensors."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(dtype if t.is_floating_point() else t.dtype).cpu().contiguous()
               for name, t in module.state_dict().items() if name not in SHARED}     # d2t stays int64
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    mtp.write_config(module.cfg, out / "config.json", module.draft_vocab)
    if metadata is not None:
        (out / "xcompile_train.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return out


MTP_RECIPE = Recipe("train-mtp", lambda cfg: (mtp.last_layer_tap(cfg),), train_mtp, save_mtp,
                    lambda out, target: load_mtp(out, target, target.max_seq_len))


def train_mtp_files(model: str | Path, data: str | Path, out: str | Path, opts: TrainOptions,
                    heldout_data: str | Path | None = None, regenerate: bool = False, max_new_tokens: int = 256,
                    log: Callable[[str], None] = print, revision: str | None = None,
                    force: bool = False) -> TrainResult:
    """``xcompile train-mtp``: compile/train.py's ``train_files`` with the MTP recipe."""
    return train_files(MTP_RECIPE, model, data, out, opts, heldout_data, regenerate, max_new_tokens, log, revision,
                       force)
