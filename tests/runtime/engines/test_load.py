"""The backend and drafter registries, DrafterSpec, and the engine-set lifecycle (runtime/engines/load.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xcompile.runtime.cli.xrun import main
from xcompile.runtime.common import gpu
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding import registry
from xcompile.runtime.decoding.registry import DRAFTERS, DrafterSpec, TreeShape, make_drafter
from xcompile.runtime.enginedir.contract import TARGET
from xcompile.runtime.enginedir.manifest import D2T_FILE
from xcompile.runtime.engines import load
from xcompile.runtime.engines.load import BACKENDS, Backend, open_engine_dir, pick_backend


class Closing:
    """Stands in for an Engine where only the lifecycle matters: records close()."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def close(self):
        self.log.append(self.name)


def test_cli_choices_are_the_registries():
    options = {p.name: p for p in main.commands["generate"].params}
    assert list(options["backend"].type.choices) == ["auto", *BACKENDS]
    assert list(options["drafter"].type.choices) == ["auto", *DRAFTERS]
    bench = {p.name: p for p in main.commands["bench"].params}
    assert list(bench["backend"].type.choices) == ["auto", *BACKENDS]


@pytest.mark.parametrize("device, dtype, engines, max_batch, want", [
    ("cpu", "fp32", {}, 1, "ort"), ("cpu", "fp16", {}, 1, "ort"), ("cpu", "bf16", {}, 1, "torch"),
    # no built engines: trt's test fails before importing TensorRT; then fast when triton imports
    ("cuda", "bf16", {}, 1, "fast" if gpu.available() else "torch"),
    ("cuda", "bf16", {}, 4, "fast" if gpu.available() else "torch"),     # the kernels take a batch's rows too
])
def test_auto_takes_the_first_backend_that_fits(device, dtype, engines, max_batch, want):
    manifest = SimpleNamespace(dtype=dtype, engines=engines, max_batch=max_batch)
    assert pick_backend(manifest, "auto", torch.device(device)) == want
    assert pick_backend(manifest, "ort", torch.device(device)) == "ort"
    with pytest.raises(EngineError, match="--backend 'tensorflow': expected one of auto, trt"):
        pick_backend(manifest, "tensorflow", torch.device(device))


def test_registering_a_backend_is_one_entry(tiny_engine_dir, monkeypatch):
    calls = []

    def probe_load(directory, manifest, device, options):
        calls.append((directory, options.cuda_graphs))
        return BACKENDS["torch"].load(directory, manifest, device, options)

    # first in the registry and always fitting: auto takes it too
    monkeypatch.setattr(load, "BACKENDS", {"probe": Backend(probe_load, lambda m, d: True, "test"), **BACKENDS})
    for name in ("probe", "auto"):
        with open_engine_dir(tiny_engine_dir, name, "cpu", cuda_graphs=False) as es:
            assert es.backend == "probe" and es.d2t is not None and TARGET in es.engines
    assert calls == [(tiny_engine_dir, False)] * 2


def test_a_failing_graph_closes_the_ones_already_open():
    log = []

    def open_one(graph):
        if graph == "draft":
            raise EngineError("draft.onnx: corrupt")
        return Closing(log, graph)

    with pytest.raises(EngineError, match="corrupt"):
        load._load_each(["target", "eagle3", "draft"], open_one)
    assert log == ["target", "eagle3"]


def test_engine_set_is_a_context_manager(tiny_engine_dir):
    with open_engine_dir(tiny_engine_dir, "torch", "cpu") as es:
        target = es.engines[TARGET]
        target.new_kv()
        assert target.kv
    assert target.kv == []                      # Engine.close() drops its KV binding
    log = []
    with pytest.raises(RuntimeError):
        with load.EngineSet(None, None, "x", {"a": Closing(log, "a"), "b": Closing(log, "b")}):
            raise RuntimeError("boom")
    assert log == ["a", "b"]                    # closed on the way out of an error too


def test_a_failing_d2t_closes_the_engines(tiny_engine_dir, tmp_path, monkeypatch):
    import shutil

    closed = []
    monkeypatch.setattr(load.EngineSet, "close", lambda self: closed.append(sorted(self.engines)))
    # a missing d2t file is found by the file records before any engine opens: nothing to close
    copy = shutil.copytree(tiny_engine_dir, tmp_path / "dir")
    (copy / D2T_FILE).unlink()
    with pytest.raises(EngineError, match="d2t.safetensors: is missing"):
        open_engine_dir(copy, "torch", "cpu")
    assert closed == []

    # one that fails to load after the engines opened closes them
    def unreadable(path, device):
        raise EngineError(f"{path}: unreadable")

    monkeypatch.setattr(load, "load_d2t", unreadable)
    with pytest.raises(EngineError, match="d2t.safetensors: unreadable"):
        open_engine_dir(tiny_engine_dir, "torch", "cpu")
    assert closed == [["draft", "eagle3", "eagle3_fc", "target"]]


def test_drafter_spec_from_options():
    assert DrafterSpec.from_options() == DrafterSpec("auto", registry.DEFAULT_GAMMA, None)
    assert DrafterSpec.from_options("eagle3", 3) == DrafterSpec("eagle3", 3)
    spec = DrafterSpec.from_options("eagle3", tree_topk=4)
    assert spec.tree == TreeShape(topk=4, depth=TreeShape.depth, total_tokens=TreeShape.total_tokens)
    assert spec.label == "eagle3 tree 4/6/32"
    assert DrafterSpec("eagle3", 2).label == "eagle3 chain g=2"
    assert DrafterSpec("draft-model", 2).label == "draft-model g=2" and DrafterSpec("none").label == "plain"


@pytest.mark.parametrize("make, message", [
    (lambda: DrafterSpec.from_options("eagle3", 3, tree_depth=2), "--gamma sets a chain, --tree-\\* a tree"),
    (lambda: DrafterSpec.from_options("draft-model", tree_tokens=8), "the draft-model drafter drafts chains"),
    (lambda: DrafterSpec("medusa"), "--drafter 'medusa': expected one of auto, eagle3, mtp, draft-model, none"),
    (lambda: DrafterSpec("eagle3", 0), "--gamma must be >= 1"),
    (lambda: TreeShape(topk=0), "--tree-topk must be >= 1"),
])
def test_drafter_spec_refuses_what_cannot_run(make, message):
    with pytest.raises(EngineError, match=message):
        make()


def test_make_drafter_builds_each_registered_drafter(tiny_engine_dir):
    with open_engine_dir(tiny_engine_dir, "torch", "cpu") as es:
        assert make_drafter(es).name == "eagle3"                    # auto: the first the dir holds
        assert make_drafter(es, DrafterSpec("draft-model", 3)).max_depth == 3
        tree = make_drafter(es, DrafterSpec("auto", tree=TreeShape(3, 3, 8)))
        assert tree.name == "eagle3-tree"
        assert make_drafter(es, "none").name == "none"
