"""The MTP drafter (compile/models/mtp.py, compile/train_mtp.py): the training unroll is the inference chain,
``xcompile train-mtp`` writes a module that loads and drafts plain greedy's tokens, an engine dir built with
--mtp (beside an EAGLE3 head, tied and untied targets) gives plain greedy output on ONNX Runtime for chains and
trees and passes ``xcompile diff``, and what does not fit is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fixtures
import pytest
import torch
from click.testing import CliRunner
from fixtures import refused
from safetensors.torch import load_file, save_file

from xcompile.compile import data as textdata
from xcompile.compile.checkpoint import load_mtp, load_qwen3
from xcompile.compile.cli import main
from xcompile.compile.models import mtp
from xcompile.compile.train import TrainOptions
from xcompile.compile.train_mtp import new_mtp, train_mtp, ttt_forward
from xcompile.compile.ttt import target_features
from xcompile.runtime.cli.xrun import main as xrun
from xcompile.runtime.enginedir.manifest import Manifest
from xcompile.runtime.enginedir.text import Text

SEQ = 24
pytestmark = pytest.mark.usefixtures("one_thread")


def target_of(checkpoint: Path, max_seq_len: int = SEQ + 8):
    """The checkpoint's target tapping its last layer alone (what an MTP module reads)."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    return load_qwen3(checkpoint, max_seq_len, (cfg["num_hidden_layers"] - 1,))


@pytest.fixture(scope="module")
def target(tiny_target):
    return target_of(tiny_target)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    words = fixtures.WORDS[:60]
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (30,), generator=g).tolist()) for _ in range(40)]
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text(textdata.DOC_SEPARATOR.join(docs))
    return path


def test_ttt_forward_is_the_inference_chain(target):
    """Step j at index t == the module as the drafter runs it: the prefix 0..t from target features in its KV
    cache, then j chained single-token steps (its own pre-norm output fed back, positions t+1..t+j)."""
    torch.manual_seed(0)
    ids = torch.randint(0, target.cfg.vocab_size, (1, SEQ))
    module = new_mtp(target, SEQ + 8, seed=1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name not in ("embed_tokens.weight", "shared_head.head.weight"):
                torch.nn.init.normal_(p, std=0.2) if p.dim() == 2 else torch.nn.init.normal_(p, 1.0, 0.1)
    _, last = target_features(target, ids, target.new_kv(1))
    steps = 3
    with torch.no_grad():
        unrolled = ttt_forward(module, ids, last, steps)
        for t in (0, 5, SEQ - 2 - steps):
            kv = module.new_kv(1)
            n = t + 1                                               # index t pairs h_t with x_{t+1}
            step_in = fixtures.step_inputs(ids[:, 1:n + 1], rows=torch.tensor([[t]]))
            out, hidden, *_ = module(step_in["input_ids"], last[:, :n], step_in["position_ids"],
                                     step_in["write_index"], step_in["tree_mask"], step_in["logit_rows"], *kv)
            torch.testing.assert_close(out[:, 0], unrolled[0][:, t], rtol=1e-4, atol=1e-4)
            h = hidden[:, t:t + 1]
            for j in range(1, steps):
                one = fixtures.step_inputs(ids[:, t + 1 + j:t + 2 + j], start=t + j)
                out, h, *_ = module(one["input_ids"], h, one["position_ids"], one["write_index"], one["tree_mask"],
                                    one["logit_rows"], *kv)
                torch.testing.assert_close(out[:, 0], unrolled[j][:, t], rtol=1e-4, atol=1e-4)


def test_loss_falls_and_the_target_stays_frozen(target, corpus, tiny_target):
    text = Text(tiny_target)
    windows = textdata.pack(textdata.tokenize(textdata.read_records(corpus), text), textdata.doc_end_id(text), SEQ)
    before = {n: p.clone() for n, p in target.named_parameters()}
    opts = TrainOptions(steps=40, lr=1e-2, batch=8, seq_len=SEQ, ttt_steps=3, device="cpu", log_every=10)
    result = train_mtp(target, windows, opts, heldout=windows[:8], log=lambda _: None)
    losses = [row["loss"] for row in result.history if "loss" in row]
    assert losses[-1] < 0.95 * losses[0], losses
    assert len(result.heldout["step_acc"]) == 3
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())
    # the module trained its own weights and shares the target's embedding and head (never copied)
    assert result.head.embed_tokens.weight is target.model.embed_tokens.weight
    assert result.head.shared_head.head.weight is target.lm_head.weight


def test_cli_writes_a_module_that_loads_and_drafts_plain_greedy(tiny_target, corpus, tmp_path):
    out = tmp_path / "mtp"
    res = CliRunner().invoke(main, [
        "train-mtp", "--model", str(tiny_target), "--data", str(corpus), "--out", str(out), "--ttt-steps", "2",
        "--steps", "3", "--batch", "4", "--seq-len", str(SEQ), "--device", "cpu", "--heldout", str(corpus)])
    assert res.exit_code == 0, res.output
    assert "held-out: loss" in res.output and "acceptance (8 heldout prompts" in res.output
    cfg = mtp.parse_mtp(out / "config.json")
    target = target_of(tiny_target, 64)
    assert cfg.hidden_size == target.cfg.hidden_size and cfg.num_hidden_layers == 1
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:            # no copy of the target's tensors
        assert not {"embed_tokens.weight", "shared_head.head.weight"} & set(f.keys())
    module = load_mtp(out, target, 64)
    assert module.shared_head.head.weight is target.lm_head.weight
    meta = json.loads((out / "xcompile_train.json").read_text())
    assert meta["tap_layers"] == [target.cfg.num_hidden_layers - 1] and meta["options"]["ttt_steps"] == 2
    assert meta["acceptance"]["match_plain"] == 1.0 and meta["acceptance"]["prompts"] == 8


@pytest.fixture(scope="module")
def mtp_dir(tiny_target, tmp_path_factory) -> Path:
    return fixtures.write_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "mtp", tiny_target, seed=1)


@pytest.fixture(scope="module")
def both_dir(tiny_target, tiny_eagle3, mtp_dir, tmp_path_factory) -> Path:
    """The tiny target with an EAGLE3 head and an MTP module: the target taps four layers."""
    return fixtures.exported_dir(tmp_path_factory, "tiny-mtp-eagle3", model=str(tiny_target), eagle3=str(tiny_eagle3),
                                 mtp=str(mtp_dir), dtype="fp32")


def generate(directory: Path, *args: str) -> dict:
    res = CliRunner().invoke(xrun, ["generate", str(directory), "--backend", "ort", "--prompt-ids", "5,9,11,20,33,7",
                                    "--max-new-tokens", "12", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_engine_dir_with_both_heads_gives_plain_greedy_and_passes_diff(both_dir):
    m = Manifest.load(both_dir)
    last = m.models["target"].config["num_hidden_layers"] - 1
    assert m.models["target"].extra["taps"][-1] == last and len(m.models["target"].extra["taps"]) == 4
    assert len(m.models["eagle3"].extra["taps"]) == 3 and "mtp" in m.graphs
    h = m.models["target"].config["hidden_size"]
    assert m.tap_columns("eagle3") == slice(0, 3 * h) and m.tap_columns("mtp") == slice(3 * h, 4 * h)
    want = generate(both_dir, "--drafter", "none")["tokens"]
    for args in (["--drafter", "mtp", "--gamma", "3"], ["--drafter", "mtp", "--tree-topk", "3", "--tree-depth", "3",
                                                        "--tree-tokens", "8"], ["--drafter", "eagle3", "--gamma", "3"]):
        got = generate(both_dir, *args)
        assert got["tokens"] == want, args
        assert got["stats"]["drafter"] == ("mtp-tree" if "--tree-topk" in args else args[1])
    res = CliRunner().invoke(main, ["diff", str(both_dir)])
    assert res.exit_code == 0, res.output
    assert "mtp" in res.output and "PASSED" in res.output


def test_an_unchanged_build_request_with_eagle3_taps_and_mtp_is_the_same_export(tiny_target, tiny_eagle3, mtp_dir,
                                                                              tmp_path, both_dir):
    from xcompile.compile.export_build import request_differs
    from xcompile.compile.export_plan import plan_export
    from xcompile.compile.pipeline import ExportRequest, export_engine_dir
    from xcompile.runtime.common.errors import EngineError

    req = ExportRequest(model=str(tiny_target), out=tmp_path / "dir", eagle3=str(tiny_eagle3), mtp=str(mtp_dir),
                        eagle3_taps=(0, 1, 2), dtype="fp32", max_seq_len=64)
    manifest = export_engine_dir(req)
    assert manifest.models["target"].extra["taps"] == [0, 1, 2, 3]
    assert request_differs(req, plan_export(req), manifest) is None
    # a module whose recorded tap is not the target's last one: refused, not read from the wrong columns
    m = Manifest.load(both_dir)
    m.models["mtp"].extra["tap"] = 0
    with pytest.raises(EngineError, match="models.mtp.extra.tap is 0"):
        m.tap_columns("mtp")


def test_tied_target_shares_its_embedding_as_the_head(tiny_target_tied, tmp_path_factory):
    module = fixtures.write_mtp_checkpoint(tmp_path_factory.mktemp("mtp-tied") / "mtp", tiny_target_tied, seed=1)
    out = fixtures.exported_dir(tmp_path_factory, "tiny-tied-mtp", model=str(tiny_target_tied), mtp=str(module),
                                dtype="fp32")
    want = generate(out, "--drafter", "none")["tokens"]
    assert generate(out, "--drafter", "mtp", "--gamma", "4")["tokens"] == want


@pytest.fixture(scope="module")
def vocab_dir(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    """A module with a draft vocabulary of 100 of the tiny target's tokens, and the target exported with it."""
    module = fixtures.write_mtp_checkpoint(tmp_path_factory.mktemp("mtp-vocab") / "mtp", tiny_target, seed=2,
                                           draft_vocab=100)
    return module, fixtures.exported_dir(tmp_path_factory, "tiny-mtp-vocab", model=str(tiny_target),
                                         mtp=str(module), dtype="fp32")


def test_a_draft_vocabulary_reads_those_rows_of_the_target_head_and_drafts_plain_greedy(vocab_dir, tiny_target):
    module_dir, out = vocab_dir
    assert json.loads((module_dir / "config.json").read_text())["draft_vocab_size"] == 100
    target = target_of(tiny_target, 64)
    module = load_mtp(module_dir, target, 64)
    rows = module.head_rows()
    assert rows.shape == (100,) and len(set(rows.tolist())) == 100
    assert torch.equal(module.shared_head.head.weight, target.lm_head.weight[rows])
    m = Manifest.load(out)
    assert m.models["mtp"].extra["draft_vocab"] == 100 and m.graphs["mtp"].dims["draft_vocab"] == 100
    assert m.d2t_files() == {"mtp": "mtp_d2t.safetensors"} and (out / "mtp_d2t.safetensors").is_file()
    want = generate(out, "--drafter", "none")["tokens"]
    for args in (["--gamma", "3"], ["--tree-topk", "3", "--tree-depth", "3", "--tree-tokens", "8"]):
        assert generate(out, "--drafter", "mtp", *args)["tokens"] == want, args
    res = CliRunner().invoke(main, ["diff", str(out)])
    assert res.exit_code == 0, res.output
    assert "mtp" in res.output and "PASSED" in res.output
    from xcompile.runtime.common.errors import EngineError
    from xcompile.runtime.decoding.registry import DrafterSpec, make_drafter
    from xcompile.runtime.engines.load import open_engine_dir

    with open_engine_dir(out, "ort") as es:                    # the map and the graph must agree
        assert es.mtp_d2t.numel() == 100
        es.mtp_d2t = es.mtp_d2t[:50]
        with pytest.raises(EngineError, match="draft vocabulary is 100 in the manifest but its d2t map holds 50"):
            make_drafter(es, DrafterSpec("mtp", gamma=3))
    (out / "mtp_d2t.safetensors").unlink()                     # the map is part of the dir
    res = CliRunner().invoke(xrun, ["generate", str(out), "--backend", "ort", "--prompt-ids", "5,9", "--drafter",
                                    "mtp"])
    refused(res, "mtp_d2t.safetensors", code=1)


def test_train_mtp_with_a_draft_vocabulary_keeps_the_head_rows_frozen(tiny_target, corpus, tmp_path):
    out = tmp_path / "mtp"
    res = CliRunner().invoke(main, [
        "train-mtp", "--model", str(tiny_target), "--data", str(corpus), "--out", str(out), "--ttt-steps", "2",
        "--steps", "3", "--batch", "4", "--seq-len", str(SEQ), "--device", "cpu", "--draft-vocab", "40"])
    assert res.exit_code == 0, res.output
    assert "draft vocabulary 40 of" in res.output
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "d2t" in f.keys() and not {"embed_tokens.weight", "shared_head.head.weight"} & set(f.keys())
    target = target_of(tiny_target, 64)
    module = load_mtp(out, target, 64)
    # the 40 most frequent tokens of the training windows, the head those rows of lm_head
    text = Text(tiny_target)
    windows = textdata.pack(textdata.tokenize(textdata.read_records(corpus), text), textdata.doc_end_id(text), SEQ)
    counts = torch.bincount(windows.flatten(), minlength=target.cfg.vocab_size)
    assert counts[module.head_rows()].min() >= counts.sort(descending=True).values[39]
    assert torch.equal(module.shared_head.head.weight, target.lm_head.weight[module.head_rows()])


def test_training_with_a_draft_vocabulary_freezes_the_rows_and_measures_through_the_map(target, corpus, tiny_target):
    from xcompile.compile.acceptance import chain_drafter

    text = Text(tiny_target)
    windows = textdata.pack(textdata.tokenize(textdata.read_records(corpus), text), textdata.doc_end_id(text), SEQ)
    opts = TrainOptions(steps=3, lr=1e-2, batch=4, seq_len=SEQ, ttt_steps=2, device="cpu", draft_vocab=40)
    module = train_mtp(target, windows, opts, log=lambda _: None).head
    rows = module.head_rows()
    assert rows.shape == (40,) and torch.equal(module.shared_head.head.weight, target.lm_head.weight[rows])
    assert not module.shared_head.head.weight.requires_grad
    # the acceptance the trainer reports maps the module's draft ids to target ids
    assert torch.equal(chain_drafter(module, 3).d2t, module.d2t)
    # a size that reaches the vocabulary: the whole one
    whole = train_mtp(target, windows, TrainOptions(**{**opts.__dict__, "draft_vocab": 10 ** 6}),
                      log=lambda _: None).head
    assert whole.head_rows() is None and whole.shared_head.head.weight is target.lm_head.weight


def test_bad_draft_vocabularies_are_refused(tiny_target, mtp_dir, tmp_path):
    def export(module):
        return CliRunner().invoke(main, ["export", "--model", str(tiny_target), "--out", str(tmp_path / "out"),
                                         "--dtype", "fp32", "--mtp", str(module)])

    data = json.loads((mtp_dir / "config.json").read_text())
    for value in (0, data["vocab_size"] + 1, "many"):
        bad = tmp_path / f"bad-{value}"
        shutil.copytree(mtp_dir, bad)
        (bad / "config.json").write_text(json.dumps({**data, "draft_vocab_size": value}))
        refused(export(bad), "'draft_vocab_size'", "whole vocabulary", code=1)
    # a size the checkpoint's tensors do not carry: no d2t in a module trained without one
    missing = tmp_path / "missing"
    shutil.copytree(mtp_dir, missing)
    (missing / "config.json").write_text(json.dumps({**data, "draft_vocab_size": 50}))
    refused(export(missing), "'draft_vocab_size' is 50", "no tensor 'd2t'", "--draft-vocab", code=1)
    # and a map the config does not announce
    unannounced = tmp_path / "unannounced"
    shutil.copytree(mtp_dir, unannounced)
    tensors = load_file(str(mtp_dir / "model.safetensors"))
    save_file({**tensors, "d2t": torch.arange(50) * 2}, str(unannounced / "model.safetensors"))
    refused(export(unannounced), "no field 'draft_vocab_size'", "\"draft_vocab_size\": 50", code=1)
    # a map whose draft ids collide on one target id
    repeated = tmp_path / "repeated"
    shutil.copytree(unannounced, repeated)
    save_file({**tensors, "d2t": -torch.arange(50)}, str(repeated / "model.safetensors"))
    (repeated / "config.json").write_text(json.dumps({**data, "draft_vocab_size": 50}))
    refused(export(repeated), "tensor 'd2t' maps 49 draft id(s)", code=1)
    assert not (tmp_path / "out").exists()


def test_what_does_not_fit_is_refused(tiny_target, tiny_engine_dir, mtp_dir, tmp_path):
    def export(*args):
        return CliRunner().invoke(main, ["export", "--model", str(tiny_target), "--out", str(tmp_path / "out"),
                                         "--dtype", "fp32", *args])

    wide = tmp_path / "wide"
    wide.mkdir()
    data = json.loads((mtp_dir / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**data, "hidden_size": 2 * data["hidden_size"]}))
    refused(export("--mtp", str(wide)), "config.json", "'hidden_size'", "train-mtp", code=1)
    two = tmp_path / "two"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({**data, "num_hidden_layers": 2}))
    refused(export("--mtp", str(two)), "'num_hidden_layers'", "one decoder layer", code=1)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**data, "architectures": ["Qwen3ForCausalLM"]}))
    refused(export("--mtp", str(other)), "'architectures'", "Qwen3MTPModule", code=1)
    refused(export("--mtp"), "no MTP module is known", "--mtp DIR", code=1)
    res = CliRunner().invoke(main, ["export", "--model", "qwen3-0.6b", "--synthetic", "--mtp", str(mtp_dir),
                                    "--out", str(tmp_path / "out")])
    refused(res, "--synthetic", "give --mtp without a value", code=1)
    assert not (tmp_path / "out").exists()
    res = CliRunner().invoke(xrun, ["generate", str(tiny_engine_dir), "--backend", "ort", "--prompt-ids", "5,9",
                                    "--drafter", "mtp"])
    refused(res, "--drafter mtp", "holds no MTP module", "--mtp", code=2)        # an option the dir cannot take


def test_a_synthetic_module_of_a_large_vocabulary_has_a_valid_draft_vocabulary():
    """xrun bench --synthetic qwen3-8b --mtp: a 32,000-token draft vocabulary, its d2t a valid random map."""
    from xcompile.compile import synthetic
    from xcompile.compile.reference import synthetic_manifest

    m = synthetic_manifest("qwen3-8b", 256, mtp=True)
    assert m.models["mtp"].extra["draft_vocab"] == 32000
    cfg = mtp.mtp_config(synthetic.known_config("qwen3-8b"))
    with torch.device("meta"):
        module = mtp.MTP(cfg, 256, draft_vocab=32000)
    d2t = synthetic.synthetic_tensor(module, "d2t", module.d2t, seed=3)
    ids = torch.arange(32000) + d2t
    assert d2t.dtype == torch.int64 and ids.unique().numel() == 32000 and 0 <= ids.min() and ids.max() < 151936
