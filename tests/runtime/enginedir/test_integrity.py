"""runtime/enginedir/integrity.py and the manifest's field checks: records computed while streaming equal those
of the finished file, the fast check samples blocks of big files and hashes small ones whole, the full
check finds any changed byte, and a damaged manifest is one line naming the field."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
from fixtures import save_manifest

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir import integrity
from xcompile.runtime.enginedir.manifest import Manifest, ModelEntry
from xcompile.runtime.enginedir.schema import validate


def test_streamed_record_equals_the_files_record(tmp_path):
    data = os.urandom(3 * integrity.LEAF + 12345)
    digest = integrity.Digest()
    for i in range(0, len(data), 7777):                     # writes of any size, across leaf boundaries
        digest.update(data[i:i + 7777])
    (tmp_path / "f").write_bytes(data)
    record = digest.record()
    assert record == integrity.record_file(tmp_path / "f")
    assert record["size"] == len(data) and record["block_size"] == integrity.LEAF and len(record["blocks"]) == 4
    assert integrity.record_file(tmp_path / "f") != integrity.Digest().record()


def test_block_size_keeps_records_short():
    assert integrity.block_size_for(0) == integrity.LEAF
    assert integrity.block_size_for(1024 * integrity.LEAF) == integrity.LEAF
    assert integrity.block_size_for(16 << 30) == 16 << 20          # an 8B bf16 weights file: 1024 blocks of 16 MiB


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def test_checks_find_changed_truncated_and_missing_files(tmp_path):
    path = tmp_path / "w.data"
    path.write_bytes(os.urandom(2 * integrity.LEAF + 10))
    record = integrity.record_file(path)
    assert integrity.check_file(path, record) is None and integrity.check_file(path, record, full=True) is None
    flip(path, integrity.LEAF + 5)                          # same size, one bit: a small file is hashed whole
    assert "bytes 1048576..2097152 differ" in integrity.check_file(path, record)
    path.write_bytes(path.read_bytes()[:-1])
    assert "has 2097161 bytes, 2097162 were recorded" in integrity.check_file(path, record)
    path.unlink()
    assert integrity.check_file(path, record) == "is missing"


def test_fast_check_of_a_big_file_samples_blocks(tmp_path, monkeypatch):
    """Above FAST_BYTES the default check hashes the first, the last and random blocks; the full check
    every one. (Thresholds shrunk so a 40-block file stands for an 8B weights file.)"""
    monkeypatch.setattr(integrity, "FAST_BYTES", 4 * integrity.LEAF)
    monkeypatch.setattr(integrity, "SAMPLE_BYTES", 6 * integrity.LEAF)
    path = tmp_path / "big.data"
    path.write_bytes(os.urandom(40 * integrity.LEAF))
    record = integrity.record_file(path)
    picked = integrity.sampled_blocks(record, random.Random(0))
    assert len(picked) == 6 and {0, 39} <= set(picked)
    assert integrity.sampled_blocks(record, random.Random(1)) != picked        # another load, other blocks
    skipped = next(i for i in range(40) if i not in picked)
    flip(path, skipped * integrity.LEAF + 3)
    monkeypatch.setattr(integrity, "sampled_blocks", lambda r, rng=None: picked)
    assert integrity.check_file(path, record) is None                        # missed by that sample...
    assert f"bytes {skipped * integrity.LEAF}.." in integrity.check_file(path, record, full=True)   # not by --verify
    monkeypatch.setattr(integrity, "sampled_blocks", lambda r, rng=None: [skipped])
    assert integrity.check_file(path, record) is not None                    # nor by a sample that lands there


def test_a_file_without_a_record_is_refused(tmp_path):
    (tmp_path / "target.onnx").write_bytes(b"x")
    with pytest.raises(EngineError, match="records no size or hash for it.*re-export"):
        integrity.verify(tmp_path, {}, ["target.onnx"], fix="re-export")


# --------------------------------------------------------------------------------------------
# the manifest, field by field


@pytest.fixture
def manifest_data(tmp_path) -> dict:
    (tmp_path / "tokenizer.json").write_text("{}")
    save_manifest(Manifest("t", "fp32", 64, 1, {"target": ModelEntry("qwen3", {"vocab_size": 256}, "synthetic-hash:t:0")},
                           eos_token_ids=[3], tokenizer_files=["tokenizer.json"]), tmp_path)
    return json.loads((tmp_path / "manifest.json").read_text())


@pytest.mark.parametrize("edit, field, problem", [
    (lambda d: d.update(max_seq_len="64"), "max_seq_len", "should be an integer >= 1, got '64'"),
    (lambda d: d.update(max_batch=0), "max_batch", "should be an integer >= 1, got 0"),
    (lambda d: d.update(dtype="int4"), "dtype", "should be one of fp32, fp16, bf16"),
    # EOS ids as strings would never match a token: stopping silently disabled
    (lambda d: d.update(eos_token_ids=["3"]), "eos_token_ids[0]", "should be an integer >= 0, got '3'"),
    (lambda d: d.update(eos_token_ids=[True]), "eos_token_ids[0]", "should be an integer >= 0, got True"),
    (lambda d: d.update(eos_token_ids=[999]), "eos_token_ids[0]", "below the target's vocab_size 256"),
    (lambda d: d.update(tokenizer_files=["../../etc/passwd"]), "tokenizer_files[0]", "a file name inside the engine dir"),
    (lambda d: d.pop("models"), "models", "is missing"),
    (lambda d: d["models"].pop("target"), "models", "has no 'target' entry"),
    (lambda d: d["models"]["target"].update(kind="llama"), "models.target.kind", "should be one of qwen3, eagle3"),
    (lambda d: d.update(speed="fast"), "speed", "not a field xcompile knows"),
    (lambda d: d["files"]["tokenizer.json"].update(size=-1), "files.tokenizer.json.size", "integer >= 0"),
    (lambda d: d["files"]["tokenizer.json"].update(blocks=[]), "files.tokenizer.json.blocks", "one digest per"),
    (lambda d: d.update(graphs={"target": {"onnx": "t.onnx", "model": "draft", "io": {"inputs": [], "outputs": []},
                                           "dims": {}}}), "graphs.target.model", "which 'models' does not hold"),
    (lambda d: d.update(graphs={"target": {"onnx": "t.onnx", "model": "target", "io": {"inputs": [{"name": 1, "dtype": "bool", "shape": []}],
                                           "outputs": []}, "dims": {}}}), "graphs.target.io.inputs[0].name", "string"),
])
def test_damaged_manifest_is_one_line_naming_the_field(tmp_path, manifest_data, edit, field, problem):
    assert validate(manifest_data) is None
    edit(manifest_data)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest_data))
    with pytest.raises(EngineError) as e:
        Manifest.load(tmp_path)
    assert f"manifest.json: field '{field}' " in str(e.value) and problem in str(e.value) and "\n" not in str(e.value)


def test_contract_version_and_format(tmp_path, manifest_data):
    # v1: dirs exported before the eagle3 tree mask gained mask_keys (2026-12-01) must be rebuilt
    for edit, message in ((dict(contract_version=99), "I/O contract v99"), (dict(format="other"), "not an xcompile"),
                          (dict(contract_version=1), r"I/O contract v1, this runtime speaks v2; rebuild")):
        (tmp_path / "manifest.json").write_text(json.dumps({**manifest_data, **edit}))
        with pytest.raises(EngineError, match=message):
            Manifest.load(tmp_path)
    shutil.rmtree(tmp_path)
    with pytest.raises(EngineError, match="no such engine dir"):
        Manifest.load(tmp_path)
