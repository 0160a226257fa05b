"""ONNX Runtime on CUDA (onnxruntime-gpu, the ``gpu`` extra): the exported graphs against the torch
backend on the same GPU, with and without ORT's own CUDA graphs, bf16 through ``xcompile diff``, and
no stream of provider warnings. Tests marked ``gpu`` skip without a CUDA device, and also (saying so)
where onnxruntime has no CUDA provider. The CPU-side checks run everywhere.

Tolerances: fp32 logits within 1e-2 of the torch reference (ORT's CUDA provider may use TF32
matmuls), greedy tokens equal; bf16 through ``xcompile diff``'s own bf16 tolerances."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import exported_dir, step_inputs

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.registry import DEFAULT_GAMMA, DrafterSpec, make_drafter
from xcompile.runtime.engines import ort
from xcompile.runtime.engines.load import open_engine_dir

MAX_SEQ = 64


def _has_cuda_provider() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


needs_ort_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _has_cuda_provider(),
                                    reason="needs a CUDA GPU and onnxruntime-gpu (pip install 'xcompile[gpu]')")


@pytest.fixture(scope="session")
def bf16_cuda_dir(tiny_target, tiny_eagle3, tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, "tiny-bf16-ortcuda", model=str(tiny_target), eagle3=str(tiny_eagle3), dtype="bf16")


# --------------------------------------------------------------------------------------------
# everywhere


def test_cuda_graphs_need_cuda(fp32_dir):
    with pytest.raises(EngineError, match="CUDA graphs need device='cuda'"):
        ort.load(fp32_dir, "target", "cpu", cuda_graphs=True)


def test_cuda_library_dirs_are_the_nvidia_wheels_lib_folders(tmp_path, monkeypatch):
    for pkg in ("cu13", "cudnn"):
        (tmp_path / "nvidia" / pkg / "lib").mkdir(parents=True)
    (tmp_path / "nvidia" / "cudnn" / "include").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    found = ort.cuda_library_dirs()
    assert tmp_path / "nvidia" / "cu13" / "lib" in found and tmp_path / "nvidia" / "cudnn" / "lib" in found
    assert not any(p.name == "include" for p in found)


# --------------------------------------------------------------------------------------------
# on a GPU with onnxruntime-gpu


@pytest.mark.gpu
@needs_ort_cuda
def test_ort_cuda_steps_match_the_torch_backend(fp32_dir):
    ours = open_engine_dir(fp32_dir, "ort", "cuda", cuda_graphs=False)
    ref = open_engine_dir(fp32_dir, "torch", "cuda")
    try:
        e, r = ours.engines["target"], ref.engines["target"]
        e.new_kv(), r.new_kv()
        prompt = torch.tensor([[5, 17, 42, 8, 99, 3, 250]], device="cuda")
        for start, ids in ((0, prompt), (7, prompt[:, -1:]), (8, prompt[:, :3])):     # prefill, decode, verify 3
            got, want = e.run(**step_inputs(ids, start)), r.run(**step_inputs(ids, start))
            assert (got["logits"] - want["logits"]).abs().max() < 1e-2
            assert torch.equal(got["logits"].argmax(-1), want["logits"].argmax(-1))
        assert ours.engines["target"].session.get_providers()[0] == "CUDAExecutionProvider"
    finally:
        ours.close(), ref.close()


@pytest.mark.gpu
@needs_ort_cuda
def test_ort_cuda_outputs_are_ordered_with_the_callers_stream(fp32_dir):
    """ORT runs on a stream of the engine's own; a run waits for the caller's stream (its inputs) and
    makes the caller's stream wait for it (its outputs), from the default stream and from a side
    stream alike. Inputs are produced and outputs consumed on the caller's stream with no sync between,
    after queueing a long kernel first, so any missing wait reads stale or unfinished buffers."""
    ours = open_engine_dir(fp32_dir, "ort", "cuda", cuda_graphs=False)
    ref = open_engine_dir(fp32_dir, "torch", "cuda")
    try:
        e, r = ours.engines["target"], ref.engines["target"]
        prompt = torch.tensor([[5, 17, 42, 8, 99, 3, 250]], device="cuda")
        r.new_kv()
        want = r.run(**step_inputs(prompt))["logits"].clone()
        busy = torch.randn(4096, 4096, device="cuda")
        for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
            with torch.cuda.stream(stream):
                e.new_kv()
                for _ in range(20):
                    busy = busy @ busy / 64                                     # the caller's stream is busy
                ids = prompt + 0                                                # written on the caller's stream
                got = e.run(**step_inputs(ids))["logits"] * 1                   # read on the caller's stream
            torch.cuda.synchronize()
            assert (got - want).abs().max() < 1e-2
    finally:
        ours.close(), ref.close()


@pytest.mark.gpu
@needs_ort_cuda
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "ort-cuda-graphs"])
@pytest.mark.parametrize("drafter, gamma", [("none", None), ("eagle3", 4), ("draft-model", 3)])
def test_ort_cuda_greedy_tokens_equal_the_torch_backend(fp32_dir, cuda_graphs, drafter, gamma):
    prompt = [5, 17, 42, 8, 99, 3, 250, 11]
    tokens = {}
    for backend in ("ort", "torch"):
        es = open_engine_dir(fp32_dir, backend, "cuda", cuda_graphs=cuda_graphs)
        try:
            spec = DrafterSpec(drafter, gamma or DEFAULT_GAMMA)
            gen = Generator(es.engines["target"], make_drafter(es, spec), [], MAX_SEQ,
                            options=LoopOptions(cuda_graphs=cuda_graphs))
            tokens[backend] = gen.generate(prompt, 24).tokens
            if backend == "ort" and cuda_graphs:
                fallback = {g: e.graph_fallback for g, e in es.engines.items() if e.graph_fallback}
        finally:
            es.close()
    assert tokens["ort"] == tokens["torch"]
    if cuda_graphs and fallback:
        pytest.skip(f"tokens equal, but ONNX Runtime ran without its CUDA graphs: {fallback}")


@pytest.mark.gpu
@needs_ort_cuda
def test_bf16_graphs_pass_diff_on_ort_cuda(bf16_cuda_dir):
    from xcompile.compile.diff import DiffOptions, run_diff

    report = run_diff(bf16_cuda_dir, DiffOptions(backend="ort", device="cuda"))
    assert report.passed, report.table()
    assert all(r.top1 == 1.0 for r in report.results if r.top1 is not None), report.table()


@pytest.mark.gpu
@needs_ort_cuda
def test_no_stream_of_provider_warnings(bf16_cuda_dir):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    xrun = [sys.executable, "-c", "from xcompile.runtime.cli.xrun import main; main()"]
    r = subprocess.run([*xrun, "generate", str(bf16_cuda_dir), "--backend", "ort",
                        "--device", "cuda", "--prompt-ids", "5,17,42", "--max-new-tokens", "8", "--drafter", "eagle3"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    noise = [line for line in r.stderr.splitlines() if "onnxruntime" in line.lower() or line.startswith("[W:")]
    assert not noise, noise
