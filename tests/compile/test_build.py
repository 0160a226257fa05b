"""``xcompile build`` on the tiny checkpoints: TRT-RTX engines built on this CPU-only machine for
compute capability 8.9, the parsed networks checked against the I/O contract, skip/rebuild rules,
and the errors a user meets (no TensorRT, a graph the parser rejects, an unsupported target)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures import save_manifest

from xcompile.compile import build as b
from xcompile.compile import export_build
from xcompile.compile import trt_loaders as loaders
from xcompile.compile.cli import main
from xcompile.compile.errors import CompileError
from xcompile.runtime.enginedir.contract import MODEL_DTYPE, graph_spec
from xcompile.runtime.enginedir.integrity import record_file
from xcompile.runtime.enginedir.manifest import GraphEntry, Manifest, ModelEntry, io_table, kv_layers

MAX_SEQ = 64
RTX = ["--trt", "rtx", "--compute-capability", "8.9"]
# CPU-only builds need TensorRT-RTX specifically (full TensorRT builds on a GPU only)
rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="needs TensorRT-RTX")


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result


@pytest.fixture(scope="module")
def built(tiny_target, tiny_eagle3, tiny_draft, tmp_path_factory) -> Path:
    """One `xcompile build` of target + EAGLE3 head + draft model (bf16), TRT-RTX for SM 8.9."""
    out = tmp_path_factory.mktemp("built") / "tiny"
    cli("build", "--model", str(tiny_target), "--eagle3", str(tiny_eagle3), "--draft-model", str(tiny_draft),
        "--max-seq-len", str(MAX_SEQ), "--max-draft-tokens", "7", "--out", str(out), *RTX)
    return out


@pytest.mark.trt
@rtx
def test_build_writes_engines_and_manifest(built):
    import tensorrt_rtx

    m = Manifest.load(built)
    assert set(m.engines) == {"target", "eagle3", "eagle3_fc", "draft"}
    for graph, e in m.engines.items():
        assert (built / e.file).stat().st_size > 0
        assert (e.graph, e.flavor, e.trt_version, e.compute_capabilities) == (graph, "rtx", tensorrt_rtx.__version__,
                                                                             ["8.9"])
        assert e.profiles == [{"name": "prefill", "tokens": [1, MAX_SEQ, MAX_SEQ], "rows": [1, 1, MAX_SEQ]},
                              {"name": "decode", "tokens": [1, 8, 8], "rows": [1, 8, 8]}]
        # the engine's inputs cover the graph's ONNX file and its external data
        assert e.onnx_sha256 == b.graph_digest(m, graph) and m.graph_files(graph) == [f"{graph}.onnx",
                                                                                    f"{graph}.onnx.data"]
        assert m.files[e.file] == record_file(built / e.file)


@pytest.mark.trt
@rtx
@pytest.mark.parametrize("graph", ["target", "eagle3", "eagle3_fc", "draft"])
def test_parsed_network_follows_contract(built, graph):
    """The TRT-RTX parser's network: contract names and dtypes, each past KV input feeding a
    KV-cache-update layer whose output is its present output, attention and RoPE layers present."""
    trt, poly = loaders.polygraphy_backend("rtx")
    m = Manifest.load(built)
    layers = kv_layers(m.graphs[graph].io)
    spec = graph_spec(graph, layers)
    with loaders.polygraphy_errors():
        _, network, _ = poly.NetworkFromOnnxPath(str(built / f"{graph}.onnx"), strongly_typed=True)()
    report = loaders.inspect_network(network, spec, "bfloat16", trt)
    assert report.problems == []
    want = {t.name: "bfloat16" if t.dtype == MODEL_DTYPE else t.dtype for t in spec.inputs}
    assert report.inputs == want
    assert report.outputs == {t.name: "bfloat16" if t.dtype == MODEL_DTYPE else t.dtype for t in spec.outputs}
    assert report.kv_updates == {past: present for present, past in spec.aliases().items()}
    assert (report.attention, report.rope) == (layers, 2 * layers)       # RoPE on q and k


@pytest.mark.trt
@rtx
def test_unchanged_rebuild_is_skipped_and_force_rebuilds(built):
    engine = built / "target.engine"
    before = engine.stat().st_mtime_ns
    lines = []
    b.build(built, b.BuildOptions(flavor="rtx", compute_capabilities=("8.9",), max_draft_tokens=7), lines.append)
    assert engine.stat().st_mtime_ns == before
    assert sum("up to date, kept" in line for line in lines) == 4
    b.build(built, b.BuildOptions(flavor="rtx", compute_capabilities=("8.9",), max_draft_tokens=7, force=True),
            lines.append)
    assert engine.stat().st_mtime_ns > before


@pytest.mark.trt
@rtx
def test_cli_rerun_reuses_export_and_engines(built, tiny_target, tiny_eagle3, tiny_draft):
    result = cli("build", "--model", str(tiny_target), "--eagle3", str(tiny_eagle3), "--draft-model", str(tiny_draft),
                 "--max-seq-len", str(MAX_SEQ), "--max-draft-tokens", "7", "--out", str(built), *RTX)
    assert "not re-exported" in result.stderr and result.stderr.count("up to date, kept") == 4


@pytest.mark.trt
@rtx
def test_inspect_shows_io_profiles_and_aliasing(built):
    text = cli("inspect", str(built)).stdout
    assert "engine target: target.engine, rtx" in text
    assert "prefill tokens 1..64 (opt 64); decode tokens 1..8 (opt 8)" in text
    assert "present_key_3    prefill [1, 2, 64, 16] | decode [1, 2, 64, 16]  aliases past_key_3" in text
    data = json.loads(cli("inspect", str(built), "--json").stdout)
    assert data["graphs"]["eagle3"]["aliases"] == {"present_key_0": "past_key_0", "present_value_0": "past_value_0"}
    assert data["engines"]["draft"]["shapes"]["logits"] == ["[1, 1..64, 256]", "[1, 1..8, 256]"]


def _single_graph_dir(root: Path, onnx_file: Path, graph: str = "eagle3_fc", dims: dict | None = None,
                      dtype: str = "bf16") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{graph}.onnx"
    if onnx_file != target:
        target.write_bytes(onnx_file.read_bytes())
        data = onnx_file.with_name(onnx_file.name + ".data")
        if data.is_file():
            (root / data.name).write_bytes(data.read_bytes())
    layers = {"eagle3_fc": 0, "eagle3": 1}.get(graph, 4)
    return save_manifest(Manifest("t", dtype, MAX_SEQ, 1, {"target": ModelEntry("qwen3", {}, "test")},
                                  {graph: GraphEntry(target.name, "target", io_table(graph_spec(graph, layers)),
                                                     dims or {})}), root)


@pytest.mark.trt
@rtx
def test_parser_rejection_names_the_node(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("hidden_taps", TensorProto.BFLOAT16, [1, "tokens", 192])
    y = helper.make_tensor_value_info("hidden_states", TensorProto.BFLOAT16, [1, "tokens", 64])
    node = helper.make_node("FancyProjection", ["hidden_taps"], ["hidden_states"], name="fc_fancy", domain="acme")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("acme", 1)])
    onnx.save(model, tmp_path / "eagle3_fc.onnx")
    directory = _single_graph_dir(tmp_path, tmp_path / "eagle3_fc.onnx")
    with pytest.raises(CompileError, match="parser rejected the graph.*fc_fancy.*FancyProjection"):
        b.build(directory, b.BuildOptions(flavor="rtx", compute_capabilities=("8.9",)), progress=lambda _: None)


@pytest.mark.trt
@rtx
def test_graph_off_contract_is_refused(built, tmp_path):
    import onnx

    model = onnx.load(str(built / "eagle3_fc.onnx"))
    model.graph.output[0].name = "projected"
    for node in model.graph.node:
        node.output[:] = ["projected" if o == "hidden_states" else o for o in node.output]
    onnx.save(model, tmp_path / "eagle3_fc.onnx", save_as_external_data=False)
    directory = _single_graph_dir(tmp_path / "dir", tmp_path / "eagle3_fc.onnx")
    with pytest.raises(CompileError, match="does not follow the I/O contract.*projected"):
        b.build(directory, b.BuildOptions(flavor="rtx"), progress=lambda _: None)


@pytest.mark.trt
@rtx
def test_unsupported_compute_capability(built):
    with pytest.raises(CompileError, match="9.0: TensorRT-RTX .* targets .*8.9.*full TensorRT"):
        b.build(built, b.BuildOptions(flavor="rtx", compute_capabilities=("9.0",)), progress=lambda _: None)


def test_compute_capability_is_rtx_only(tmp_path, monkeypatch):
    save_manifest(Manifest("t", "bf16", MAX_SEQ, 1, {"target": ModelEntry("qwen3", {}, "test")}), tmp_path)
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.15.1"))
    with pytest.raises(CompileError, match="applies to TensorRT-RTX only"):
        b.build(tmp_path, b.BuildOptions(flavor="tensorrt", compute_capabilities=("8.9",)), progress=lambda _: None)


@pytest.mark.trt
@rtx
def test_fp32_graph_builds_with_decomposable_attention(tiny_eagle3, tiny_target, tmp_path):
    """No fused fp32 attention kernel: the builder marks IAttention decomposable."""
    import torch

    from xcompile.compile.checkpoint import load_eagle3, load_qwen3, tap_layers
    from xcompile.compile.export import export_graph
    from xcompile.compile.head_config import parse_eagle3
    from xcompile.compile.hf_config import parse_qwen3

    cfg = parse_qwen3(tiny_target / "config.json")
    target = load_qwen3(tiny_target, MAX_SEQ, tap_layers(parse_eagle3(tiny_eagle3 / "config.json"), cfg), torch.float32)
    head = load_eagle3(tiny_eagle3, target, MAX_SEQ)
    done = export_graph(head, tmp_path / "eagle3.onnx", max_tokens=MAX_SEQ)
    directory = _single_graph_dir(tmp_path, done.onnx, "eagle3", done.dims, dtype="fp32")
    m = b.build(directory, b.BuildOptions(flavor="rtx", compute_capabilities=("8.9",)), progress=lambda _: None)
    assert (directory / m.engines["eagle3"].file).stat().st_size > 0


def test_no_tensorrt_installed_names_the_pip_command(tmp_path, monkeypatch):
    save_manifest(Manifest("t", "bf16", MAX_SEQ, 1, {"target": ModelEntry("qwen3", {}, "test")}), tmp_path)
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    with pytest.raises(CompileError, match="pip install tensorrt-rtx-cu13.*full TensorRT"):
        b.build(tmp_path, b.BuildOptions(flavor="auto"), progress=lambda _: None)
    with pytest.raises(CompileError, match="TensorRT-RTX is not installed.*pip install tensorrt-rtx-cu13"):
        b.build(tmp_path, b.BuildOptions(flavor="rtx"), progress=lambda _: None)


def test_default_profiles():
    prefill, decode = b.default_profiles(4096, 7)
    assert prefill.as_dict() == {"name": "prefill", "tokens": [1, 512, 4096], "rows": [1, 1, 4096]}
    assert decode.as_dict() == {"name": "decode", "tokens": [1, 8, 8], "rows": [1, 8, 8]}
    assert b.default_profiles(16)[1].tokens == (1, 16, 16)       # never past the cache


def test_default_out():
    assert export_build.default_out("qwen3-8b") == Path("engines/qwen3-8b")
    assert export_build.default_out("Qwen/Qwen3-8B") == Path("engines/qwen3-8b")
    assert export_build.default_out("/ckpts/my-model/") == Path("engines/my-model")


@pytest.mark.gpu
@pytest.mark.trt
def test_engine_matches_torch_reference_on_gpu(tiny_target, tmp_path):
    """A real engine on this GPU (full TensorRT, or TRT-RTX for the GPU's compute capability) against
    the PyTorch reference, teacher-forced: prefill then two decode steps."""
    import torch

    from xcompile.compile.checkpoint import load_qwen3
    from xcompile.runtime.engines import trt as backend

    flavor = "tensorrt" if importlib.util.find_spec("tensorrt") else "rtx"
    major, minor = torch.cuda.get_device_capability()
    args = ["--trt", flavor]
    if flavor == "rtx":
        import tensorrt_rtx

        if f"SM{major}{minor}" not in tensorrt_rtx.ComputeCapability.__members__:
            pytest.skip(f"TensorRT-RTX does not target compute capability {major}.{minor}; needs full TensorRT")
        args += ["--compute-capability", f"{major}.{minor}"]
    out = tmp_path / "tiny"
    # a fresh process: Polygraphy binds one TensorRT flavor per process
    run = subprocess.run([sys.executable, "-c", "from xcompile.compile.cli import main; main()", "build", "--model",
                          str(tiny_target), "--max-seq-len", str(MAX_SEQ), "--max-draft-tokens", "3", "--out",
                          str(out), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    engine = backend.load(out, "target", "cuda")
    ref = load_qwen3(tiny_target, MAX_SEQ, None, torch.bfloat16, "cuda")
    kv, ref_kv = engine.new_kv(), ref.new_kv(device="cuda")
    ids = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 7]], device="cuda")
    for start, n in ((0, 8), (8, 1), (9, 1)):
        x = ids[:, start:start + n] if start < 8 else ids[:, :1] + start
        feed = {"input_ids": x, "position_ids": torch.arange(start, start + n, device="cuda")[None],
                "write_index": torch.tensor([start], device="cuda"),
                "tree_mask": torch.ones(1, n, n, dtype=torch.bool, device="cuda").tril(),
                "logit_rows": torch.arange(n, device="cuda")[None]}
        got = engine.run(**feed)["logits"].float()
        with torch.inference_mode():
            want = ref(*feed.values(), *ref_kv)[0].float()
        # bf16 engine vs bf16 reference: the argmax may flip only on a near-tie of the reference
        picked = want.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
        assert (want.max(-1).values - picked <= 0.1).all(), (start, got.argmax(-1), want.argmax(-1))
        assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert all((a.float() - b.float()).abs().max() < 0.05 for a, b in zip(kv, ref_kv))


def test_memory_warning_before_a_build_that_cannot_fit(tmp_path, monkeypatch):
    (tmp_path / "target.onnx").write_bytes(b"x" * 1000)
    (tmp_path / "target.onnx.data").write_bytes(b"x" * 9000)
    lines = []
    monkeypatch.setattr(b, "available_memory", lambda: 20_000)
    b.warn_if_short_of_memory(tmp_path / "target.onnx", lines.append)
    assert len(lines) == 1 and "may be killed" in lines[0]
    monkeypatch.setattr(b, "available_memory", lambda: 10**9)
    b.warn_if_short_of_memory(tmp_path / "target.onnx", lines.append)
    assert len(lines) == 1


@rtx
def test_a_draft_size_past_the_dirs_context_is_refused_not_capped(tiny_engine_dir):
    """--max-draft-tokens asked for beyond what the exported dir's max_seq_len holds: one line, exit 2, no engine."""
    result = CliRunner().invoke(main, ["build", str(tiny_engine_dir), "--max-draft-tokens", "256", *RTX])
    assert result.exit_code == 2 and "--max-draft-tokens 256" in result.output and "at most 255" in result.output, \
        result.output
    assert not list(tiny_engine_dir.glob("*.engine"))


@rtx
def test_a_draft_size_past_the_exports_context_is_refused_before_exporting(tiny_target, tmp_path):
    """From a checkpoint: the export's max_seq_len is known from the plan, so the refusal comes before minutes of
    export, and nothing is written."""
    out = tmp_path / "built"
    result = CliRunner().invoke(main, ["build", "--model", str(tiny_target), "--max-seq-len", "64",
                                       "--max-draft-tokens", "100", "--out", str(out), *RTX])
    assert result.exit_code == 2 and "--max-draft-tokens 100" in result.output and "at most 63" in result.output, \
        result.output
    assert "exporting" not in result.output and not out.exists()
