"""Checkpoint resolution (offline), lazy reading, strict loading, and synthetic weights.
Each bad input must give its own one-line CompileError naming the file/tensor and what to do."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fixtures import (
    TINY_DRAFT,
    eagle3_config,
    eagle3_tensors,
    qwen3_config,
    qwen3_tensors,
    step_inputs,
    write_draft_checkpoint,
    write_eagle3_checkpoint,
    write_qwen3_checkpoint,
    write_weights,
)
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from xcompile.compile import checkpoint as ck
from xcompile.compile import synthetic
from xcompile.compile.config import KNOWN_MODELS, Qwen3Config, synthetic_eagle3_config
from xcompile.compile.errors import CompileError
from xcompile.compile.head_config import parse_eagle3
from xcompile.compile.hf_config import parse_qwen3
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.compile.synthetic import synthetic_eagle3, synthetic_qwen3, synthetic_state, synthetic_tensor

MAX_SEQ = 16
TAPS = (0, 2, 3)


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(CompileError) as e:
        fn(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


def states_equal(a, b) -> bool:
    sa, sb = ck.module_state(a), ck.module_state(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def target(tiny_target):
    return ck.load_qwen3(tiny_target, MAX_SEQ, taps=TAPS)


def copy_with(src, dst, mutate):
    """Copy a single-file safetensors checkpoint dir, passing its tensors through ``mutate``."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    mutate(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


# ---------------------------------------------------------------------------------------------
# loading


def test_sharded_equals_unsharded(tiny_target, tiny_target_sharded, target):
    assert len(list(tiny_target_sharded.glob("model-*.safetensors"))) == 3
    assert states_equal(ck.load_qwen3(tiny_target_sharded, MAX_SEQ, taps=TAPS), target)


def test_bin_head_equals_safetensors_head(tiny_eagle3, tiny_eagle3_bin, target):
    assert (tiny_eagle3_bin / "pytorch_model.bin").is_file()
    assert states_equal(ck.load_eagle3(tiny_eagle3_bin, target, MAX_SEQ), ck.load_eagle3(tiny_eagle3, target, MAX_SEQ))


def test_loaded_weights_are_the_files(tiny_target, target):
    tensors = load_file(tiny_target / "model.safetensors")
    state = ck.module_state(target)
    assert state.keys() == tensors.keys()
    assert all(torch.equal(state[k], tensors[k]) for k in tensors)
    assert not any(p.requires_grad for p in target.parameters())
    # RoPE tables rebuilt after the meta-device build
    assert torch.allclose(target.model.layers[0].self_attn.rotary.cos[1, 0], torch.tensor(1.0).cos())


def test_tied_checkpoint_has_no_lm_head(tiny_target_tied):
    path = tiny_target_tied
    assert "lm_head.weight" not in ck.Checkpoint(path).keys()
    model = ck.load_qwen3(path, MAX_SEQ, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_tied_checkpoint_may_still_ship_lm_head(tmp_path, tiny_target_tied):
    # some exporters save the tied copy; it is ignored (the embedding is the output projection)
    path = copy_with(tiny_target_tied, tmp_path / "t", lambda t: t.update({"lm_head.weight": torch.zeros(256, 64)}))
    model = ck.load_qwen3(path, MAX_SEQ)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.abs().sum() > 0


def test_head_shares_target_embedding_and_derives_t2d(tmp_path, tiny_eagle3, target):
    head = ck.load_eagle3(tiny_eagle3, target, MAX_SEQ)
    assert head.embed_tokens.weight is target.model.embed_tokens.weight
    no_t2d = write_eagle3_checkpoint(tmp_path, t2d=False)
    assert torch.equal(ck.load_eagle3(no_t2d, target, MAX_SEQ).t2d, head.t2d)


def test_head_ignores_a_copied_embedding(tmp_path, tiny_eagle3, target):
    path = copy_with(tiny_eagle3, tmp_path / "h", lambda t: t.update({"embed_tokens.weight": torch.zeros(256, 64)}))
    head = ck.load_eagle3(path, target, MAX_SEQ)
    assert head.embed_tokens.weight is target.model.embed_tokens.weight


def test_draft_model_loads(tiny_draft, target):
    draft = ck.load_draft_model(tiny_draft, target.cfg, MAX_SEQ)
    assert draft.cfg.hidden_size == TINY_DRAFT["hidden_size"] and draft.taps == ()
    logits, *kv = draft(*step_inputs(torch.tensor([[1, 2, 3]])).values(), *draft.new_kv())
    assert logits.shape == (1, 3, 256) and len(kv) == 2 * TINY_DRAFT["num_hidden_layers"]


def test_iter_state_streams_onto_a_meta_model(tiny_target, target):
    with torch.device("meta"):
        meta = Qwen3(parse_qwen3(tiny_target / "config.json"), MAX_SEQ, TAPS).to(torch.bfloat16)
    seen = dict(ck.CheckpointSource(tiny_target).tensors(meta))
    assert seen.keys() == ck.module_state(target).keys()
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in seen.values())
    assert torch.equal(seen["lm_head.weight"], target.lm_head.weight.bfloat16())


def test_tokenizer_and_generation_config(tiny_target):
    tok = Tokenizer.from_file(str(tiny_target / "tokenizer.json"))
    assert tok.get_vocab_size() == 256
    ids = tok.encode("<|im_start|> user hello world <|im_end|>").ids
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>") == 255
    assert tok.decode(ids[1:-1]) == "user hello world"
    assert json.loads((tiny_target / "generation_config.json").read_text())["eos_token_id"] == [255, 253]
    assert "chat_template" in json.loads((tiny_target / "tokenizer_config.json").read_text())


# ---------------------------------------------------------------------------------------------
# bad inputs: one clear error each


def test_missing_weights_file(tmp_path):
    path = write_qwen3_checkpoint(tmp_path, tokenizer=False)
    (path / "model.safetensors").unlink()
    msg = error(ck.load_qwen3, path, MAX_SEQ)
    assert str(path) in msg and "no weights" in msg and "model.safetensors" in msg and "hf download" in msg


def test_missing_config(tmp_path):
    write_weights(tmp_path, {"x": torch.zeros(1)})
    assert "config.json: file not found" in error(ck.load_qwen3, tmp_path, MAX_SEQ)
    assert "no config.json" in error(ck.resolve, str(tmp_path))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(tmp_path, tiny_target, damage):
    path = shutil.copytree(tiny_target, tmp_path / "t")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-100] if damage == "truncated" else b"\x00" * 64)
    msg = error(ck.load_qwen3, path, MAX_SEQ)
    assert str(path / "model.safetensors") in msg and "truncated or corrupt" in msg


def test_corrupt_bin(tmp_path, tiny_eagle3_bin, target):
    path = shutil.copytree(tiny_eagle3_bin, tmp_path / "h")
    data = (path / "pytorch_model.bin").read_bytes()
    (path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    assert "pytorch_model.bin: not a readable torch checkpoint" in error(ck.load_eagle3, path, target, MAX_SEQ)


def test_missing_shard(tmp_path, tiny_target_sharded):
    path = shutil.copytree(tiny_target_sharded, tmp_path / "t")
    (path / "model-00002-of-00003.safetensors").unlink()
    msg = error(ck.load_qwen3, path, MAX_SEQ)
    assert "model-00002-of-00003.safetensors" in msg and "missing" in msg


def test_bad_index(tmp_path, tiny_target_sharded):
    path = shutil.copytree(tiny_target_sharded, tmp_path / "t")
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    key = "model.norm.weight"
    data["weight_map"][key] = next(f for f in set(data["weight_map"].values()) if f != data["weight_map"][key])
    index.write_text(json.dumps(data))
    msg = error(ck.Checkpoint, path)
    assert f"'{key}'" in msg and "bad index" in msg
    index.write_text("{not json")
    assert "model.safetensors.index.json: not valid JSON" in error(ck.Checkpoint, path)
    index.write_text(json.dumps({"weight_map": [1, 2]}))
    assert "field 'weight_map'" in error(ck.Checkpoint, path)


def test_missing_tensor(tmp_path, tiny_target):
    path = copy_with(tiny_target, tmp_path / "t", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    msg = error(ck.load_qwen3, path, MAX_SEQ)
    assert "missing tensor 'model.layers.2.mlp.up_proj.weight'" in msg and str(path) in msg


def test_untied_checkpoint_without_lm_head(tmp_path, tiny_target):
    path = copy_with(tiny_target, tmp_path / "t", lambda t: t.pop("lm_head.weight"))
    assert "missing tensor 'lm_head.weight'" in error(ck.load_qwen3, path, MAX_SEQ)


def test_unexpected_tensor(tmp_path, tiny_target):
    extra = {"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)}
    path = copy_with(tiny_target, tmp_path / "t", lambda t: t.update(extra))
    msg = error(ck.load_qwen3, path, MAX_SEQ)
    assert "unexpected tensor 'model.layers.9.mlp.up_proj.weight'" in msg and "model.safetensors" in msg


def test_wrong_shape(tmp_path, tiny_target):
    path = copy_with(tiny_target, tmp_path / "t", lambda t: t.update({"model.norm.weight": torch.ones(32)}))
    msg = error(ck.load_qwen3, path, MAX_SEQ)
    assert "'model.norm.weight' has shape [32], expected [64]" in msg and "model.safetensors" in msg


def test_wrong_dtype(tmp_path, tiny_eagle3, target):
    path = copy_with(tiny_eagle3, tmp_path / "h", lambda t: t.update({"d2t": t["d2t"].float()}))
    assert "tensor 'd2t' is torch.float32, expected torch.int64" in error(ck.load_eagle3, path, target, MAX_SEQ)
    path = copy_with(tiny_eagle3, tmp_path / "h2", lambda t: t.update({"fc.weight": t["fc.weight"].long()}))
    assert "'fc.weight' is torch.int64, expected a floating-point dtype" in error(ck.load_eagle3, path, target, MAX_SEQ)


def test_d2t_out_of_range(tmp_path, tiny_eagle3, target):
    path = copy_with(tiny_eagle3, tmp_path / "h", lambda t: t["d2t"].add_(200))
    assert "outside the target vocabulary [0, 256)" in error(ck.load_eagle3, path, target, MAX_SEQ)


def test_draft_vocab_mismatch(tmp_path, target):
    path = write_draft_checkpoint(tmp_path, {"vocab_size": 200}, shards=1)
    msg = error(ck.load_draft_model, path, target.cfg, MAX_SEQ)
    assert "vocab_size 200 differs from the target's 256" in msg and str(path / "config.json") in msg


def test_eagle3_hidden_size_mismatch(tmp_path, target):
    path = write_eagle3_checkpoint(tmp_path, overrides={"hidden_size": 32, "head_dim": 8})
    msg = error(ck.load_eagle3, path, target, MAX_SEQ)
    assert "hidden_size 32" in msg and "hidden_size 64" in msg and str(path / "config.json") in msg


def test_eagle3_taps_must_match_target(tmp_path, tiny_target, tiny_eagle3):
    other = ck.load_qwen3(tiny_target, MAX_SEQ, taps=(0, 1, 2))
    assert "the head reads target layers [0, 2, 3]" in error(ck.load_eagle3, tiny_eagle3, other, MAX_SEQ)
    taps = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}
    path = write_eagle3_checkpoint(tmp_path, overrides=taps)
    assert "exceed the target's 4 layers" in error(ck.load_eagle3, path, other, MAX_SEQ)


def test_eagle3_dtype_must_match_target(tiny_eagle3, target):
    assert "shares the target's embedding" in error(ck.load_eagle3, tiny_eagle3, target, MAX_SEQ, dtype=torch.float16)


# ---------------------------------------------------------------------------------------------
# resolution (offline)


def fake_hf_cache(root, repo_id, files_from):
    """HF hub cache layout: models--org--name/{refs/main, snapshots/<sha>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    sha = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(files_from, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    return repo / "snapshots" / sha


def test_resolve_local_dir(tiny_target):
    assert ck.resolve(str(tiny_target)) == tiny_target


def test_resolve_unknown_alias():
    msg = error(ck.resolve, "qwen3-9b")
    assert "unknown model alias 'qwen3-9b'" in msg and all(alias in msg for alias in KNOWN_MODELS)


def test_resolve_repo_not_in_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    msg = error(ck.resolve, "Qwen/Qwen3-8B")
    assert "`hf download Qwen/Qwen3-8B`" in msg and str(tmp_path) in msg
    assert "`hf download Qwen/Qwen3-8B`" in error(ck.resolve, "qwen3-8b")          # alias -> repo id


def test_resolve_repo_in_cache(tmp_path, monkeypatch, tiny_target, tiny_eagle3):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    snapshot = fake_hf_cache(tmp_path / "hub", "Qwen/Qwen3-8B", tiny_target)
    head = fake_hf_cache(tmp_path / "hub", "AngelSlim/Qwen3-8B_eagle3", tiny_eagle3)
    assert ck.resolve("Qwen/Qwen3-8B") == snapshot
    assert ck.resolve("qwen3-8b") == snapshot
    assert ck.resolve_eagle3("qwen3-8b", None) == head
    assert ck.resolve_eagle3("Qwen/Qwen3-8B", "") == head
    assert ck.resolve_eagle3("qwen3-8b", str(tiny_eagle3)) == tiny_eagle3
    # a partial download: the missing shard names the repo to fetch again
    (snapshot / "model.safetensors").unlink()
    assert "`hf download Qwen/Qwen3-8B`" in error(ck.Checkpoint, snapshot)


def test_resolve_eagle3_without_published_head(tiny_target):
    assert "no published EAGLE3 head is known for 'qwen3-0.6b'" in error(ck.resolve_eagle3, "qwen3-0.6b", None)
    assert "pass the head's directory" in error(ck.resolve_eagle3, str(tiny_target), None)


def test_tap_layers(tiny_eagle3, tmp_path):
    target_cfg = KNOWN_MODELS["qwen3-8b"].config
    assert ck.tap_layers(parse_eagle3(tiny_eagle3 / "config.json"), target_cfg) == (1, 17, 32)
    # the top-level field counts HF hidden_states (the input of that layer): [2, 18, 33] = outputs of 1, 17, 32
    path = write_eagle3_checkpoint(tmp_path, overrides={"eagle_aux_hidden_state_layer_ids": [2, 18, 33]})
    assert ck.tap_layers(parse_eagle3(path / "config.json"), target_cfg) == (1, 17, 32)


# ---------------------------------------------------------------------------------------------
# synthetic weights


def small_cfg(hidden: int = 256) -> Qwen3Config:
    # Qwen3-0.6B's shape at hidden 1024 (16/8 heads of 128), 2 layers and a short vocabulary
    return Qwen3Config(4096, hidden, 3 * hidden, 2, 16, 8, 128)


def test_synthetic_is_deterministic_and_streams_per_name():
    cfg = small_cfg()
    model = synthetic_qwen3(cfg, MAX_SEQ, seed=3, taps=(0, 1, 1))
    assert states_equal(model, synthetic_qwen3(cfg, MAX_SEQ, seed=3, taps=(0, 1, 1)))
    assert not torch.equal(model.lm_head.weight, synthetic_qwen3(cfg, MAX_SEQ, seed=4).lm_head.weight)
    with torch.device("meta"):
        meta = Qwen3(cfg, MAX_SEQ).to(torch.bfloat16)
    streamed = dict(synthetic_state(meta, seed=3))
    assert streamed.keys() == ck.module_state(model).keys()
    assert all(torch.equal(streamed[k], v) for k, v in ck.module_state(model).items())
    assert torch.equal(model.model.layers[1].input_layernorm.weight, torch.ones(256, dtype=torch.bfloat16))
    assert abs(model.lm_head.weight.float().std().item() - 0.02) < 1e-3


def test_synthetic_draw_is_counter_based(monkeypatch):
    # the GPU draws in steps of 2^26 elements, the CPU of 2^16: element i depends on (key, i) only, so any
    # step size (and device) gives the same bits; values are symmetric in (-1, 1) with a uniform's spread
    u = synthetic.uniform((1000, 777), key=12345)
    monkeypatch.setattr(synthetic, "_CPU_CHUNK", 4093)
    assert torch.equal(u, synthetic.uniform((1000, 777), key=12345))
    assert torch.equal(u.flatten()[:5000], synthetic.uniform((5000,), key=12345))
    assert not torch.equal(u, synthetic.uniform((1000, 777), key=12346))
    assert u.dtype == torch.float32 and -1 < u.min() and u.max() < 1
    assert abs(u.mean().item()) < 3e-3 and abs(u.std().item() - 3 ** -0.5) < 3e-3
    # 24 bits a value: every value an odd multiple of 2^-24, distinct draws almost all distinct
    assert torch.equal(torch.remainder(u.double() * 2 ** 24, 2), torch.ones_like(u.double()))
    assert u.unique().numel() > 0.95 * u.numel()


def test_synthetic_bf16_forward_is_finite():
    target = synthetic_qwen3(small_cfg(1024), MAX_SEQ, taps=(0, 0, 1))
    ids = torch.randint(0, 4096, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, taps, *_ = target(*step_inputs(ids).values(), *target.new_kv())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all() and torch.isfinite(taps).all()
    assert logits.float().std() > 0.1


def test_synthetic_eagle3_head():
    cfg = small_cfg()
    target = synthetic_qwen3(cfg, MAX_SEQ, taps=cfg.default_tap_layers)
    head = synthetic_eagle3(target, seed=1)
    assert isinstance(head, Eagle3) and head.embed_tokens.weight is target.model.embed_tokens.weight
    ids = head.to_target_ids(torch.arange(head.cfg.draft_vocab_size))
    assert ids.min() >= 0 and ids.max() < cfg.vocab_size and (ids.diff() > 0).all()
    assert torch.equal(head.t2d.nonzero()[:, 0], ids)
    assert "default taps" in error(synthetic_eagle3, synthetic_qwen3(cfg, MAX_SEQ))


def test_synthetic_known_model_per_tensor():
    # Qwen3-8B + its head on the meta device: tensors are made one at a time, by name
    cfg = KNOWN_MODELS["qwen3-8b"].config
    with torch.device("meta"):
        target = Qwen3(cfg, MAX_SEQ, cfg.default_tap_layers).to(torch.bfloat16)
        head = Eagle3(synthetic_eagle3_config(cfg), MAX_SEQ).to(torch.bfloat16)
    name = "model.layers.0.self_attn.k_proj.weight"
    k = synthetic_tensor(target, name, ck.module_state(target)[name], 0)
    assert k.shape == (1024, 4096) and k.dtype == torch.bfloat16 and k.device.type == "cpu"
    d2t = synthetic_tensor(head, "d2t", head.d2t, 0)
    ids = torch.arange(32000) + d2t
    assert d2t.dtype == torch.int64 and ids.max() < 151936 and (ids.diff() > 0).all()
    assert "unknown model 'qwen3-9b'" in error(synthetic_qwen3, "qwen3-9b", MAX_SEQ)


def test_fixture_tensors_cover_configs():
    # the writers stay in step with the configs they write (used by other tests and the demo)
    cfg = qwen3_config({"tie_word_embeddings": True})
    assert "lm_head.weight" not in qwen3_tensors(cfg)
    head = eagle3_tensors(eagle3_config(cfg))
    assert head["d2t"].dtype == torch.int64 and head["t2d"].sum() == head["d2t"].numel()


def test_resolve_revision(tmp_path, monkeypatch, tiny_target, tiny_draft):
    """--revision picks a cached snapshot by branch, tag or commit; not cached names the download command;
    a local dir or packaged alias has no revisions."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    main = fake_hf_cache(tmp_path, "Qwen/Qwen3-8B", tiny_target)
    other = "fedcba9876543210fedcba9876543210fedcba98"
    shutil.copytree(tiny_draft, main.parent / other)
    (main.parents[1] / "refs" / "v2").write_text(other)
    assert ck.resolve("Qwen/Qwen3-8B") == main
    assert ck.resolve("Qwen/Qwen3-8B", "v2") == main.parent / other
    assert ck.resolve("qwen3-8b", other) == main.parent / other                # alias -> repo id, by commit
    msg = error(ck.resolve, "Qwen/Qwen3-8B", "v3")
    assert "at revision 'v3'" in msg and "`hf download Qwen/Qwen3-8B --revision v3`" in msg
    assert "is a local directory" in error(ck.resolve, str(tiny_target), "v2")
    assert "is packaged with xcompile" in error(ck.resolve, "demo", "main")
