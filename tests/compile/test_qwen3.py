"""Our Qwen3 against transformers' Qwen3ForCausalLM (the oracle), and the KV/tree semantics of one
forward: prefill + decode = one pass, tree verify = each branch alone, logit_rows selection.
fp32 throughout; tolerance 1e-4 absolute."""

from __future__ import annotations

import pytest
import torch
from fixtures import step_inputs, write_qwen3_checkpoint

from xcompile.compile.checkpoint import load_qwen3

TOL = 1e-4
MAX_SEQ = 32

# tied/untied, GQA 1/2/4, head_dim != hidden/heads, both rope_theta spellings, attention bias
CONFIGS = {
    "tied-mha": {"tie_word_embeddings": True, "num_key_value_heads": 4},
    "gqa2-wide-head": {"head_dim": 24, "rope_theta": 5000.0},
    "gqa4-rope-params": {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}},
    "bias-5-layers": {"num_hidden_layers": 5, "attention_bias": True, "rms_norm_eps": 1e-5},
}


def hf_model(path):
    from transformers import Qwen3ForCausalLM
    model, info = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                   output_loading_info=True)
    # every fixture tensor is a real HF key and every HF weight comes from the file
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def forward(model, ids, start=0, kv=None, **kw):
    kv = model.new_kv(ids.shape[0]) if kv is None else kv
    with torch.no_grad():
        out = model(*step_inputs(ids, start, **kw).values(), *kv)
    return out, kv


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_taps_match_transformers(tmp_path, name):
    path = write_qwen3_checkpoint(tmp_path, CONFIGS[name], seed=len(name), tokenizer=False)
    hf = hf_model(path)
    n_layers = hf.config.num_hidden_layers
    taps = (0, 1, n_layers - 1)                      # last one is not in HF hidden_states: hook it
    ours = load_qwen3(path, MAX_SEQ, taps=taps)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    ids = torch.randint(0, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))

    last = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda mod, args, out: last.update(out=out))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    hook.remove()
    (logits, hidden_taps, *_), _ = forward(ours, ids)

    assert (logits - ref.logits).abs().max() <= TOL
    # output-of-layer id t = HF hidden_states[t + 1] (hidden_states[0] is the embedding output)
    want = torch.cat([ref.hidden_states[1], ref.hidden_states[2], last["out"]], dim=-1)
    assert hidden_taps.shape == (2, 11, 3 * hf.config.hidden_size)
    assert (hidden_taps - want).abs().max() <= TOL
    assert logits.std() > 0.5                        # the fixture's logits are far from all-ties


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_qwen3(tiny_target, MAX_SEQ, taps=(0, 2, 3))


def test_prefill_then_decode_equals_one_pass(target):
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    (full_logits, full_taps, *_), _ = forward(target, ids)

    (logits, taps, *_), kv = forward(target, ids[:, :5])
    rows, tap_rows = [logits], [taps]
    for t in range(5, 9):
        (logits, taps, *_), kv = forward(target, ids[:, t:t + 1], start=t, kv=kv)
        rows.append(logits)
        tap_rows.append(taps)
    assert (torch.cat(rows, 1) - full_logits).abs().max() <= TOL
    assert (torch.cat(tap_rows, 1) - full_taps).abs().max() <= TOL


def test_tree_verify_equals_each_branch_alone(target):
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 256, (1, 6), generator=g)
    # tree: root r; branch A: r -> a1 -> a2; branch B: r -> b1 -> b2; branch C: r -> c1
    r, a1, a2, b1, b2, c1 = torch.randint(0, 256, (6,), generator=g).tolist()
    tokens = torch.tensor([[r, a1, a2, b1, b2, c1]])
    parents = [-1, 0, 1, 0, 3, 0]
    mask = torch.eye(6, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    depth = mask.sum(-1) - 1                         # tree nodes at one depth share a position
    _, kv = forward(target, prefix)
    (tree_logits, tree_taps, *_), _ = forward(target, tokens, start=6, kv=kv,
                                              positions=(6 + depth)[None], tree_mask=mask[None])

    for branch, nodes in {"A": [0, 1, 2], "B": [0, 3, 4], "C": [0, 5]}.items():
        (logits, taps, *_), _ = forward(target, torch.cat([prefix, tokens[:, nodes]], 1))
        assert (tree_logits[:, nodes] - logits[:, 6:]).abs().max() <= TOL, branch
        assert (tree_taps[:, nodes] - taps[:, 6:]).abs().max() <= TOL, branch


def test_tree_verify_keeps_committed_cache_rows(target):
    prefix = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(3))
    _, kv = forward(target, prefix)
    before = [t[:, :, :4].clone() for t in kv]
    forward(target, torch.tensor([[5, 6, 7]]), start=4, kv=kv, positions=torch.tensor([[4, 5, 5]]),
            tree_mask=torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool))
    assert all(torch.equal(b, t[:, :, :4]) for b, t in zip(before, kv))
    assert all(t[:, :, 4:7].abs().sum() > 0 and t[:, :, 7:].abs().sum() == 0 for t in kv)


def test_logit_rows_selects_rows(target):
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    (full, *_), _ = forward(target, ids)
    rows = torch.tensor([[6, 0, 6], [2, 3, 1]])
    (picked, taps, *_), _ = forward(target, ids, rows=rows)
    assert picked.shape == (2, 3, 256) and taps.shape == (2, 7, 192)
    # lm_head over 3 gathered rows vs over all 7: matmuls of other shapes may round differently (1e-6 apart
    # on a 2-core EPYC), so the rows agree to the module's tolerance, not bit for bit
    torch.testing.assert_close(picked, torch.stack([full[b, rows[b]] for b in range(2)]), atol=TOL, rtol=0)


def test_batch_rows_decode_at_their_own_lengths(target):
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 256, (1, 8), generator=g), torch.randint(0, 256, (1, 8), generator=g)
    (ref_a, *_), _ = forward(target, a)
    (ref_b, *_), _ = forward(target, b[:, :6])
    # batch of two sequences with 7 and 5 committed tokens, one decode step each
    kv = target.new_kv(2)
    forward(target, torch.cat([a[:, :7], b[:, :7]]), kv=kv)
    with torch.no_grad():
        logits, *_ = target(torch.tensor([[a[0, 7]], [b[0, 5]]]), torch.tensor([[7], [5]]), torch.tensor([7, 5]),
                            torch.ones(2, 1, 1, dtype=torch.bool), torch.zeros(2, 1, dtype=torch.int64), *kv)
    assert (logits[0, 0] - ref_a[0, 7]).abs().max() <= TOL
    assert (logits[1, 0] - ref_b[0, 5]).abs().max() <= TOL


def test_long_causal_passes_attend_over_the_live_keys_without_a_mask(tmp_path, monkeypatch):
    """A prompt pass of more than 64 tokens takes SDPA's causal kernels over the live keys (layers.causal_attention),
    from an empty cache and in chunks after earlier ones (lower-right causal): transformers' logits, and the
    additive-mask path's."""
    from xcompile.compile.models import layers

    path = write_qwen3_checkpoint(tmp_path, CONFIGS["gqa4-rope-params"], seed=4, tokenizer=False)
    hf = hf_model(path)
    ours = load_qwen3(path, 256)
    ids = torch.randint(0, hf.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    calls, real = [], layers.causal_attention
    monkeypatch.setattr(layers, "causal_attention", lambda *a: calls.append(a[-1]) or real(*a))
    (whole, *_), _ = forward(ours, ids)
    (first, *_), kv = forward(ours, ids[:, :70])
    (second, *_), _ = forward(ours, ids[:, 70:], start=70, kv=kv)
    assert set(calls) == {150, 70, 150}                            # every layer of every pass: the live keys
    assert (whole - ref).abs().max() <= TOL
    assert (torch.cat([first, second], 1) - ref).abs().max() <= TOL
    monkeypatch.setattr(layers, "causal_prompt", lambda mask: False)    # the additive mask over the whole cache
    (masked, *_), _ = forward(ours, ids)
    assert (masked - whole).abs().max() <= TOL


def test_causal_prompt_recognises_exactly_the_causal_triangle(monkeypatch):
    from xcompile.compile.models import layers

    monkeypatch.setattr(layers, "CAUSAL_CHECK_ROWS", 16)        # several row blocks
    tri = torch.ones(70, 70, dtype=torch.bool).tril()[None]
    assert layers.causal_prompt(tri)
    swapped = tri.clone()
    swapped[0, 40, 10], swapped[0, 40, 41] = False, True        # row counts kept, a key past the diagonal
    assert not layers.causal_prompt(swapped)
    assert not layers.causal_prompt(tri[:, :64, :64])           # short passes keep the mask path (graphs)
    assert not layers.causal_prompt(tri.expand(2, 70, 70))      # batches keep it
    assert not layers.causal_prompt(torch.ones(1, 70, 72, dtype=torch.bool).tril(2))
