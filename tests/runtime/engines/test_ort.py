"""The ONNX Runtime backend on the exported tiny graphs (fp32, CPU) against the PyTorch reference:
prefill, decode through the in-place cache, tree-masked verify, each EAGLE3 phase, the draft model.
Tolerance: logits max abs error <= 1e-4 (observed ~5e-6), KV and hidden states <= 1e-4.

The engine dir is exported once per session (same helper and name as compile/test_export.py)."""

from __future__ import annotations

import pytest
import torch
from fixtures import step_inputs

from xcompile.compile import checkpoint as ck
from xcompile.compile.models.eagle3 import Eagle3FC
from xcompile.compile.pipeline import ExportRequest, export_engine_dir
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import KVShape, graph_spec
from xcompile.runtime.engines import ort
from xcompile.runtime.engines.torch_module import TorchEngine

MAX_SEQ = 64
TAPS = (0, 2, 3)
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_target, tiny_eagle3, tiny_draft):
    target = ck.load_qwen3(tiny_target, MAX_SEQ, TAPS)
    head = ck.load_eagle3(tiny_eagle3, target, MAX_SEQ)
    draft = ck.load_draft_model(tiny_draft, target.cfg, MAX_SEQ)
    return {"target": target, "eagle3": head, "eagle3_fc": Eagle3FC(head), "draft": draft}


def pair(fp32_dir, models, graph: str):
    """(ort engine, torch reference engine), each with fresh KV buffers."""
    engine = ort.load(fp32_dir, graph)
    kv = engine.kv_shape
    reference = TorchEngine(models[graph], graph_spec(graph, kv.layers if kv else 0), kv, torch.float32, "cpu")
    engine.new_kv(), reference.new_kv()
    return engine, reference


def check(got: dict, want: dict, tol: float = TOL) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        err = (got[name] - want[name]).abs().max().item()
        assert err <= tol, f"{name}: max abs error {err:.3g} > {tol}"


def check_kv(engine, reference, upto: int) -> None:
    for a, b in zip(engine.kv, reference.kv):
        assert (a[:, :, :upto] - b[:, :, :upto]).abs().max().item() <= TOL


def test_prefill_decode_in_place_and_tree_verify(fp32_dir, models):
    engine, reference = pair(fp32_dir, models, "target")
    buffers = list(engine.kv)
    pointers = [b.data_ptr() for b in buffers]
    prompt = torch.tensor([[5, 17, 42, 8, 99, 3, 250]])
    n = prompt.shape[1]
    check(engine.run(**step_inputs(prompt, rows=torch.tensor([[n - 1]]))),
          reference.run(**step_inputs(prompt, rows=torch.tensor([[n - 1]]))))
    check_kv(engine, reference, n)

    # decode: the cache is updated in the bound buffer itself, nothing is reallocated
    before = [b.clone() for b in buffers]
    for i in range(3):
        feed = step_inputs(torch.tensor([[11 + i]]), start=n + i)
        check(engine.run(**feed), reference.run(**feed))
    assert all(not torch.equal(b, old) for b, old in zip(buffers, before))
    assert [b.data_ptr() for b in engine.kv] == pointers and all(a is b for a, b in zip(engine.kv, buffers))
    assert all(torch.equal(b[:, :, :n], old[:, :, :n]) for b, old in zip(buffers, before))   # only new rows written
    check_kv(engine, reference, n + 3)

    # tree verify at length L: root, two children at depth 1, a grandchild under the first
    start = n + 3
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    feed = step_inputs(torch.tensor([[7, 30, 31, 60]]), start=start, tree_mask=tree,
                       positions=torch.tensor([[start, start + 1, start + 1, start + 2]]))
    check(engine.run(**feed), reference.run(**feed))
    check_kv(engine, reference, start + 4)


def test_eagle3_phases(fp32_dir, models):
    """fc over target taps, the prompt pass filling the head's cache, then draft steps fed back."""
    target, target_ref = pair(fp32_dir, models, "target")
    fc, fc_ref = pair(fp32_dir, models, "eagle3_fc")
    head, head_ref = pair(fp32_dir, models, "eagle3")
    prompt = torch.tensor([[5, 17, 42, 8, 99, 3]])
    n = prompt.shape[1]
    taps = target_ref.run(**step_inputs(prompt))["hidden_taps"].clone()
    target.run(**step_inputs(prompt))

    hidden_ref = fc_ref.run(hidden_taps=taps)["hidden_states"]
    check(fc.run(hidden_taps=taps), {"hidden_states": hidden_ref})

    shifted = torch.cat([prompt[:, 1:], torch.tensor([[77]])], dim=1)      # token t+1 pairs with feature t
    feed = {**step_inputs(shifted, rows=torch.tensor([[n - 1]])), "hidden_states": hidden_ref}
    out, want = head.run(**feed), head_ref.run(**feed)
    check(out, want)
    for j in range(3):
        token = want["logits"][:, -1].argmax(-1, keepdim=True)
        feed = {**step_inputs(token, start=n + j), "hidden_states": want["hidden_out"][:, -1:].clone()}
        out, want = head.run(**feed), head_ref.run(**feed)
        check(out, want)
    check_kv(head, head_ref, n + 3)


def test_eagle3_tree_level_mask_reaches_before_write_index(fp32_dir, models):
    """The eagle3 graph's mask_keys axis (contract v2): a tree level of 2 nodes written after a level of
    3, its tree_mask [2, 5] covering both levels, matches the reference module; the exported graph
    takes a mask wider than its tokens."""
    head, head_ref = pair(fp32_dir, models, "eagle3")
    prompt = torch.tensor([[5, 17, 42, 8, 99, 3]])
    n = prompt.shape[1]
    hidden = torch.randn(1, n, models["eagle3"].cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for e in (head, head_ref):
        e.run(**{**step_inputs(prompt), "hidden_states": hidden})
    level1 = {**step_inputs(torch.tensor([[7, 9, 13]]), start=n, positions=torch.full((1, 3), n),
                            tree_mask=torch.eye(3, dtype=torch.bool)[None]), "hidden_states": hidden[:, -3:]}
    check(head.run(**level1), head_ref.run(**level1))
    mask = torch.tensor([[[True, False, False, True, False], [False, False, True, False, True]]])
    level2 = {**step_inputs(torch.tensor([[21, 4]]), start=n + 3, positions=torch.full((1, 2), n + 1),
                            tree_mask=mask), "hidden_states": hidden[:, :2]}
    check(head.run(**level2), head_ref.run(**level2))
    check_kv(head, head_ref, n + 5)


def test_kv_update_is_in_place(fp32_dir, capfd):
    """With past and present bound to one buffer ORT's TensorScatter skips its past->present copy
    (it logs a warning whenever it has to copy; warnings are enabled here)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 1
    engine = ort.load(fp32_dir, "target", session_options=options)
    engine.new_kv()
    capfd.readouterr()
    engine.run(**step_inputs(torch.tensor([[1, 2, 3]])))
    engine.run(**step_inputs(torch.tensor([[4]]), start=3))
    assert "in-place optimization not activated" not in capfd.readouterr().err


def test_fp16_graph_runs_on_cpu(tiny_target, tmp_path_factory):
    """fp16 is the low precision ORT's CPU provider can run (bf16 cannot): logits within 0.05 of
    the fp16 torch reference (observed ~0.015; the two differ in accumulation order)."""
    out = tmp_path_factory.getbasetemp() / "tiny-fp16"
    if not (out / "manifest.json").is_file():
        export_engine_dir(ExportRequest(model=str(tiny_target), out=out, dtype="fp16", max_seq_len=MAX_SEQ))
    engine = ort.load(out, "target")
    target = ck.load_qwen3(tiny_target, MAX_SEQ, TAPS, torch.float16)
    reference = TorchEngine(target, graph_spec("target", 4), engine.kv_shape, torch.float16, "cpu")
    engine.new_kv(), reference.new_kv()
    for feed in (step_inputs(torch.tensor([[5, 17, 42, 8, 99]])), step_inputs(torch.tensor([[7]]), start=5)):
        got, want = engine.run(**feed), reference.run(**feed)
        assert got["logits"].dtype == torch.float16
        assert (got["logits"].float() - want["logits"].float()).abs().max().item() <= 0.05


def test_draft_model_graph(fp32_dir, models):
    engine, reference = pair(fp32_dir, models, "draft")
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    check(engine.run(**step_inputs(prompt)), reference.run(**step_inputs(prompt)))
    feed = step_inputs(torch.tensor([[6]]), start=5)
    check(engine.run(**feed), reference.run(**feed))


def test_bad_calls_are_engine_errors(fp32_dir):
    engine = ort.load(fp32_dir, "target", max_tokens=8)
    feed = step_inputs(torch.tensor([[1, 2]]))
    with pytest.raises(EngineError, match="bind KV"):
        engine.run(**feed)
    engine.new_kv()
    with pytest.raises(EngineError, match="expected inputs"):
        engine.run(**{k: v for k, v in feed.items() if k != "tree_mask"})
    with pytest.raises(EngineError, match="int64"):
        engine.run(**{**feed, "input_ids": feed["input_ids"].to(torch.int32)})
    with pytest.raises(EngineError, match="max_tokens=8"):
        engine.run(**step_inputs(torch.arange(9)[None]))
    with pytest.raises(EngineError, match="KV buffer"):
        engine.bind_kv([torch.zeros(1, 2, 8, 16)] * 8)
    with pytest.raises(EngineError, match="no 'nope' graph"):
        ort.load(fp32_dir, "nope")
    engine.close()


def test_kv_shape_from_manifest(fp32_dir):
    engine = ort.load(fp32_dir, "eagle3")
    assert engine.kv_shape == KVShape(layers=1, kv_heads=2, head_dim=16, max_seq_len=MAX_SEQ, batch=1)
    assert ort.load(fp32_dir, "eagle3_fc").kv_shape is None

