"""``xcompile export`` on the tiny checkpoints: the graphs follow the I/O contract with the opset-24
ops, weights are streamed into external data, the manifest records what was exported, bf16 graphs
are valid ONNX, and every bad request is a one-line error that leaves nothing behind.

Exports are the slow part (~3 s per graph here): each engine dir is exported once per session
under pytest's base temp dir and shared with test_diff.py and runtime/test_ort.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
import torch
from click.testing import CliRunner
from fixtures import TINY_DRAFT, TINY_QWEN3, exported_dir, write_qwen3_checkpoint
from safetensors.torch import load_file, save_file

from xcompile.compile import checkpoint as ck
from xcompile.compile.cli import main
from xcompile.compile.errors import CompileError
from xcompile.compile.pipeline import ExportRequest, export_engine_dir
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import DYNAMIC_DIMS, graph_spec
from xcompile.runtime.enginedir.integrity import record_file
from xcompile.runtime.enginedir.manifest import Manifest

MAX_SEQ = 64
OPSET24_OPS = {"TensorScatter", "Attention", "RotaryEmbedding", "RMSNormalization"}
ONNX_DTYPES = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
               "bfloat16": onnx.TensorProto.BFLOAT16, "int64": onnx.TensorProto.INT64, "bool": onnx.TensorProto.BOOL}


@pytest.fixture(scope="session")
def bf16_dir(tiny_target, tiny_eagle3, tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, "tiny-bf16", model=str(tiny_target), eagle3=str(tiny_eagle3), dtype="bf16")


def cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, code: int = 1) -> str:
    """A failed command: exit 1 (2 for a bad option), one `error:` line on stderr, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith((".partial", ".old", ".lock")))


# --------------------------------------------------------------------------------------------
# graphs


@pytest.mark.parametrize("graph", ["target", "draft", "eagle3", "eagle3_fc"])
def test_graph_io_follows_contract(fp32_dir, graph):
    """Names, dtypes and order of every input/output equal the contract's; only tokens/rows (and the
    eagle3 mask's mask_keys) are dynamic."""
    m = Manifest.load(fp32_dir)
    model = onnx.load(fp32_dir / m.graphs[graph].onnx, load_external_data=False)
    spec = graph_spec(graph, {"target": TINY_QWEN3["num_hidden_layers"], "draft": TINY_DRAFT["num_hidden_layers"]}
                      .get(graph, 0))
    dims = m.graphs[graph].dims
    for values, tensors in ((model.graph.input, spec.inputs), (model.graph.output, spec.outputs)):
        assert [v.name for v in values] == [t.name for t in tensors]
        for v, t in zip(values, tensors):
            assert v.type.tensor_type.elem_type == ONNX_DTYPES["float32" if t.dtype == "model" else t.dtype], v.name
            shape = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            assert shape == [d if d in DYNAMIC_DIMS else dims[d] for d in t.shape], v.name
    assert {o.domain: o.version for o in model.opset_import}[""] == 24


def test_target_graph_uses_opset24_kv_ops(fp32_dir):
    model = onnx.load(fp32_dir / "target.onnx", load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert OPSET24_OPS <= set(ops)
    layers = TINY_QWEN3["num_hidden_layers"]
    assert ops.count("TensorScatter") == 2 * layers and ops.count("Attention") == layers
    # each cache input is written by exactly one TensorScatter, whose output is the present output
    scatter = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "TensorScatter"}
    aliases = graph_spec("target", layers).aliases()
    outputs = {o.name for o in model.graph.output}
    for present, past in aliases.items():
        assert past in scatter and (scatter[past] == present or present in outputs)


def test_weights_are_external_and_named_like_the_checkpoint(fp32_dir, tiny_target, tiny_draft):
    """Initializers are the model's parameter names, all in <graph>.onnx.data, and hold the
    checkpoint's values; the tied draft model keeps one embedding."""
    checkpoint = ck.Checkpoint(tiny_target)
    model = ir.load(fp32_dir / "target.onnx")
    params = {n for n in model.graph.initializers if not n.endswith((".cos", ".sin"))}
    assert params == set(checkpoint.keys())
    for name, value in model.graph.initializers.items():
        assert isinstance(value.const_value, ir.ExternalTensor) and value.const_value.location == "target.onnx.data"
    w = model.graph.initializers["model.layers.2.mlp.down_proj.weight"].const_value.numpy()
    assert torch.equal(torch.from_numpy(w.copy()), checkpoint.get("model.layers.2.mlp.down_proj.weight"))
    draft = onnx.load(fp32_dir / "draft.onnx", load_external_data=False)
    tied = {"lm_head.weight", "model.embed_tokens.weight"} & {i.name for i in draft.graph.initializer}
    assert len(tied) == 1, tied           # one initializer feeds both the Gather and the output MatMul
    onnx.checker.check_model(str(fp32_dir / "target.onnx"), full_check=True)


def test_manifest_records_the_export(fp32_dir, tiny_target, tiny_eagle3):
    m = Manifest.load(fp32_dir)
    assert set(m.graphs) == {"target", "draft", "eagle3", "eagle3_fc"}
    assert (m.dtype, m.max_seq_len, m.max_batch) == ("fp32", MAX_SEQ, 1)
    assert m.models["target"].source == str(tiny_target) and m.models["target"].extra["taps"] == [0, 2, 3]
    assert m.models["eagle3"].extra == {"taps": [0, 2, 3], "taps_from": "default", "rope_theta": 10000.0,
                                        "taps_convention": "layer-output ids: the target's default (Qwen3Config.default_tap_layers)"}
    assert m.graphs["eagle3_fc"].model == "eagle3" and m.graphs["eagle3_fc"].dims == {"batch": 1, "taps_hidden": 192,
                                                                                      "hidden": 64}
    assert m.graphs["target"].dims == {"batch": 1, "vocab": 256, "hidden": 64, "kv_heads": 2, "head_dim": 16,
                                       "max_seq_len": MAX_SEQ, "taps_hidden": 192}
    # every file of the dir but the manifest and the marker carries the record its writer computed
    assert set(m.files) == {p.name for p in fp32_dir.iterdir()} - {"manifest.json", ".xcompile"}
    assert all(m.files[name] == record_file(fp32_dir / name) for name in m.files)
    for g in m.graphs.values():
        onnx_path = fp32_dir / g.onnx
        assert g.sha256 == m.files[g.onnx]["sha256"]
        props = {p.key: p.value for p in onnx.load(onnx_path, load_external_data=False).metadata_props}
        assert props["xcompile.external_data_sha256"] == m.files[g.onnx + ".data"]["sha256"]
    # and the checkpoint files it read, to tell at load whether they changed since
    assert m.inputs["target/model.safetensors"] == record_file(tiny_target / "model.safetensors")
    assert m.inputs["eagle3/config.json"] == record_file(tiny_eagle3 / "config.json")
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(m.tokenizer_files)
    assert all((fp32_dir / f).is_file() for f in m.tokenizer_files)
    assert m.eos_token_ids == [255, 253]
    assert torch.equal(load_file(fp32_dir / "d2t.safetensors")["d2t"], ck.Checkpoint(tiny_eagle3).get("d2t"))


def test_bf16_graphs_are_valid_onnx(bf16_dir, tiny_target):
    """What ORT CPU allows for bf16: the graphs pass the full ONNX checker (strict shape inference),
    their float I/O and weights are bf16, bytes equal the checkpoint cast to bf16. Running them
    needs bf16 MatMul kernels that ORT's CPU provider lacks: the ORT backend says so."""
    m = Manifest.load(bf16_dir)
    for graph in ("target", "eagle3", "eagle3_fc"):
        path = bf16_dir / m.graphs[graph].onnx
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(path, load_external_data=False)
        floats = [v for v in [*model.graph.input, *model.graph.output] if v.type.tensor_type.elem_type not in
                  (onnx.TensorProto.INT64, onnx.TensorProto.BOOL)]
        assert floats and all(v.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for v in floats)
        assert all(i.data_type == onnx.TensorProto.BFLOAT16 for i in model.graph.initializer)
    w = ir.load(bf16_dir / "target.onnx").graph.initializers["model.embed_tokens.weight"].const_value
    want = ck.Checkpoint(tiny_target).get("model.embed_tokens.weight").to(torch.bfloat16)
    assert w.tobytes() == want.view(torch.uint8).numpy().tobytes()
    from xcompile.runtime.engines import ort

    with pytest.raises(EngineError, match="bfloat16"):
        ort.load(bf16_dir, "target", "cpu")


# --------------------------------------------------------------------------------------------
# bad requests: one line, nothing written


def test_unsupported_architecture(tmp_path):
    src = write_qwen3_checkpoint(tmp_path / "llama", {"architectures": ["LlamaForCausalLM"]}, tokenizer=False)
    line = one_line_error(cli("export", "--model", src, "--out", tmp_path / "out"))
    assert "LlamaForCausalLM" in line and "config.json" in line
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("drop", [("d2t",), ("d2t", "t2d")])
def test_a_head_without_d2t_is_refused_in_one_line(tiny_target, tiny_eagle3, tmp_path, drop):
    """d2t is read before the head's keys are planned (its values checked first): a head without it is an
    incomplete checkpoint, said in one line (it was a KeyError traceback)."""
    head = shutil.copytree(tiny_eagle3, tmp_path / "head")
    tensors = load_file(head / "model.safetensors")
    for key in drop:
        tensors.pop(key, None)
    save_file(tensors, head / "model.safetensors")
    line = one_line_error(cli("export", "--model", tiny_target, "--eagle3", head, "--out", tmp_path / "out",
                              "--max-seq-len", MAX_SEQ))
    assert f"{head}: missing tensor 'd2t'" in line and f"--local-dir {head}`" in line
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_max_seq_len_beyond_max_position_embeddings(tiny_target, tmp_path):
    line = one_line_error(cli("export", "--model", tiny_target, "--out", tmp_path / "out", "--max-seq-len", 1024), code=2)
    assert "max_position_embeddings 512" in line
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unwritable_output_dir(tiny_target, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    line = one_line_error(cli("export", "--model", tiny_target, "--out", blocker / "sub" / "out",
                              "--max-seq-len", MAX_SEQ), code=2)          # a bad --out, seen before any work
    assert f"--out: {blocker} is not a writable directory, so {blocker / 'sub' / 'out'} cannot be written" in line
    assert blocker.read_text() == "not a dir" and leftovers(tmp_path) == []


def test_existing_dir_needs_force(tiny_target, tmp_path):
    """An existing dir needs --force, and --force replaces only a dir that xcompile wrote."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = one_line_error(cli("export", "--model", tiny_target, "--out", out, "--max-seq-len", MAX_SEQ))
    assert "already exists" in line and "--force" in line
    line = one_line_error(cli("export", "--model", tiny_target, "--out", out, "--max-seq-len", MAX_SEQ, "--force"))
    assert "not written by xcompile" in line and "even with --force" in line
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()                             # an empty dir holds nothing to lose
    for _ in range(2):                                      # then the export xcompile wrote is replaced
        result = cli("export", "--model", tiny_target, "--out", out, "--max-seq-len", MAX_SEQ, "--force")
        assert result.exit_code == 0, result.output
    assert Manifest.load(out).graphs.keys() == {"target"} and (out / ".xcompile").is_file()
    assert leftovers(tmp_path) == []


def test_failure_mid_export_leaves_nothing(tiny_target, tmp_path):
    """A checkpoint whose weights contradict its config fails after the graph was traced: the staging
    dir goes away and --out is never created."""
    src = tmp_path / "bad"
    shutil.copytree(tiny_target, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(CompileError, match="has shape"):
        export_engine_dir(ExportRequest(model=str(src), out=tmp_path / "out", max_seq_len=MAX_SEQ, dtype="fp32"))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_requests_rejected_before_any_work(tiny_target, tmp_path):
    out = tmp_path / "out"
    assert "--model qwen3-9000b: no synthetic weights" in one_line_error(
        cli("export", "--model", "qwen3-9000b", "--synthetic", "--out", out), 2)
    assert "no published EAGLE3 head" in one_line_error(cli("export", "--model", tiny_target, "--eagle3", "--out", out))
    assert "--max-batch" in one_line_error(cli("export", "--model", tiny_target, "--max-batch", 0, "--out", out), 2)
    nope = tmp_path / "nope"                        # the option whose checkpoint is missing, and what it takes
    said = one_line_error(cli("export", "--model", tiny_target, "--mtp", nope, "--out", out))
    assert f"--mtp {nope}: no such directory" in said and "Hugging Face repo id" in said
    assert not out.exists() and leftovers(tmp_path) == []
