"""The TensorRT backend's own logic against a stand-in TensorRT module (fake_trt.py): binding by
name, in-place KV aliasing, profile and shape selection, CUDA-graph capture and its fallback,
manifest/version checks. The ``gpu`` tests run the same stand-in on a CUDA device with real CUDA
graphs, and (``gpu`` + ``trt``) a real engine built from the tiny checkpoints."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from fake_trt import FakeTrt, engine_bytes
from fixtures import save_manifest, step_inputs

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import DTYPES, graph_spec
from xcompile.runtime.enginedir.manifest import EngineEntry, GraphEntry, Manifest, ModelEntry, io_table
from xcompile.runtime.engines import trt as backend
from xcompile.runtime.engines import trt_flavor

MAX_SEQ, K = 16, 3          # decode/verify profile: 1..K+1 tokens
VERSION = "1.7.1.116"
DIMS = {"target": {"batch": 1, "vocab": 11, "hidden": 2, "taps_hidden": 6, "kv_heads": 2, "head_dim": 4,
                   "max_seq_len": MAX_SEQ},
        "eagle3_fc": {"batch": 1, "taps_hidden": 6, "hidden": 2}}
LAYERS = {"target": 2, "eagle3_fc": 0}
PROFILES = [{"name": "prefill", "tokens": [1, 8, MAX_SEQ], "rows": [1, 1, MAX_SEQ]},
            {"name": "decode", "tokens": [1, K + 1, K + 1], "rows": [1, K + 1, K + 1]}]


def make_dir(root: Path, version: str = VERSION, manifest_version: str | None = None, dtype: str = "fp32",
             flavor: str = "rtx", **overrides) -> Path:
    """An engine dir holding fake engines for the target and eagle3_fc graphs."""
    graphs, engines = {}, {}
    for graph, layers in LAYERS.items():
        io = io_table(graph_spec(graph, layers))
        graphs[graph] = GraphEntry(f"{graph}.onnx", "target", io, DIMS[graph])
        engines[graph] = EngineEntry(f"{graph}.engine", graph, flavor, manifest_version or version, [], PROFILES)
        (root / f"{graph}.engine").write_bytes(engine_bytes(io, DIMS[graph], PROFILES, DTYPES[dtype], version,
                                                            **overrides))
    return save_manifest(Manifest("tiny", dtype, MAX_SEQ, 1, {"target": ModelEntry("qwen3", {}, "synthetic-hash:tiny:0")},
                                  graphs, engines), root)


def step(ids: list[int], start: int, rows: list[int] | None = None, device="cpu") -> dict[str, torch.Tensor]:
    """Causal step inputs for ``ids`` written at ``start``; logits of ``rows`` (default: the last)."""
    rows = [len(ids) - 1] if rows is None else rows
    return step_inputs(torch.tensor([ids], device=device), start, rows=torch.tensor([rows], device=device))


class FakeCapture:
    """Stands in for ``graphs.CudaGraphCapture`` on CPU and records captures; ``fail`` makes every
    capture fail as a launch that cannot be captured does."""

    def __init__(self, fail: bool = False):
        self.fail, self.captures, self.replays = fail, 0, 0

    def __call__(self, launch, device):
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")

        def replay():
            self.replays += 1
            assert launch()

        return replay, True


def captured_engine(directory: Path, fake: FakeTrt, graphs: FakeCapture) -> backend.TrtEngine:
    """The dir's target engine on cpu, capturing through ``graphs``."""
    manifest = Manifest.load(directory)
    return backend.TrtEngine((directory / "target.engine").read_bytes(), manifest.engines["target"],
                             graph_spec("target", 2), manifest.kv_shape("target"), torch.float32, "cpu",
                             trt=fake, graphs=graphs)


@pytest.fixture
def fake():
    return FakeTrt(VERSION)


def test_run_binds_by_name_and_updates_kv_in_place(tmp_path, fake):
    eng = backend.load(make_dir(tmp_path), "target", "cpu", trt=fake)
    kv = eng.new_kv()
    out = eng.run(**step([5, 7, 2, 9, 4], 0, rows=[1, 4]))
    assert set(out) == {"logits", "hidden_taps"}
    assert out["logits"].shape == (1, 2, 11) and out["hidden_taps"].shape == (1, 5, 6)
    # one-hot at next id (+1), nothing committed yet
    assert out["logits"][0].argmax(-1).tolist() == [8, 5]
    assert out["hidden_taps"][0, :, 0].tolist() == [5, 7, 2, 9, 4]
    # the engine wrote the caller's buffers: key_i = ids + i, value = positions, rows 0..4
    assert kv[0][0, 0, :5, 0].tolist() == [5, 7, 2, 9, 4] and kv[2][0, 1, :5, 3].tolist() == [6, 8, 3, 10, 5]
    assert kv[1][0, 0, :5, 0].tolist() == [0, 1, 2, 3, 4] and kv[0][0, 0, 5:].abs().sum() == 0
    # decode step reads the committed cache (fake adds the sum of key_0 over rows < write_index)
    out = eng.run(**step([3], 5))
    assert out["logits"][0, 0, 4].item() == 1 + (5 + 7 + 2 + 9 + 4)
    assert kv[0][0, 0, 5, 0].item() == 3
    assert fake.executions == [0, 1]        # prefill profile, then the decode/verify profile


def test_outputs_are_views_of_preallocated_buffers(tmp_path, fake):
    eng = backend.load(make_dir(tmp_path), "target", "cpu", trt=fake)
    eng.new_kv()
    first = eng.run(**step([1, 2, 3], 0))["logits"]
    ptr = first.data_ptr()
    second = eng.run(**step([4], 3))["logits"]
    assert second.data_ptr() == ptr         # same storage, no allocation per step
    assert first.shape == second.shape == (1, 1, 11)


def test_profile_selection_by_token_count(tmp_path, fake):
    eng = backend.load(make_dir(tmp_path), "target", "cpu", trt=fake)
    eng.new_kv()
    for n, profile in ((1, 1), (K + 1, 1), (K + 2, 0), (MAX_SEQ, 0)):
        eng.run(**step(list(range(n)), 0))
        assert fake.executions[-1] == profile, n
    with pytest.raises(EngineError, match="fit no optimization profile"):
        eng.run(**step(list(range(MAX_SEQ + 1)), 0))


def test_engine_without_kv_cache(tmp_path, fake):
    eng = backend.load(make_dir(tmp_path), "eagle3_fc", "cpu", trt=fake)
    assert eng.kv_shape is None
    taps = torch.arange(18, dtype=torch.float32).view(1, 3, 6)
    out = eng.run(hidden_taps=taps)["hidden_states"]
    assert torch.equal(out, taps[..., :2] + 1)


def test_bf16_engine_buffers_follow_manifest_dtype(tmp_path, fake):
    eng = backend.load(make_dir(tmp_path, dtype="bf16"), "target", "cpu", trt=fake)
    kv = eng.new_kv()
    assert kv[0].dtype == torch.bfloat16
    assert eng.run(**step([1, 2], 0))["logits"].dtype == torch.bfloat16


def test_run_checks_inputs_and_kv_binding(tmp_path, fake):
    eng = backend.load(make_dir(tmp_path), "target", "cpu", trt=fake)
    with pytest.raises(EngineError, match="bind KV buffers"):
        eng.run(**step([1], 0))
    eng.new_kv()
    bad = step([1], 0)
    del bad["tree_mask"]
    with pytest.raises(EngineError, match="run\\(\\) takes"):
        eng.run(**bad)
    with pytest.raises(EngineError, match="KV buffer"):
        eng.bind_kv([torch.zeros(1, 2, MAX_SEQ + 1, 4)] * 4)


@pytest.mark.parametrize("overrides, message", [
    ({"aliases": {"present_key_1": None}}, "present_key_1 is not aliased to past_key_1"),
    ({"dtypes": {"logits": "float16"}}, "logits is float16, expected float32"),
    ({"drop": ["hidden_taps"]}, "missing tensors \\['hidden_taps'\\]"),
])
def test_engine_checked_against_contract(tmp_path, fake, overrides, message):
    with pytest.raises(EngineError, match=message):
        backend.load(make_dir(tmp_path, **overrides), "target", "cpu", trt=fake)


def test_engine_from_another_version_says_rebuild(tmp_path, fake):
    directory = make_dir(tmp_path, version="10.13.0.35")
    with pytest.raises(EngineError, match="built with TensorRT-RTX 10.13.0.35, this runtime has 1.7.1.116.*rebuild"):
        backend.load(directory, "target", "cpu", trt=fake)


@pytest.mark.parametrize("logged, message", [
    # TensorRT-RTX 1.7 on this CPU-only machine: nothing is wrong with the engine, rebuilding would not help
    ("IRuntime::deserializeCudaEngine: Error Code 1: Cuda Runtime (In ScopedCudaStream (cudaError 35: CUDA driver "
     "version is insufficient for CUDA runtime version))", "no usable CUDA device or driver.*do not rebuild"),
    ("The engine plan file is generated on an incompatible device, expecting compute 8.9 got compute 9.0",
     "another TensorRT version or GPU.*rebuild it on this machine"),
    (None, "another TensorRT version or GPU.*magicTag.*rebuild it on this machine"),
    ("Error Code 2: Internal Error (something else)", "could not deserialize it.*as built: rebuild"),
])
def test_undeserializable_engine_says_why(tmp_path, fake, logged, message):
    # manifest, file hashes and runtime version agree, but TensorRT refuses the plan: what it logged says why
    directory = make_dir(tmp_path, version="1.7.0.0", manifest_version=VERSION)
    fake.refusal = logged or fake.refusal
    with pytest.raises(EngineError, match=message):
        backend.load(directory, "target", "cpu", trt=fake)


def test_tampered_engine_is_refused_before_tensorrt_sees_it(tmp_path, fake):
    directory = make_dir(tmp_path)
    data = bytearray((directory / "target.engine").read_bytes())
    data[len(data) // 2] ^= 0x20                            # same size, one bit
    (directory / "target.engine").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="target.engine: bytes 0..* differ from what was recorded.*re-export"):
        backend.load(directory, "target", "cpu", trt=fake)


def test_missing_engine_says_build(tmp_path, fake):
    directory = make_dir(tmp_path)
    (directory / "target.engine").unlink()
    with pytest.raises(EngineError, match="engine file missing"):
        backend.load(directory, "target", "cpu", trt=fake)
    m = Manifest.load(directory)
    del m.engines["target"]
    m.save(directory)
    with pytest.raises(EngineError, match="xcompile build"):
        backend.load(directory, "target", "cpu", trt=fake)


def test_cuda_graph_capture_replays_fixed_shape_steps(tmp_path, fake):
    graphs = FakeCapture()
    eng = captured_engine(make_dir(tmp_path), fake, graphs)
    kv = eng.new_kv()
    eng.run(**step(list(range(8)), 0))                   # prefill profile: never captured
    committed = sum(range(8))
    for i in range(4):
        out = eng.run(**step([i + 1], 8 + i))            # decode: warm, capture (+replay), replay, replay
        assert out["logits"][0, 0, (i + 2) % 11].item() == 1 + committed     # reads the cache as of this step
        assert kv[0][0, 0, 8 + i, 0].item() == i + 1     # each replay really ran the step
        committed += i + 1
    assert (graphs.captures, graphs.replays) == (1, 3)
    eng.run(**step([1, 2], 12))                          # a new decode shape gets its own graph later
    eng.run(**step([1, 2], 12))
    assert graphs.captures == 2
    eng.new_kv()                                         # new addresses: graphs are dropped
    eng.run(**step([1], 0))
    eng.run(**step([1], 0))
    assert graphs.captures == 3


def test_cuda_graph_capture_failure_falls_back(tmp_path, fake):
    graphs = FakeCapture(fail=True)
    eng = captured_engine(make_dir(tmp_path), fake, graphs)
    kv = eng.new_kv()
    eng.run(**step([1], 0))
    with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed"):
        eng.run(**step([2], 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # warned once per shape, then plain execution
        eng.run(**step([3], 2))
    assert graphs.captures == 1 and kv[0][0, 0, :3, 0].tolist() == [1, 2, 3]


def test_rtx_engine_not_stream_capturable_runs_uncaptured(tmp_path, fake):
    fake.capturable = False
    graphs = FakeCapture()
    eng = captured_engine(make_dir(tmp_path), fake, graphs)
    eng.new_kv()
    eng.run(**step([1], 0))
    with pytest.warns(RuntimeWarning):
        eng.run(**step([1], 0))
    assert graphs.captures == 0


def test_missing_tensorrt_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)       # import fails as if not installed
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    with pytest.raises(EngineError, match="pip install tensorrt-rtx-cu13"):
        trt_flavor.import_trt("rtx")
    with pytest.raises(EngineError, match="no TensorRT flavor is installed.*pip install tensorrt-rtx-cu13"):
        trt_flavor.resolve_flavor("auto")


def test_auto_flavor_prefers_full_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", FakeTrt("10.15.1", name="tensorrt"))
    assert trt_flavor.resolve_flavor("auto") == "tensorrt"
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", FakeTrt())
    assert trt_flavor.resolve_flavor("auto") == "rtx"


@pytest.mark.gpu
@pytest.mark.parametrize("flavor", ["rtx", "tensorrt"])
def test_fake_engine_with_real_cuda_graphs(tmp_path, flavor):
    """The capture path with torch.cuda.CUDAGraph: replays match eager steps; an engine that cannot be
    captured (TRT-RTX: is_stream_capturable; TensorRT: enqueue fails under capture) runs eagerly."""
    fake = FakeTrt(VERSION, device="cuda")
    directory = make_dir(tmp_path, flavor=flavor)
    eng = backend.load(directory, "target", "cuda", trt=fake, cuda_graphs=True)
    ref = backend.load(directory, "target", "cuda", trt=fake, cuda_graphs=False)
    for e in (eng, ref):
        e.new_kv()
        e.run(**step(list(range(1, 9)), 0, device="cuda"))
    for i in range(4):                      # 8 + 4 * 2 tokens fill the 16-slot cache exactly
        a = eng.run(**step([i + 1, i + 2], 8 + 2 * i, rows=[0, 1], device="cuda"))["logits"].clone()
        b = ref.run(**step([i + 1, i + 2], 8 + 2 * i, rows=[0, 1], device="cuda"))["logits"].clone()
        assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(eng.kv, ref.kv))
    assert len([r for r in eng._replays.values() if r is not None]) == 1
    fake.capturable = False
    eng.new_kv()
    eng.run(**step([1], 0, device="cuda"))
    with pytest.warns(RuntimeWarning, match="capture failed"):
        eng.run(**step([2], 1, device="cuda"))
    eng.run(**step([3], 2, device="cuda"))
    torch.cuda.synchronize()
    assert eng.kv[0][0, 0, :3, 0].tolist() == [1, 2, 3]
