"""The EAGLE3 head against an independent reference written here from docs/eagle3.md §2
as plain tensor math on the checkpoint's state dict (not through the module's submodules).
fp32; tolerance 1e-4 absolute."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fixtures import step_inputs
from safetensors.torch import load_file

from xcompile.compile.checkpoint import load_eagle3, load_qwen3
from xcompile.compile.head_config import parse_eagle3
from xcompile.compile.models.eagle3 import Eagle3FC

TOL = 1e-4
MAX_SEQ = 32
SENTINEL = 7.0      # stale KV rows: finite, so a leak into attention would change the output


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """x [S, H, D], rotate-half convention, cos/sin = cat(freqs, freqs)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([pos[:, None].double() * inv_freq] * 2, dim=-1)[:, None]          # [S, 1, D]
    x1, x2 = x.chunk(2, dim=-1)
    return (x * ang.cos() + torch.cat((-x2, x1), -1) * ang.sin()).float()


def reference_head(sd, embed, cfg, tokens, g, pos, theta):
    """One sequence, causal over all S rows. tokens [S], g [S, H] (fc output or fed-back hidden).
    Returns draft logits [S, Vd], pre-norm hidden [S, H], roped keys and values [Hkv, S, D]."""
    w = lambda n: sd[f"midlayer.{n}.weight"]                                            # noqa: E731
    s, eps, nh, nkv, d = len(tokens), cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    u = torch.cat([rms(embed[tokens], w("input_layernorm"), eps), rms(g, w("hidden_norm"), eps)], -1)  # emb first
    q = rope((u @ w("self_attn.q_proj").T).view(s, nh, d), pos, theta)
    k = rope((u @ w("self_attn.k_proj").T).view(s, nkv, d), pos, theta)
    v = (u @ w("self_attn.v_proj").T).view(s, nkv, d)
    kr, vr = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)      # GQA: kv head j serves q heads
    scores = torch.einsum("shd,thd->hst", q, kr) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    a = torch.einsum("hst,thd->shd", scores.softmax(-1), vr).reshape(s, nh * d)
    x = g + a @ w("self_attn.o_proj").T                                                 # residual = hidden
    h = rms(x, w("post_attention_layernorm"), eps)
    x = x + (F.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    logits = rms(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T                  # norm only before lm_head
    return logits, x, k.transpose(0, 1), v.transpose(0, 1)


@pytest.fixture(scope="module")
def setup(tiny_target, tiny_eagle3):
    target = load_qwen3(tiny_target, MAX_SEQ, taps=(0, 2, 3))       # tiny 4-layer defaults (0, L/2, L-1)
    head = load_eagle3(tiny_eagle3, target, MAX_SEQ)
    sd = load_file(tiny_eagle3 / "model.safetensors")
    embed = load_file(tiny_target / "model.safetensors")["model.embed_tokens.weight"]
    return target, head, sd, embed, parse_eagle3(tiny_eagle3 / "config.json")


def prompt_pass(target, head, prompt, kv):
    """Target prefill, then the head over all prompt positions: pairs (F_t, x_{t+1}), x_L = root."""
    L = prompt.shape[1]
    with torch.no_grad():
        logits, taps, *_ = target(*step_inputs(prompt).values(), *target.new_kv())
        root = logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([prompt[:, 1:], root], 1)
        out = head(**step_inputs(tokens), hidden_states=head.project(taps), k_cache=kv[0], v_cache=kv[1])
    assert tokens.shape[1] == L
    return taps, tokens, out


def test_first_step_on_target_features(setup):
    target, head, sd, embed, cfg = setup
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    taps, tokens, (logits, hidden, *_) = prompt_pass(target, head, prompt, head.new_kv())
    g = taps[0] @ sd["fc.weight"].T                                                     # fc on target taps only
    ref_logits, ref_hidden, _, _ = reference_head(sd, embed, cfg, tokens[0], g, torch.arange(7), cfg.rope_theta)
    assert logits.shape == (1, 7, cfg.draft_vocab_size) and hidden.shape == (1, 7, cfg.hidden_size)
    assert (logits[0] - ref_logits).abs().max() <= TOL
    assert (hidden[0] - ref_hidden).abs().max() <= TOL
    assert torch.equal(Eagle3FC(head)(taps), head.project(taps))


def test_later_step_on_own_hidden(setup):
    target, head, sd, embed, cfg = setup
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    kv = head.new_kv()
    taps, tokens, (logits, hidden, *_) = prompt_pass(target, head, prompt, kv)
    # next step: the head's own pre-norm output (no fc) with its mapped draft token, at position L
    draft = head.to_target_ids(logits[:, -1].argmax(-1, keepdim=True))
    with torch.no_grad():
        step_logits, step_hidden, *_ = head(**step_inputs(draft, start=6), hidden_states=hidden[:, -1:],
                                            k_cache=kv[0], v_cache=kv[1])
    g = torch.cat([taps[0] @ sd["fc.weight"].T, hidden[0, -1:]])
    ref_logits, ref_hidden, _, _ = reference_head(sd, embed, cfg, torch.cat([tokens[0], draft[0]]), g,
                                                  torch.arange(7), cfg.rope_theta)
    assert (step_logits[0, 0] - ref_logits[-1]).abs().max() <= TOL
    assert (step_hidden[0, 0] - ref_hidden[-1]).abs().max() <= TOL


def test_prompt_pass_fills_draft_cache_rows(setup):
    target, head, sd, embed, cfg = setup
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    kv = [torch.full_like(t, SENTINEL) for t in head.new_kv()]
    taps, tokens, _ = prompt_pass(target, head, prompt, kv)
    _, _, ref_k, ref_v = reference_head(sd, embed, cfg, tokens[0], taps[0] @ sd["fc.weight"].T, torch.arange(5),
                                        cfg.rope_theta)
    k_cache, v_cache = kv
    assert (k_cache[0, :, :5] - ref_k).abs().max() <= TOL           # rows 0..L-1: roped keys of the prompt
    assert (v_cache[0, :, :5] - ref_v).abs().max() <= TOL
    assert (k_cache[0, :, 5:] == SENTINEL).all() and (v_cache[0, :, 5:] == SENTINEL).all()


def test_d2t_maps_draft_ids_to_target_ids(setup, tiny_eagle3):
    _, head, sd, _, cfg = setup
    target_ids = head.to_target_ids(torch.arange(cfg.draft_vocab_size))
    assert torch.equal(target_ids, torch.arange(cfg.draft_vocab_size) + sd["d2t"])
    assert torch.equal(target_ids, sd["t2d"].nonzero()[:, 0])          # sorted, distinct, exactly t2d's ids
    assert head.d2t.dtype == torch.int64 and torch.equal(head.t2d, sd["t2d"])


def test_rope_theta_override(setup, tiny_target, tiny_eagle3):
    target, _, sd, embed, cfg = setup
    head = load_eagle3(tiny_eagle3, target, MAX_SEQ, rope_theta=1e6)   # the config says 1e4
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    taps, tokens, (logits, *_) = prompt_pass(target, head, prompt, head.new_kv())
    g = taps[0] @ sd["fc.weight"].T
    ref_logits, *_ = reference_head(sd, embed, cfg, tokens[0], g, torch.arange(9), 1e6)
    other, *_ = reference_head(sd, embed, cfg, tokens[0], g, torch.arange(9), cfg.rope_theta)
    assert (logits[0] - ref_logits).abs().max() <= TOL
    assert (logits[0] - other).abs().max() > 10 * TOL                 # θ actually matters here


def test_tree_level_appended_after_earlier_levels_sees_only_its_ancestors(setup):
    """The contract's mask_keys: level-2 nodes written after level 1 (slots L+2, L+3) with tree_mask
    [2, 4] whose columns start at L see the prompt, their own parent and themselves only, which is what
    each branch computes alone as a chain (parent at L, child at L+1)."""
    target, head, sd, embed, cfg = setup
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    kv = head.new_kv()
    L = prompt.shape[1]
    _, _, (logits, hidden, *_) = prompt_pass(target, head, prompt, kv)
    level1 = head.to_target_ids(logits[:, -1].topk(2, dim=-1).indices)                 # [1, 2] siblings
    h0 = hidden[:, -1:].expand(1, 2, -1)
    level2 = torch.tensor([[11, 23]])                                                   # child of node 0, of node 1
    with torch.no_grad():
        _, h1, *_ = head(**step_inputs(level1, start=L, positions=torch.full((1, 2), L),
                                       tree_mask=torch.eye(2, dtype=torch.bool)[None]),
                         hidden_states=h0, k_cache=kv[0], v_cache=kv[1])
        mask = torch.tensor([[[True, False, True, False], [False, True, False, True]]])
        tree_logits, tree_hidden, *_ = head(**step_inputs(level2, start=L + 2, positions=torch.full((1, 2), L + 1),
                                                          tree_mask=mask), hidden_states=h1, k_cache=kv[0], v_cache=kv[1])
        for branch in range(2):
            alone = [t.clone() for t in kv]
            head(**step_inputs(level1[:, branch:branch + 1], start=L), hidden_states=h0[:, :1],
                 k_cache=alone[0], v_cache=alone[1])
            chain_logits, chain_hidden, *_ = head(**step_inputs(level2[:, branch:branch + 1], start=L + 1),
                                                  hidden_states=h1[:, branch:branch + 1], k_cache=alone[0],
                                                  v_cache=alone[1])
            assert (tree_logits[0, branch] - chain_logits[0, 0]).abs().max() <= TOL
            assert (tree_hidden[0, branch] - chain_hidden[0, 0]).abs().max() <= TOL
