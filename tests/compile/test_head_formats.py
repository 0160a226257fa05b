"""Every published Qwen3 EAGLE3 head layout loads right: a tiny mock checkpoint per layout, written here
from the public sources (not from xcompile's key maps), each checked against an independent forward
and against transformers' hidden_states for its tap-id convention; layouts xcompile cannot run get a
one-line refusal naming the field.

Layouts (config fields and key names as the public code writes them):
  angelslim    Eagle3LlamaForCausalLM, midlayer.* keys (AngelSlim qwen3-8b-eagle3.json)
  eagle        SafeAILab/EAGLE training config: plain LlamaForCausalLM + draft_vocab_size, no rope_theta,
               rms_norm_eps 1e-5 (eagle/traineagle3/config.json), pytorch_model.bin of the trainable
               tensors + d2t/t2d (main.py save_16bit_model(exclude_frozen_parameters=True))
  specforge    LlamaForCausalLMEagle3 with eagle_config.eagle_aux_hidden_state_layer_ids (layer-output ids)
  speculators  Eagle3Speculator, nested transformer_layer_config, top-level norm_before_residual and
               eagle_aux_hidden_state_layer_ids (HF hidden_states indices), layers.0.* keys, the target's
               embed_tokens copy, d2t/t2d (vllm-project/speculators models/eagle3)
fp32; tolerance 1e-4 absolute.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from fixtures import TINY_QWEN3, eagle3_config, eagle3_tensors, qwen3_config, write_weights

from xcompile.compile.checkpoint import load_eagle3, load_qwen3, tap_layers
from xcompile.compile.errors import CompileError
from xcompile.compile.head_config import parse_eagle3
from xcompile.compile.hf_config import parse_qwen3

TOL = 1e-4
MAX_SEQ = 32
TARGET = qwen3_config()


# --------------------------------------------------------------------------------------------
# mock checkpoints, one per layout


def _llama_fields(cfg: dict) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "max_position_embeddings")
    return {k: cfg[k] for k in keys} | {"num_hidden_layers": 1, "hidden_act": "silu", "model_type": "llama"}


def write_head(path, layout: str, norm_before_residual: bool | None = None, taps: list[int] | None = None,
               extra: dict | None = None):
    """A head dir in ``layout``; ``taps`` go to the field that layout uses. Returns (dir, raw tensors)."""
    path.mkdir(parents=True, exist_ok=True)
    base = eagle3_config(TARGET)                       # the AngelSlim config of the tiny target's head
    tensors = eagle3_tensors(base, seed=len(layout))
    if layout == "angelslim":
        config = base | ({"eagle_aux_hidden_state_layer_ids": taps} if taps else {})
    elif layout == "eagle":
        config = {"architectures": ["LlamaForCausalLM"], **_llama_fields(base), "rms_norm_eps": 1e-5,
                  "draft_vocab_size": base["draft_vocab_size"], "torch_dtype": "float16", "pad_token_id": 0}
    elif layout == "specforge":
        config = base | {"architectures": ["LlamaForCausalLMEagle3"]}
        config |= {"eagle_config": {"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True}} if taps else {}
    else:
        layer = _llama_fields(base) | {"rope_theta": base["rope_theta"]}     # rms_norm_eps left at Llama's default
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": "0.1.0", "transformer_layer_config": layer,
                  "draft_vocab_size": base["draft_vocab_size"], "norm_before_residual": norm_before_residual,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": "Qwen/Qwen3-8B",
                                                      "architectures": ["Qwen3ForCausalLM"]}}}
        config |= {"eagle_aux_hidden_state_layer_ids": taps} if taps else {}
        tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}
        tensors["embed_tokens.weight"] = torch.zeros(base["vocab_size"], base["hidden_size"])   # the target's copy
    (path / "config.json").write_text(json.dumps(config | (extra or {}), indent=2))
    write_weights(path, tensors, fmt="bin" if layout == "eagle" else "safetensors")
    return path, tensors


# --------------------------------------------------------------------------------------------
# an independent forward, from speculators' Eagle3FirstLayerMixin / vLLM llama_eagle3.py semantics


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """x [S, H, D] rotate-half; cos/sin = cat(freqs, freqs)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([pos[:, None].double() * inv] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return (x * ang.cos() + torch.cat((-x2, x1), -1) * ang.sin()).float()


def reference_step(t, prefix, embed, taps_features, tokens, eps, theta, heads, kv_heads, norm_before_residual):
    """Prompt pass of one sequence: taps_features [S, 3H], tokens [S] -> draft logits [S, Vd], hidden [S, H]."""
    w = lambda n: t[f"{prefix}.{n}.weight"]                                          # noqa: E731
    s = len(tokens)
    g = taps_features @ t["fc.weight"].T
    hn = rms(g, w("hidden_norm"), eps)
    u = torch.cat([rms(embed[tokens], w("input_layernorm"), eps), hn], -1)          # embedding first
    pos = torch.arange(s)
    d = t[f"{prefix}.self_attn.q_proj.weight"].shape[0] // heads
    q = rope((u @ w("self_attn.q_proj").T).view(s, heads, d), pos, theta)
    k = rope((u @ w("self_attn.k_proj").T).view(s, kv_heads, d), pos, theta).repeat_interleave(heads // kv_heads, 1)
    v = (u @ w("self_attn.v_proj").T).view(s, kv_heads, d).repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    a = torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(s, -1) @ w("self_attn.o_proj").T
    x = (hn if norm_before_residual else g) + a                                      # the one equation that differs
    h = rms(x, w("post_attention_layernorm"), eps)
    x = x + (F.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    return rms(x, t["norm.weight"], eps) @ t["lm_head.weight"].T, x


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_qwen3(tiny_target, MAX_SEQ, taps=(0, 2, 3))           # the tiny target's default taps


@pytest.fixture(scope="module")
def embed(tiny_target):
    from safetensors.torch import load_file
    return load_file(tiny_target / "model.safetensors")["model.embed_tokens.weight"]


# (layout, norm_before_residual, eps the layout's config implies, RoPE θ the layout's config implies)
CASES = [("angelslim", False, 1e-6, TARGET["rope_theta"]),
         ("eagle", False, 1e-5, 10000.0),                      # no rope_theta: Llama's default base
         ("specforge", False, 1e-6, TARGET["rope_theta"]),
         ("speculators", False, 1e-6, TARGET["rope_theta"]),    # rms_norm_eps omitted: LlamaConfig's 1e-6
         ("speculators", True, 1e-6, TARGET["rope_theta"])]


@pytest.mark.parametrize("layout, nbr, eps, theta", CASES, ids=[f"{c[0]}-nbr{int(c[1])}" for c in CASES])
def test_each_layout_matches_an_independent_forward(tmp_path, target, embed, layout, nbr, eps, theta):
    path, t = write_head(tmp_path / layout, layout, norm_before_residual=nbr)
    head = load_eagle3(path, target, MAX_SEQ)
    cfg = head.cfg
    assert (cfg.norm_before_residual, cfg.rms_norm_eps, head.rope_theta) == (nbr, eps, theta)
    assert torch.equal(head.d2t, t["d2t"]) and head.embed_tokens.weight is target.model.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    s = 6
    feats = torch.randn(1, s, 3 * cfg.hidden_size, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (1, s), generator=g)
    want_logits, want_hidden = reference_step(t, "layers.0" if layout == "speculators" else "midlayer", embed,
                                              feats[0], tokens[0], eps, theta, cfg.num_attention_heads,
                                              cfg.num_key_value_heads, nbr)
    with torch.no_grad():
        k, v = head.new_kv()
        logits, hidden, *_ = head(tokens, head.project(feats), torch.arange(s)[None], torch.zeros(1, dtype=torch.long),
                                  torch.ones(s, s, dtype=torch.bool).tril()[None], torch.arange(s)[None], k, v)
    assert (logits[0] - want_logits).abs().max() < TOL and (hidden[0] - want_hidden).abs().max() < TOL
    # the comparison has teeth: the other residual rule is far off
    _, other = reference_step(t, "layers.0" if layout == "speculators" else "midlayer", embed, feats[0], tokens[0],
                              eps, theta, cfg.num_attention_heads, cfg.num_key_value_heads, not nbr)
    assert (hidden[0] - other).abs().max() > 100 * TOL


# --------------------------------------------------------------------------------------------
# tap ids: each field in its own convention, checked against transformers' hidden_states


@pytest.mark.parametrize("layout, ids, outputs", [
    ("speculators", [1, 2, 3], (0, 1, 2)),          # HF hidden_states indices: the input of layer i
    ("angelslim", [1, 2, 3], (0, 1, 2)),            # the top-level field, as vLLM reads it
    ("specforge", [1, 2, 3], (1, 2, 3)),            # eagle_config: layer-output ids (SGLang adds 1)
])
def test_tap_ids_follow_their_fields_convention(tmp_path, tiny_target, layout, ids, outputs):
    from transformers import Qwen3ForCausalLM

    path, _ = write_head(tmp_path / layout, layout, norm_before_residual=False, taps=ids)
    head_cfg = parse_eagle3(path / "config.json")
    taps = tap_layers(head_cfg, parse_qwen3(tiny_target / "config.json"))
    assert taps == outputs
    ours = load_qwen3(tiny_target, MAX_SEQ, taps=taps)
    hf = Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32, attn_implementation="eager").eval()
    last = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda mod, args, out: last.update(out=out))
    ids_in = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = hf(ids_in, output_hidden_states=True).hidden_states
        k = ours.new_kv()
        _, tapped, *_ = ours(ids_in, torch.arange(5)[None], torch.zeros(1, dtype=torch.long),
                             torch.ones(5, 5, dtype=torch.bool).tril()[None], torch.arange(5)[None], *k)
    hook.remove()
    raw = [*hs[1:-1], last["out"][0] if isinstance(last["out"], tuple) else last["out"]]   # raw output of layer i
    h = TINY_QWEN3["hidden_size"]
    for j, layer in enumerate(outputs):
        assert (tapped[..., j * h:(j + 1) * h] - raw[layer]).abs().max() < TOL
    # vLLM/speculators convention spelled out: the top-level id i is hidden_states[i]
    if layout != "specforge":
        assert all((tapped[..., j * h:(j + 1) * h] - hs[i]).abs().max() < TOL for j, i in enumerate(ids))


# --------------------------------------------------------------------------------------------
# what xcompile cannot run: one line naming the field


@pytest.mark.parametrize("layout, extra, field", [
    ("specforge", {"fc_norm": True}, "fc_norm"),
    ("specforge", {"norm_output": True}, "norm_output"),
    ("speculators", {"norm_before_fc": True}, "norm_before_fc"),
    ("angelslim", {"attention_bias": True}, "attention_bias"),
    ("specforge", {"eagle_config": {"use_aux_hidden_state": False}}, "eagle_config.use_aux_hidden_state"),
    ("speculators", {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, "eagle_aux_hidden_state_layer_ids"),
    ("speculators", {"speculators_model_type": "eagle"}, "speculators_model_type"),
    ("angelslim", {"eagle_aux_hidden_state_layer_ids": [2, 3, 4],
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}},
     "eagle_config.eagle_aux_hidden_state_layer_ids"),
])
def test_unsupported_options_are_refused_naming_the_field(tmp_path, layout, extra, field):
    path, _ = write_head(tmp_path / layout, layout, norm_before_residual=False, extra=extra)
    with pytest.raises(CompileError) as e:
        parse_eagle3(path / "config.json")
    msg = str(e.value)
    assert "\n" not in msg and str(path / "config.json") in msg and f"'{field}'" in msg


def test_speculators_refusals_of_the_nested_config_and_missing_residual_rule(tmp_path):
    path, _ = write_head(tmp_path / "s", "speculators", norm_before_residual=None)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["norm_before_residual"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CompileError, match="'norm_before_residual' is missing, and vLLM reads"):
        parse_eagle3(path / "config.json")
    cfg["norm_before_residual"] = True
    cfg["transformer_layer_config"]["model_type"] = "qwen3"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CompileError, match="'transformer_layer_config.model_type' is 'qwen3'"):
        parse_eagle3(path / "config.json")


def test_plain_llama_is_not_a_head(tmp_path):
    path, _ = write_head(tmp_path / "e", "eagle")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CompileError, match="a plain Llama model, not an EAGLE3 head"):
        parse_eagle3(path / "config.json")


# --------------------------------------------------------------------------------------------
# export: the eagle3 graph of a norm_before_residual head, and --eagle3-taps recorded in the manifest


def test_exported_speculators_head_matches_and_manifest_records_taps(tmp_path, tiny_target, embed):
    from xcompile.compile.pipeline import ExportRequest, export_engine_dir
    from xcompile.runtime.engines import ort

    path, t = write_head(tmp_path / "head", "speculators", norm_before_residual=True, taps=[1, 3, 4])
    out = tmp_path / "dir"
    m = export_engine_dir(ExportRequest(model=str(tiny_target), out=out, eagle3=str(path), dtype="fp32",
                                        max_seq_len=16, eagle3_taps=(0, 1, 3)))
    head = m.models["eagle3"]
    assert m.models["target"].extra["taps"] == head.extra["taps"] == [0, 1, 3]       # the override wins
    assert head.extra["taps_from"] == "--eagle3-taps" and head.extra["taps_convention"] == "layer-output ids"
    assert head.config["norm_before_residual"] and head.config["layout"] == "layers.0"
    assert head.config["tap_field"] == "eagle_aux_hidden_state_layer_ids"          # what the config itself said

    cfg = parse_eagle3(path / "config.json")
    g = torch.Generator().manual_seed(3)
    s = 5
    feats = torch.randn(1, s, 3 * cfg.hidden_size, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (1, s), generator=g)
    want_logits, want_hidden = reference_step(t, "layers.0", embed, feats[0], tokens[0], cfg.rms_norm_eps,
                                              cfg.rope_theta, cfg.num_attention_heads, cfg.num_key_value_heads, True)
    fc, step = ort.load(out, "eagle3_fc", max_tokens=16), ort.load(out, "eagle3")
    try:
        step.new_kv()
        hidden_in = fc.run(hidden_taps=feats)["hidden_states"].clone()
        got = step.run(input_ids=tokens, hidden_states=hidden_in, position_ids=torch.arange(s)[None],
                       write_index=torch.zeros(1, dtype=torch.long), tree_mask=torch.ones(s, s, dtype=torch.bool).tril()[None],
                       logit_rows=torch.arange(s)[None])
        assert (got["logits"][0] - want_logits).abs().max() < TOL
        assert (got["hidden_out"][0] - want_hidden).abs().max() < TOL
    finally:
        fc.close()
        step.close()


def test_tap_and_layer_options_are_checked_before_any_work(tmp_path, tiny_target, tiny_eagle3):
    from click.testing import CliRunner

    from xcompile.compile.cli import main

    def run(*args):
        return CliRunner().invoke(main, ["export", "--model", str(tiny_target), "--out", str(tmp_path / "o"), *args])

    bad = run("--eagle3", str(tiny_eagle3), "--eagle3-taps", "1,x,2")
    assert bad.exit_code == 2 and "--eagle3-taps" in bad.stderr and "comma-separated" in bad.stderr
    for args, why in ((("--eagle3", str(tiny_eagle3), "--eagle3-taps", "0,1,9"), "--eagle3-taps 0,1,9: expected"),
                      (("--eagle3-taps", "0,1,2"), "add --eagle3"),
                      (("--synthetic-layers", "2"), "--synthetic-layers 2: needs --synthetic")):
        r = run(*args)
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and why in lines[0], r.stderr       # the model says no
    assert not (tmp_path / "o").exists()
