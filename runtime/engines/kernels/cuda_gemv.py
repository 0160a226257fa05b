"""One-row bf16 projections in CUDA C++ (gemv.cu): the same operands, epilogues and RMSNorm rounding (its
1/rms applied to the sums) as gemv.py's Triton GEMV, the weight rows streamed into shared memory by the copy engine (cp.async.bulk)
a few stages ahead, so the bytes in flight are not bounded by the registers (gemv.cu's header). The same
library carries qgemv.cu, the one-row quantized kernel (cuda_qgemv.py).

Built when first asked for (the fast engines ask when they are made, outside any graph capture) with the
CUDA toolkit's ``nvcc`` (``$CUDA_HOME/bin`` or PATH) for the device's architecture (sm_90 or newer: the
bulk copies are Hopper's), into ``$XCOMPILE_CACHE/cuda`` (else ``~/.cache/xcompile/cuda``) keyed by the
sources, the architecture, the flags and nvcc's version, and called through ctypes on torch's current
stream (so it records into CUDA graphs like any launch); one probe launch of gemv.cu's kernel at load checks
that the device runs the build. Without nvcc, on an older GPU, if the build or the probe fails or a launch is refused (a warning says
why), one-row calls keep the Triton GEMV: the tile tables' ``cuda`` only says
which shapes take this kernel where it runs (gate/up: faster there inside the graphed step; qkv was faster
at context 128 and slower at 4096, o and down slower at both).
Neither CI nor any CPU runs it: its tests are marked ``gpu``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.common.gpu import interpreted
from xcompile.runtime.common.logs import logger
from xcompile.runtime.engines.kernels.config import DEFAULT, CudaGemv, KernelConfig

SOURCES = [Path(__file__).with_name(name) for name in ("common.cuh", "gemv.cu", "qgemv.cu")]
log = logger(__name__)


SMEM_LIMIT = 227 * 1024          # shared memory a block may take on sm_90 (the stages, their barriers, the sums)

def check(tile: CudaGemv, n_out: int, k: int, gated: bool = False, smem_limit: int = SMEM_LIMIT) -> CudaGemv:
    """``tile`` (any sequence of CudaGemv's fields) if gemv.cu has a kernel for it at this shape; else EngineError."""
    tile = CudaGemv(*tile)
    need = smem_bytes(tile, 2 if gated else 1, k)
    if (tile.cols not in (1, 2) or not 1 <= tile.warps <= 32 or not 2 <= tile.stages <= 8 or tile.per_sm < 0
            or k > 4096 * tile.warps or need > smem_limit):
        raise EngineError(f"CUDA GEMV tile {tuple(tile)} for ({n_out}, {k}): cols must be 1 or 2, warps 1-32, stages "
                          f"2-8, per_sm >= 0, K at most 4096 x warps and the stages ({need} bytes) within "
                          f"{smem_limit} bytes of shared memory; fix the tile tables' cuda entry")
    return tile


def smem_bytes(tile: CudaGemv, rows_per_column: int, k: int) -> int:
    """Shared memory of a launch (gemv.cu's xc_gemv): the stages, their mbarriers, the warps' sums."""
    rows = rows_per_column * tile.cols
    return tile.stages * rows * k * 2 + tile.stages * 8 + (tile.stages * tile.warps * rows + tile.warps) * 4


def nvcc() -> str | None:
    """The nvcc to build with: $CUDA_HOME/bin/nvcc, else the one on PATH, else None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    return Path(os.environ.get("XCOMPILE_CACHE") or Path.home() / ".cache" / "xcompile") / "cuda"


FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC"]


def build(arch: str, compiler: str, out_dir: Path | None = None) -> Path:
    """gemv.cu and qgemv.cu built for ``arch`` (e.g. 'sm_90') into the cache, unless a build of these sources, arch, flags
    and nvcc is there; the library's path. Written under a temporary name and renamed into place, so a
    concurrent or interrupted build never leaves a partial library. RuntimeError with nvcc's error lines."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = FLAGS + [f"-arch={arch}"]
    env = [os.environ.get(v, "") for v in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")]
    text = "\0".join([*flags, *env, version]).encode()
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + text).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"libxcgemv-{arch}-{key}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        units = [str(p) for p in SOURCES if p.suffix == ".cu"]
        done = subprocess.run([compiler, *flags, "-o", tmp, *units], capture_output=True, text=True)
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines()
            errors = [line.strip() for line in lines if "error" in line.lower()][:3] or lines[-3:]
            raise RuntimeError(f"nvcc failed on {', '.join(units)}: {' / '.join(errors)}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load(path: Path) -> ctypes.CDLL:
    """The built library with xc_gemv's and xc_qgemv's signatures set."""
    lib = ctypes.CDLL(str(path))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.xc_gemv.argtypes = [p, p, p, p, p, p, i, i, f, i, i, i, i, i, i, i, i, i, i, p]
    lib.xc_qgemv.argtypes = [p] * 8 + [i] * 6 + [f] + [i] * 11 + [p]
    lib.xc_gemv.restype = lib.xc_qgemv.restype = i
    return lib


def probe(lib: ctypes.CDLL, index: int) -> int:
    """One launch of the smallest tile on device ``index`` (ones [1, 8] times ones [2, 8]), waited for and its
    result checked: the cudaError_t (0: it ran and gave 8, 8; -2: it ran and gave something else). A driver
    older than the runtime nvcc linked in, or a build the device cannot run, refuses this launch here, at load,
    and not inside a captured step."""
    dev = torch.device("cuda", index)
    x, w = (torch.ones(n, 8, dtype=torch.bfloat16, device=dev) for n in (1, 2))
    y = torch.zeros(1, 2, dtype=torch.bfloat16, device=dev)
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        err = lib.xc_gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), None, None, None, 2, 8, 1e-6, 1, 1, 2, 0,
                          0, 0, 0, 0, 0, 0, stream.cuda_stream)
        if err:
            return err
        stream.synchronize()
    return 0 if torch.equal(y, torch.full_like(y, 8)) else -2


@functools.cache
def library(index: int) -> ctypes.CDLL | None:
    """gemv.cu built, loaded and probed (``probe``; not while a CUDA graph is being captured) for CUDA device
    ``index``, or None (no nvcc, a GPU older than sm_90, the build failed or the probe did not run: said once)."""
    compiler = nvcc()
    major, minor = torch.cuda.get_device_capability(index)
    if compiler is None or major < 9:
        why = "no nvcc (CUDA toolkit) found" if compiler is None else f"it needs sm_90+, not sm_{major}{minor}"
        log.info("CUDA GEMV not used (%s): one-row projections stay on the Triton GEMV", why)
        return None
    try:
        lib = load(build(f"sm_{major}{minor}", compiler))
    except (OSError, RuntimeError, AttributeError, subprocess.CalledProcessError) as e:
        log.warning("CUDA GEMV not built (%s); one-row projections stay on the Triton GEMV", e)
        return None
    err = 0 if torch.cuda.is_current_stream_capturing() else probe(lib, index)
    if err:
        why = "a wrong result" if err == -2 else f"cudaError_t {err}; a driver older than nvcc's runtime?"
        log.warning("CUDA GEMV built but its probe launch failed (%s); one-row projections stay on the Triton "
                    "GEMV", why)
        return None
    return lib


@functools.cache
def smem_limit(index: int) -> int:
    """Shared memory a block of device ``index`` may opt into."""
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", SMEM_LIMIT)


REFUSED: set[tuple[int, int, CudaGemv]] = set()     # (N_OUT, K, tile) whose launch the device refused


def runnable(x: torch.Tensor, cfg: KernelConfig, bf16: tuple, aligned: tuple) -> bool:
    """Whether a one-row call may take a CUDA C++ kernel of this library: ``cfg.cuda_gemv`` on, x on a CUDA
    device (not Triton's interpreter), the tensors of ``bf16`` bf16 and those of ``aligned`` (read in 16-byte
    chunks) 16-byte aligned; None entries are skipped."""
    if not cfg.cuda_gemv or x.device.type != "cuda" or interpreted():
        return False
    return (all(t is None or t.dtype == torch.bfloat16 for t in bf16)
            and all(t is None or t.data_ptr() % 16 == 0 for t in aligned))


def tile_for(x: torch.Tensor, w: torch.Tensor, n_out: int, k: int, norm: torch.Tensor | None,
             *tensors: torch.Tensor | None, cfg: KernelConfig = DEFAULT) -> CudaGemv | None:
    """The CUDA GEMV's tile for this one-row call, or None (``cfg.cuda_gemv`` off, the shape has none, K not a
    multiple of 8, not bf16, no CUDA device or no library, x, w or norm not 16-byte aligned, more shared
    memory than the device has, a launch of it refused before)."""
    tile = cfg.tiles.cuda.get((n_out, k))
    if tile is None or k % 8 or not runnable(x, cfg, bf16=(x, w, norm, *tensors), aligned=(x, w, norm)):
        return None
    index = x.device.index or 0
    try:
        tile = check(tile, n_out, k, gated=w.shape[0] == 2 * n_out, smem_limit=smem_limit(index))
    except EngineError:
        return None                                    # a smaller device than the table's: Triton
    if (n_out, k, tile) in REFUSED:
        return None
    return tile if library(index) is not None else None


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: CudaGemv, *, norm: torch.Tensor | None,
         eps: float, gated: bool, residual: torch.Tensor | None, extra_out: torch.Tensor | None,
         cfg: KernelConfig = DEFAULT) -> torch.Tensor | None:
    """linear() of one row (its docstring) on gemv.cu's kernel: x [1, K] -> out [1, N]; None if the device
    refused the launch (nothing was enqueued; warned once, and the shape stays on Triton from then on)."""
    n_out, k = out.shape[1], x.shape[1]
    lib = library(x.device.index or 0)
    ptrs = [t.data_ptr() if t is not None else None for t in (x, w, out, residual, norm, extra_out)]
    # early: the next kernel may launch right after this one's PDL wait, as the Triton kernels do
    flags = (norm is not None, gated, residual is not None, extra_out is not None, True, cfg.pdl_on,
             torch.cuda.current_stream(x.device).cuda_stream)
    with torch.cuda.device(x.device):                  # the launch goes to the current device
        err = lib.xc_gemv(*ptrs, n_out, k, eps, tile.cols, tile.warps, tile.stages, tile.per_sm, *flags)
    if err:
        reason = "no kernel for this tile" if err == -1 else f"cudaError_t {err}"
        log.warning("CUDA GEMV launch for (%d, %d) with tile %s refused (%s); that shape stays on the Triton GEMV",
                    n_out, k, tuple(tile), reason)
        REFUSED.add((n_out, k, tile))
        return None
    return out
