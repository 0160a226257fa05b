"""The "training-time test" pieces every drafter trainer shares (train.py's docstring gives the recipe): the mask
and attention of the unrolled draft steps, the target's soft targets over the draft vocabulary, the decayed
per-step loss, and the frozen target's logits and taps for a window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xcompile.compile.models.layers import grouped_attention

STEP_DECAY = 0.8            # EAGLE3 step weights 0.8^j (traineagle3/cnets.py)


def ttt_mask(seq_len: int, step: int, device=None) -> torch.Tensor:
    """Keys visible to the queries of unrolled step ``step``: bool [T, (step+1)*T] over the keys of
    steps 0..step concatenated. Step 0 keys: causal (index <= t); keys of steps 1..step: index t only."""
    i = torch.arange(seq_len, device=device)
    causal, diagonal = i[None, :] <= i[:, None], i[None, :] == i[:, None]
    return torch.cat([causal] + [diagonal] * step, dim=1)


def ttt_attention(attn, u: torch.Tensor, positions: torch.Tensor, step: int, keys: list[torch.Tensor],
                  values: list[torch.Tensor]) -> torch.Tensor:
    """Unrolled step ``step``'s attention of a draft layer over u [B, T, *]: q/k/v (q/k norms where the layer has
    them), RoPE at positions + step, this step's K/V appended to ``keys`` / ``values`` and attended under
    ``ttt_mask`` (instead of a KV cache, which cannot hold one entry per step and index) -> o_proj's output."""
    b, t, _ = u.shape
    q = attn.q_proj(u).view(b, t, attn.heads, attn.head_dim)
    k = attn.k_proj(u).view(b, t, attn.kv_heads, attn.head_dim)
    v = attn.v_proj(u).view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)        # [B, Hkv, T, D]
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = attn.rotary(q.transpose(1, 2), positions + step), attn.rotary(k.transpose(1, 2), positions + step)
    keys.append(k)
    values.append(v)
    mask = ttt_mask(t, step, u.device)[None, None]                                    # [1, 1, T, (step+1)T]
    y = grouped_attention(q, torch.cat(keys, 2), torch.cat(values, 2), mask)
    return attn.o_proj(y.transpose(1, 2).reshape(b, t, -1))


@dataclass
class SoftTargets:
    """The target's view of a window, restricted to the draft vocabulary."""

    probs: torch.Tensor             # [B, T, Vd] fp32, softmax over the draft columns of the logits
    argmax: torch.Tensor            # [B, T] target ids (over the full vocabulary)
    in_draft: torch.Tensor          # [B, T] bool, argmax is in the draft vocabulary


def soft_targets(target_logits: torch.Tensor, tokens: torch.Tensor | None = None, t2d: torch.Tensor | None = None
                 ) -> SoftTargets:
    """The target's logits [B, T, V] restricted to the draft vocabulary ``tokens`` [Vd] and renormalised (None:
    the whole vocabulary, which holds every argmax; no copy of the logits)."""
    argmax = target_logits.argmax(-1)
    if tokens is None:
        return SoftTargets(torch.softmax(target_logits.float(), -1), argmax, torch.ones_like(argmax, dtype=torch.bool))
    return SoftTargets(torch.softmax(target_logits[..., tokens].float(), -1), argmax, t2d[argmax])


def ttt_loss(logits: list[torch.Tensor], soft: SoftTargets, tokens: torch.Tensor,
             decay: float = STEP_DECAY) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (sum_j decay^j loss_j, per-step losses [J], per-step top-1 accuracy [J]).

    Step j's index t is scored against the target at position t+1+j (it predicts x_{t+2+j}). Loss is
    averaged over positions whose target argmax the draft vocabulary holds (§8); accuracy (draft
    argmax mapped to target ids == target argmax) over all positions, as acceptance would count it."""
    t = soft.argmax.shape[1]
    losses, accs = [], []
    for j, lg in enumerate(logits):
        n = t - 1 - j                                                             # indices 0..T-2-j
        probs, argmax = soft.probs[:, 1 + j:], soft.argmax[:, 1 + j:]
        keep = soft.in_draft[:, 1 + j:].float()
        ce = -(probs * torch.log_softmax(lg[:, :n].float(), -1)).sum(-1)          # [B, n]
        losses.append((ce * keep).sum() / keep.sum().clamp(min=1))
        accs.append((tokens[lg[:, :n].argmax(-1)] == argmax).float().mean())
    losses, accs = torch.stack(losses), torch.stack(accs)
    weights = decay ** torch.arange(len(logits), device=losses.device, dtype=losses.dtype)
    return (weights * losses).sum(), losses.detach(), accs.detach()


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, kv: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal target pass over fresh windows: (logits [B, T, V], taps [B, T, taps x H])."""
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril().expand(b, t, t)
    start = torch.zeros(b, dtype=torch.int64, device=input_ids.device)
    out = target(input_ids, positions, start, causal, positions, *kv)
    return out[0], out[1]
