"""Shared test setup: tiny checkpoints (session-scoped; built once, read-only for tests) and the
hardware markers, which skip with a reason when the machine lacks what they need."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest

# Triton's interpreter computes tl.dot with numpy's matmul, whose bits depend on the sgemm kernel OpenBLAS runs:
# its Haswell / Zen kernel (what OPENBLAS_CORETYPE=Haswell, set on this workplace's machines, picks) sums an
# element otherwise at 4 rows than at 16, so the row-invariance tests (a token alone against a row of a verify
# block, the same tiles on a GPU) failed three on a 2-core AMD EPYC (2026-12-06); the SkylakeX kernel sums alike
# from 2 rows on. So it is chosen where the CPU runs AVX-512, before torch loads numpy.
_cpuinfo = Path("/proc/cpuinfo")
if _cpuinfo.exists() and " avx512f" in _cpuinfo.read_text(errors="ignore"):
    os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"

import torch  # noqa: E402

# the fused kernels (runtime/engines/kernels/) run in Triton's interpreter where no GPU is visible; it must be
# chosen before triton is first imported
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the fault tests send SIGINT to child commands, which inherit this process's disposition: a shell that
# starts the suite as a background job (`.ci/run &`) leaves SIGINT ignored, and an ignored signal stays
# ignored across exec, so the children would never see it. A handler installed here is reset to the
# default at exec instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# tests import the checkpoint writers as ``fixtures`` whatever pytest's import mode
sys.path.insert(0, str(Path(__file__).parent))

import fixtures  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    has_trt = any(importlib.util.find_spec(m) for m in ("tensorrt", "tensorrt_rtx"))
    skips = {
        "gpu": None if torch.cuda.is_available() else "needs a CUDA GPU",
        "trt": None if has_trt else "needs TensorRT or TensorRT-RTX",
        "slow": None if config.getoption("--runslow") else "slow: pass --runslow",
    }
    for item in items:
        for marker, reason in skips.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny ops: more only add contention on the 2-core CI machine.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """Tiny untied Qwen3 target (fixtures.TINY_QWEN3) with tokenizer, one safetensors file."""
    return fixtures.write_qwen3_checkpoint(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_target_sharded(tmp_path_factory) -> Path:
    """``tiny_target``'s weights split over 3 shards with model.safetensors.index.json."""
    return fixtures.write_qwen3_checkpoint(tmp_path_factory.mktemp("tiny_target_sharded"), shards=3)


@pytest.fixture(scope="session")
def tiny_target_tied(tmp_path_factory) -> Path:
    """``tiny_target`` with tie_word_embeddings (no lm_head.weight in the file), like Qwen3-0.6B..4B."""
    return fixtures.write_qwen3_checkpoint(tmp_path_factory.mktemp("tiny_target_tied"), {"tie_word_embeddings": True})


@pytest.fixture(scope="session")
def tiny_eagle3(tmp_path_factory) -> Path:
    """AngelSlim-layout EAGLE3 head for ``tiny_target`` (draft vocab fixtures.TINY_DRAFT_VOCAB)."""
    return fixtures.write_eagle3_checkpoint(tmp_path_factory.mktemp("tiny_eagle3"))


@pytest.fixture(scope="session")
def tiny_eagle3_bin(tmp_path_factory) -> Path:
    """``tiny_eagle3``'s weights as pytorch_model.bin (how the published AngelSlim heads ship)."""
    return fixtures.write_eagle3_checkpoint(tmp_path_factory.mktemp("tiny_eagle3_bin"), fmt="bin")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    """Small tied Qwen3 draft model sharing ``tiny_target``'s vocabulary and tokenizer."""
    return fixtures.write_draft_checkpoint(tmp_path_factory.mktemp("tiny_draft"))


@pytest.fixture(scope="session")
def tiny_engine_dir(tmp_path_factory, tiny_target, tiny_eagle3, tiny_draft) -> Path:
    """fp32 engine dir (ONNX graphs + manifest) of the tiny target with its EAGLE3 head and draft model."""
    from xcompile.compile.pipeline import ExportRequest, export_engine_dir

    out = tmp_path_factory.mktemp("engines") / "tiny"
    export_engine_dir(ExportRequest(model=str(tiny_target), out=out, eagle3=str(tiny_eagle3),
                                    draft_model=str(tiny_draft), dtype="fp32", max_seq_len=256))
    return out


@pytest.fixture(scope="session")
def fp32_dir(tiny_target, tiny_eagle3, tiny_draft, tmp_path_factory) -> Path:
    """The tiny target + EAGLE3 head + draft model, exported fp32 with 64 KV slots."""
    return fixtures.exported_dir(tmp_path_factory, "tiny-fp32", model=str(tiny_target), eagle3=str(tiny_eagle3),
                                 draft_model=str(tiny_draft), dtype="fp32")
