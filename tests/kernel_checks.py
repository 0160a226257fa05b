"""What the kernel tests share (tests/runtime/engines/kernels/): the device, tolerances and random inputs.

Tolerances: fp32 agrees to float rounding (1e-5 relative); bf16 to a few roundings (2e-2 relative, the
1e-3..1e-2 band of bf16 operands plus reduction-order flips of single roundings)."""

from __future__ import annotations

import pytest
import torch

from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over all elements, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def randn(*shape, dtype, scale=1.0):
    return (scale * torch.randn(*shape, device=DEV)).to(dtype)


def with_tiles(**entries) -> KernelConfig:
    """The default kernel config with some tile-table entries replaced (shape -> tile)."""
    return KernelConfig(tiles=DEFAULT.tiles.replace(**entries))


def dot_rows_alike() -> bool:
    """Whether a row of numpy's float32 matmul, Triton's interpreter's tl.dot, has the same bits at 4 rows as at 16:
    OpenBLAS's kernel for the CPU decides (tests/conftest.py); on a GPU the kernel's tiles decide, alike for both."""
    if DEV == "cuda":
        return True
    import numpy as np
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 64), dtype=np.float32), rng.standard_normal((64, 64), dtype=np.float32)
    return np.array_equal(a[:4] @ b, (a @ b)[:4])


# for tests of bits across row counts (row invariance) in the interpreter
ROWS_ALIKE = pytest.mark.skipif(not dot_rows_alike(), reason="numpy's sgemm on this CPU (the interpreter's tl.dot) "
                                "sums a row otherwise at 4 rows than at 16: bits across row counts would be the "
                                "BLAS kernel's, not the Triton kernel's (tests/conftest.py)")
