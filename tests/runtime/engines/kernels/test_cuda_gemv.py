"""gemv.cu's one-row CUDA C++ projection (runtime/engines/kernels/cuda_gemv.py).

On the CPU: the tile checks, the dispatch that keeps CPU tensors on the Triton path, and the build with
nvcc (skipped where there is none) into a cache that never holds a partial library. Tests marked ``gpu``
run the kernel against the torch reference and the Triton GEMV: every flag combination, every tile,
ragged column counts, in place, inside a CUDA graph, at the Qwen3-8B shapes.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from xcompile.runtime.common.errors import EngineError  # noqa: E402
from xcompile.runtime.engines.kernels import cuda_gemv as C  # noqa: E402
from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig  # noqa: E402
from xcompile.runtime.engines.kernels.linear import linear, linear_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TILES = [C.CudaGemv(1, 4, 2), C.CudaGemv(2, 4, 3), C.CudaGemv(1, 8, 4, 1), C.CudaGemv(2, 2, 8, 2), C.CudaGemv(1, 1, 2),
         C.CudaGemv(2, 16, 2)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def randn(*shape, scale=1.0):
    return (scale * torch.randn(*shape, device=DEV)).to(torch.bfloat16)


@pytest.mark.parametrize("tile,shape", [((3, 4, 2), (64, 256)), ((1, 0, 2), (64, 256)), ((1, 33, 2), (64, 256)),
                                        ((1, 4, 1), (64, 256)), ((1, 4, 9), (64, 256)), ((1, 4, 2, -1), (64, 256)),
                                        ((1, 1, 2), (64, 4104)), ((2, 8, 8), (64, 12288))])
def test_check_rejects_tiles_without_a_kernel(tile, shape):
    """Bad cols / warps / stages / per_sm; K past 4096 a warp; more shared memory than a block may take (8
    stages of 2 x 12288 bf16 rows)."""
    with pytest.raises(EngineError, match="CUDA GEMV tile"):
        C.check(tile, *shape)


def test_check_takes_json_rows_and_counts_gated_rows():
    assert C.check([2, 8, 3], 64, 4096) == C.CudaGemv(2, 8, 3)
    down = C.CudaGemv(1, 8, 8)                        # 8 stages of one 12288-column row fit (196 KB), gated not
    assert C.check(down, 4096, 12288) == down
    with pytest.raises(EngineError, match="shared memory"):
        C.check(down, 4096, 12288, gated=True)


def test_the_shipped_tiles_pass_their_checks():
    """Every entry of the shipped tables' ``cuda`` has a kernel and fits the H200's shared memory (a bad entry
    would otherwise only show as the Triton GEMV running)."""
    assert DEFAULT.tiles.cuda
    for (n, k), tile in DEFAULT.tiles.cuda.items():
        assert C.check(tile, n, k, gated=(n, k) == (12288, 4096)) == tile


def test_cpu_tensors_and_ragged_k_stay_on_the_triton_path():
    for k in (256, 260):
        cfg = KernelConfig(tiles=DEFAULT.tiles.replace(cuda={(64, k): C.CudaGemv(1, 4, 2)}))
        x, w = torch.randn(1, k).bfloat16(), torch.randn(64, k).bfloat16()
        assert C.tile_for(x, w, 64, k, None, cfg=cfg) is None


nvcc = pytest.mark.skipif(C.nvcc() is None, reason="needs the CUDA toolkit's nvcc")


@nvcc
@pytest.mark.parametrize("err", [0, 35, -2])
def test_library_keeps_a_build_only_if_its_probe_launch_runs(err, monkeypatch, tmp_path, caplog):
    """library(): a build whose probe launch the device refuses (35: cudaErrorInsufficientDriver, a driver
    older than nvcc's runtime) or that gives a wrong result (-2) is not used, with a warning; one that runs is."""
    lib = object()
    monkeypatch.setattr(C, "nvcc", lambda: "nvcc")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(C, "build", lambda arch, compiler: tmp_path / "lib.so")
    monkeypatch.setattr(C, "load", lambda path: lib)
    monkeypatch.setattr(C, "probe", lambda got, index: err if got is lib else 0)
    C.library.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert C.library(0) is (None if err else lib)
        assert ("probe launch failed" in caplog.text) == bool(err)
        assert ("cudaError_t 35" in caplog.text) == (err == 35)
    finally:
        C.library.cache_clear()


def test_build_compiles_caches_and_loads(tmp_path):
    """Built once for sm_90 (no GPU needed to compile), then found in the cache; nothing else left there;
    the library loads and exports xc_gemv."""
    lib = C.build("sm_90", C.nvcc(), tmp_path)
    assert lib.parent == tmp_path and os.listdir(tmp_path) == [lib.name]
    mtime = lib.stat().st_mtime_ns
    assert C.build("sm_90", C.nvcc(), tmp_path) == lib and lib.stat().st_mtime_ns == mtime
    assert isinstance(C.load(lib).xc_gemv, ctypes._CFuncPtr)


def test_failed_build_leaves_nothing_and_names_the_error(tmp_path):
    """A compiler that fails as nvcc does (the error, then a summary line): RuntimeError naming the error
    line, not only the summary, and no file in the cache."""
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'gemv.cu(1): error: planted' >&2; echo 'note: context' >&2\n"
                    "echo '1 error detected in the compilation of gemv.cu.' >&2; exit 2\n")
    fake.chmod(0o755)
    out = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="error: planted"):
        C.build("sm_90", str(fake), out)
    assert os.listdir(out) == []


def test_the_cache_key_covers_the_flags(tmp_path, monkeypatch):
    """Another NVCC_APPEND_FLAGS is another library name: a stale build is never reused."""
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "while [ \"$1\" != -o ]; do shift; done; : > \"$2\"\n")
    fake.chmod(0o755)
    first = C.build("sm_90", str(fake), tmp_path / "cache")
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-lineinfo")
    second = C.build("sm_90", str(fake), tmp_path / "cache")
    assert first != second and sorted(os.listdir(tmp_path / "cache")) == sorted([first.name, second.name])


gpu_only = pytest.mark.gpu


def cuda_only(n: int, k: int, tile: C.CudaGemv, pdl: bool = True) -> KernelConfig:
    """A config that runs (n, k) on the CUDA kernel with ``tile``; fails the test if the library is not there."""
    assert C.library(0) is not None, "gemv.cu did not build (nvcc on this GPU machine?)"
    return KernelConfig(pdl=pdl, tiles=DEFAULT.tiles.replace(cuda={(n, k): tile}))


@gpu_only
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "/".join(map(str, t)))
@pytest.mark.parametrize("kind", ["plain", "norm+residual+extra", "gated", "residual in place", "norm"])
@pytest.mark.parametrize("n,k", [(83, 2048), (40, 640), (4096, 640)])
def test_cuda_gemv_matches_reference(n, k, kind, tile):
    """Every flag combination and tile at a ragged column count (a last group partly past the end), at a K
    that ends inside a step (640: 80 chunks, 2.5 warps' worth), and with many groups a block (4096 columns:
    the ring of stages reused, its parity flipped), twice (the launch leaves no state)."""
    cfg = cuda_only(n, k, tile)
    torch.manual_seed(n)
    gated = kind == "gated"
    w = randn(2 * n if gated else n, k, scale=k ** -0.5)
    x, g = randn(1, k), randn(k) + 1
    r = randn(1, n) if kind in ("norm+residual+extra", "residual in place") else None
    taps = torch.zeros(1, 3 * n + 8, dtype=torch.bfloat16, device=DEV)
    norm = g if kind in ("norm+residual+extra", "gated", "norm") else None
    extra = taps[:, 8:8 + n] if kind == "norm+residual+extra" else None
    want = linear_reference(x, w, norm=norm, gated=gated, residual=r)
    for _ in range(2):
        if kind == "residual in place":
            got = r.clone()
            linear(x, w, residual=got, out=got, cfg=cfg)
        else:
            got = linear(x, w, norm=norm, gated=gated, residual=r, extra_out=extra, cfg=cfg)
        assert rel(got, want) < 1e-2
    if extra is not None:
        assert torch.equal(extra, got) and not taps[:, :8].any() and not taps[:, 8 + n:].any()


@gpu_only
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (4096, 4096, False), (12288, 4096, True),
                                       (4096, 12288, False), (6144, 8192, False)])
@pytest.mark.parametrize("tile", [C.CudaGemv(1, 4, 4), C.CudaGemv(2, 8, 3, 1), C.CudaGemv(1, 16, 2),
                                  C.CudaGemv(2, 4, 2)],
                         ids=lambda t: "/".join(map(str, t)))
def test_cuda_gemv_at_qwen3_8b_shapes(n, k, gated, tile):
    """Accurate at the 8B (and EAGLE3 qkv) shapes with the RMSNorm prologue (and the residual where the model has
    one); close to the Triton GEMV's bits; the same bits at every tile of the same warps (the reduction depends on
    them only)."""
    torch.manual_seed(n + k)
    w = randn(2 * n if gated else n, k, scale=k ** -0.5)
    x, g, r = randn(1, k), randn(k) + 1, randn(1, n)
    args = dict(norm=g, gated=gated) if k == 4096 and n != 4096 else dict(residual=r)
    triton_out = linear(x, w, **args, cfg=KernelConfig(cuda_gemv=False))
    got = linear(x, w, **args, cfg=cuda_only(n, k, tile))
    assert rel(got, linear_reference(x, w, **args)) < 1e-2
    assert rel(got, triton_out) < 1e-2
    assert torch.equal(linear(x, w, **args, cfg=cuda_only(n, k, C.CudaGemv(1, tile.warps, 2, 1))), got)


@gpu_only
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_gemv_in_a_cuda_graph(pdl):
    """A chain of Triton and CUDA GEMVs recorded in one graph (with and without programmatic dependent
    launch): each reads the one before it, and replays give the eager results for new inputs."""
    n, k = 1024, 1024
    cfg = cuda_only(n, k, C.CudaGemv(2, 4, 2), pdl)
    torch.manual_seed(1)
    ws = [randn(n, k, scale=k ** -0.5) for _ in range(3)]
    g = randn(k) + 1
    x = randn(1, k)

    def chain():
        h = linear(x, ws[0], norm=g, cfg=cfg)          # CUDA
        r = x.clone()
        linear(h, ws[1], residual=r, out=r, cfg=cfg)   # CUDA, the residual in place
        h = linear(torch.cat([r, r]), ws[2], cfg=cfg)[:1]   # two rows: the Triton tile kernel
        return linear(h, ws[0], norm=g, cfg=cfg)       # CUDA again

    want = chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()                                        # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            out = chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    assert torch.equal(out, want)
    x.copy_(randn(1, k))
    want = chain()
    graph.replay()
    assert torch.equal(out, want)


@gpu_only
def test_the_probe_launch_runs_on_this_gpu():
    lib = C.library(0)
    assert lib is not None and C.probe(lib, 0) == 0


@gpu_only
def test_cuda_gemv_falls_back_to_triton(monkeypatch):
    """cuda_gemv off, and a launch the device refuses (once: the shape then stays on Triton), give the Triton
    GEMV's bits; an output not 16-byte aligned (written an element at a time) stays on the CUDA kernel."""
    n, k = 256, 1024
    cfg = cuda_only(n, k, C.CudaGemv(2, 4, 2))
    torch.manual_seed(5)
    w, x, g = randn(n, k, scale=k ** -0.5), randn(1, k), randn(k) + 1
    assert C.tile_for(x, w, n, k, g, cfg=cfg) is not None
    out = torch.empty(1, n + 1, dtype=torch.bfloat16, device=DEV)[:, 1:]
    assert out.data_ptr() % 16 and C.tile_for(x, w, n, k, g, out, cfg=cfg) is not None
    off = KernelConfig(cuda_gemv=False, tiles=cfg.tiles)
    assert C.tile_for(x, w, n, k, g, cfg=off) is None
    triton_out = linear(x, w, cfg=off)
    monkeypatch.setattr(C, "REFUSED", set())
    lib = C.library(0)
    monkeypatch.setattr(lib, "xc_gemv", lambda *args: 1)           # cudaErrorInvalidValue, nothing launched
    assert torch.equal(linear(x, w, cfg=cfg), triton_out)
    assert C.REFUSED == {(n, k, C.CudaGemv(2, 4, 2))} and C.tile_for(x, w, n, k, None, cfg=cfg) is None
