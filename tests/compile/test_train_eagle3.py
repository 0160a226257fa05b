"""``xcompile train-eagle3``: the training-time-test unroll matches the head's inference semantics,
the loss falls on a tiny target, the written head loads with a valid draft vocabulary, and drafting
with it through the runtime gives plain greedy output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import fixtures
import pytest
import torch
from click.testing import CliRunner

from xcompile.compile import data as textdata
from xcompile.compile.checkpoint import load_eagle3, load_qwen3, tap_layers
from xcompile.compile.cli import main
from xcompile.compile.errors import CompileOptionError
from xcompile.compile.head_config import parse_eagle3
from xcompile.compile.hf_config import parse_qwen3
from xcompile.compile.train import TrainOptions, train_head
from xcompile.compile.train_eagle3 import draft_vocabulary, new_head, train_eagle3, ttt_forward
from xcompile.compile.ttt import target_features, ttt_mask
from xcompile.runtime.enginedir.text import Text

SEQ = 24
pytestmark = pytest.mark.usefixtures("one_thread")


def word_text(n_docs: int, words: int, seed: int = 0) -> list[str]:
    """Documents of the fixture tokenizer's words (the tiny target has a WordLevel tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    vocab = fixtures.WORDS[:60]
    return [" ".join(vocab[i] for i in torch.randint(0, len(vocab), (words,), generator=g).tolist())
            for _ in range(n_docs)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text(textdata.DOC_SEPARATOR.join(word_text(40, 30)))
    return path


@pytest.fixture(scope="module")
def target(tiny_target):
    taps = parse_qwen3(tiny_target / "config.json").default_tap_layers
    return load_qwen3(tiny_target, SEQ + 8, taps)


def test_ttt_mask_keys_per_step():
    t = 5
    for step in range(4):
        m = ttt_mask(t, step)
        assert m.shape == (t, (step + 1) * t)
        for i in range(t):
            seen = {(j // t, j % t) for j in m[i].nonzero().flatten().tolist()}      # (step, index) of each key
            assert seen == {(0, k) for k in range(i + 1)} | {(s, i) for s in range(1, step + 1)}


def test_ttt_forward_is_the_inference_chain(target):
    """Step j at index t == the head run as at inference: the prefix 0..t from target features in
    its KV cache, then j chained single-token steps (own hidden fed back, positions t+1..t+j)."""
    torch.manual_seed(0)
    ids = torch.randint(0, target.cfg.vocab_size, (1, SEQ))
    head = new_head(target, 64, ids, SEQ + 8, seed=1)
    for p in head.parameters():                                     # make every term matter
        torch.nn.init.normal_(p, std=0.2) if p.dim() == 2 else torch.nn.init.normal_(p, 1.0, 0.1)
    head.embed_tokens.weight = target.model.embed_tokens.weight
    logits, taps = target_features(target, ids, target.new_kv(1))
    steps = 3
    with torch.no_grad():
        unrolled = ttt_forward(head, ids, taps, steps)
        for t in (0, 5, SEQ - 2 - steps):
            kv = head.new_kv(1)
            n = t + 1                                               # draft index t pairs F_t with x_{t+1}
            step_in = fixtures.step_inputs(ids[:, 1:n + 1], rows=torch.tensor([[t]]))
            out, hidden, *_ = head(step_in["input_ids"], head.project(taps[:, :n]), step_in["position_ids"],
                                   step_in["write_index"], step_in["tree_mask"], step_in["logit_rows"], *kv)
            torch.testing.assert_close(out[:, 0], unrolled[0][:, t], rtol=1e-4, atol=1e-4)
            h = hidden[:, t:t + 1]
            for j in range(1, steps):
                one = fixtures.step_inputs(ids[:, t + 1 + j:t + 2 + j], start=t + j)
                out, h, *_ = head(one["input_ids"], h, one["position_ids"], one["write_index"], one["tree_mask"],
                                  one["logit_rows"], *kv)
                torch.testing.assert_close(out[:, 0], unrolled[j][:, t], rtol=1e-4, atol=1e-4)


def test_draft_vocabulary_most_frequent_ascending():
    windows = torch.tensor([[5, 5, 5, 2, 2, 9, 9, 9, 9, 1]])
    tokens, d2t, t2d = draft_vocabulary(windows, 12, 3)
    assert tokens.tolist() == [2, 5, 9]
    assert d2t.tolist() == [2, 4, 7]
    assert t2d.nonzero().flatten().tolist() == [2, 5, 9]
    tokens, _, _ = draft_vocabulary(windows, 12, 6)                 # unseen ids fill up, lowest first
    assert tokens.tolist() == [0, 1, 2, 3, 5, 9]


def test_loss_falls(target, corpus, tiny_target):
    text = Text(tiny_target)
    windows = textdata.pack(textdata.tokenize(textdata.read_records(corpus), text), textdata.doc_end_id(text), SEQ)
    opts = TrainOptions(steps=40, lr=1e-2, batch=8, seq_len=SEQ, draft_vocab=64, ttt_steps=3, device="cpu",
                        log_every=10)
    result = train_eagle3(target, windows, opts, heldout=windows[:8], log=lambda _: None)
    losses = [row["loss"] for row in result.history if "loss" in row]
    assert losses[-1] < 0.95 * losses[0] and losses == sorted(losses, reverse=True), losses
    assert len(result.heldout["step_acc"]) == 3


def test_a_draft_vocab_past_the_target_takes_it_all_and_says_so(target, corpus, tiny_target):
    text = Text(tiny_target)
    windows = textdata.pack(textdata.tokenize(textdata.read_records(corpus), text), textdata.doc_end_id(text), SEQ)
    opts = TrainOptions(steps=1, lr=1e-2, batch=4, seq_len=SEQ, draft_vocab=10**6, ttt_steps=2, device="cpu")
    lines = []
    result = train_eagle3(target, windows, opts, log=lines.append)
    assert len(result.head.d2t) == target.cfg.vocab_size
    assert any("whole vocabulary: --draft-vocab 1000000 asks for more" in line for line in lines), lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default --device cuda runs here")
def test_the_default_device_without_a_gpu_is_a_bad_option(tiny_target, corpus, tmp_path):
    res = CliRunner().invoke(main, ["train-eagle3", "--model", str(tiny_target), "--data", str(corpus), "--out",
                                    str(tmp_path / "head"), "--steps", "1"])
    assert res.exit_code == 2 and "--device cuda (the default)" in res.output and "--device cpu" in res.output
    assert not (tmp_path / "head").exists()


def test_cli_writes_a_loadable_head(tiny_target, corpus, tmp_path):
    out = tmp_path / "head"
    res = CliRunner().invoke(main, [
        "train-eagle3", "--model", str(tiny_target), "--data", str(corpus), "--out", str(out), "--draft-vocab", "64",
        "--ttt-steps", "2", "--steps", "3", "--batch", "4", "--seq-len", str(SEQ), "--device", "cpu",
        "--heldout", str(corpus)])
    assert res.exit_code == 0, res.output
    assert "held-out: loss" in res.output
    cfg = parse_eagle3(out / "config.json")
    assert cfg.architecture == "Eagle3LlamaForCausalLM" and cfg.draft_vocab_size == 64
    target = load_qwen3(tiny_target, 64, tap_layers(cfg, parse_qwen3(tiny_target / "config.json")))
    head = load_eagle3(out, target, 64)
    ids = torch.arange(64) + head.d2t
    assert bool(head.t2d[ids].all()) and int(head.t2d.sum()) == 64
    assert bool((head.d2t[1:] >= head.d2t[:-1]).all())
    meta = json.loads((out / "xcompile_train.json").read_text())
    assert meta["tap_layers"] == list(target.taps) and meta["options"]["ttt_steps"] == 2
    # drafted through the runtime (torch backend, fp32): greedy output equals plain decoding
    assert meta["acceptance"]["match_plain"] == 1.0 and meta["acceptance"]["prompts"] == 8
    assert "acceptance (8 heldout prompts" in res.output


def test_read_records(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\f\ntwo words\n\f\n\n")
    assert [r.text for r in textdata.read_records(tmp_path / "a.txt")] == ["one", "two words"]
    (tmp_path / "b.jsonl").write_text('{"text": "hi"}\n\n{"prompt": "q", "response": "a"}\n{"prompt": "p"}\n')
    got = textdata.read_records(tmp_path / "b.jsonl")
    assert got == [textdata.Record(text="hi"), textdata.Record(prompt="q", response="a"), textdata.Record(prompt="p")]
    (tmp_path / "c.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(textdata.CompileError, match="c.jsonl:1"):
        textdata.read_records(tmp_path / "c.jsonl")


def test_greedy_complete_batched_equals_one_by_one(target):
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    batched = textdata.greedy_complete(target, prompts, stop_ids={-1}, max_new_tokens=6)
    for prompt, got in zip(prompts, batched):
        seq = list(prompt)
        for _ in range(6):                                          # plain recompute-everything greedy
            s = torch.tensor([seq])
            inputs = fixtures.step_inputs(s, rows=torch.tensor([[len(seq) - 1]]))
            seq.append(int(target(*inputs.values(), *target.new_kv(1))[0][0, -1].argmax()))
        assert got == seq[len(prompt):]


def test_cli_regenerates_chat_responses(tiny_target, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": "ignored"}) + "\n" for p in word_text(12, 6)))
    out = tmp_path / "head"
    res = CliRunner().invoke(main, ["train-eagle3", "--model", str(tiny_target), "--data", str(data), "--out", str(out),
                                    "--draft-vocab", "64", "--ttt-steps", "2", "--steps", "2", "--batch", "2",
                                    "--seq-len", str(SEQ), "--device", "cpu", "--regenerate", "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output
    assert "regenerating 12 responses" in res.output
    assert json.loads((out / "xcompile_train.json").read_text())["regenerate"] is True


def test_cli_refuses_regenerate_on_data_with_no_prompts(tiny_target, tmp_path):
    """Plain text has no responses to regenerate: --regenerate would do nothing, so it is refused before the target
    loads, and nothing is written."""
    data = tmp_path / "plain.txt"
    data.write_text(" ".join(word_text(40, 8)))
    out = tmp_path / "head"
    fixtures.refused(CliRunner().invoke(main, [
        "train-eagle3", "--model", str(tiny_target), "--data", str(data), "--out", str(out), "--draft-vocab", "64",
        "--ttt-steps", "2", "--steps", "1", "--batch", "2", "--seq-len", str(SEQ), "--device", "cpu", "--regenerate"]),
        "--regenerate", "holds no prompts")
    assert not out.exists()


def test_cli_refuses_a_batch_whose_kv_buffers_exceed_the_memory(tiny_target, corpus, tmp_path):
    out = tmp_path / "head"
    fixtures.refused(CliRunner().invoke(main, [
        "train-eagle3", "--model", str(tiny_target), "--data", str(corpus), "--out", str(out), "--draft-vocab", "64",
        "--ttt-steps", "2", "--steps", "1", "--batch", str(10**12), "--seq-len", str(SEQ), "--device", "cpu"]),
        f"--batch {10**12}: the target's KV buffers alone take", "lower --batch or --seq-len")
    assert not out.exists()


def test_a_step_out_of_memory_is_refused_naming_the_batch(target, corpus):
    windows = torch.randint(0, 64, (4, SEQ))

    def loss_of(ids, kv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB\nmore detail")
    with pytest.raises(CompileOptionError, match=r"--batch 2: out of memory on cpu at step 1 \(CUDA out of memory. "
                                                  r"Tried to allocate 80.00 GiB\); lower --batch or --seq-len"):
        train_head(target, torch.nn.Linear(2, 2), loss_of, windows, TrainOptions(batch=2, steps=1), log=lambda s: None)


def test_tokenize_wraps_prompts_in_the_chat_template(tiny_target):
    text = Text(tiny_target)
    records = [textdata.Record(text="the cat"), textdata.Record(prompt="hello", response="yes")]
    with_resp, without = textdata.tokenize(records, text), textdata.tokenize(records, text, responses=False)
    assert with_resp[0] == without[0] == text.encode("the cat")
    assert without[1] == text.chat("hello") and with_resp[1] == text.chat("hello") + text.encode("yes")


def test_cli_refuses_a_window_past_the_targets_positions(tiny_target, corpus, tmp_path):
    out = tmp_path / "head"
    positions = parse_qwen3(tiny_target / "config.json").context_length
    res = CliRunner().invoke(main, [
        "train-mtp", "--model", str(tiny_target), "--data", str(corpus), "--out", str(out), "--steps", "1",
        "--seq-len", str(positions + 1), "--device", "cpu"])
    assert res.exit_code == 2 and f"--seq-len {positions + 1} is past the {positions} positions" in res.output
    assert not out.exists()


def test_cli_names_the_heldout_file_whose_text_is_too_short(tiny_target, corpus, tmp_path):
    """A text shorter than one window (an empty one is refused before the model loads: test_cli.py)."""
    short = tmp_path / "short.txt"
    short.write_text(" ".join(fixtures.WORDS[:3]))
    out = tmp_path / "head"
    res = CliRunner().invoke(main, ["train-mtp", "--model", str(tiny_target), "--data", str(corpus), "--heldout",
                                    str(short), "--out", str(out), "--steps", "1", "--seq-len", str(SEQ),
                                    "--device", "cpu"])
    assert res.exit_code == 1 and not out.exists()
    assert re.search(rf"--heldout {re.escape(str(short))}: the data holds [1-4] tokens, fewer than one window of "
                     rf"--seq-len {SEQ}", res.output), res.output
