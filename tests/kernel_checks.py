"""What the kernel tests share (tests/runtime/engines/kernels/): the device, tolerances and random inputs.

Tolerances: fp32 agrees to float rounding (1e-5 relative); bf16 to a few roundings (2e-2 relative, the
1e-3..1e-2 band of bf16 operands plus reduction-order flips of single roundings)."""

from __future__ import annotations

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
