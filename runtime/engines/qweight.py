"""Weight-only quantized linear weights in one canonical form, whatever layout a checkpoint stored them in.

Every quantized layout xcompile reads (compile/quantization.py: FP8 blocks, AutoAWQ GEMM, compressed-tensors
float and pack-quantized) comes down to one of two kinds, with one scale (and one zero point) per block of
``block = (rows, cols)`` of the weight [N, K], partial blocks at the bottom and right edges:

    fp8    codes float8_e4m3fn [N, K]                          w = codes * scale
    int4   codes uint8 [N, K] holding 0..15, zero uint8 0..15  w = (codes - zero) * scale   (symmetric: zero 8)

Scales are float32 [ceil(N/rows), ceil(K/cols)] (checkpoints store fp32, bf16 or fp16: each converts
exactly). This form is what the export writes as DequantizeLinear inputs and what the fast kernels repack;
``dequantize`` is the reference all of them are tested against. The codes stay unpacked here (one byte per
int4 code) because each consumer packs them its own way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8, INT4 = "fp8", "int4"
KINDS = (FP8, INT4)
E4M3_MAX = 448.0        # the largest finite float8 e4m3fn value


@dataclass(frozen=True)
class QWeight:
    """One linear weight [N, K], quantized (see the module docstring)."""

    kind: str                       # FP8 or INT4
    codes: torch.Tensor             # [N, K]: float8_e4m3fn (FP8) or uint8 0..15 (INT4)
    scale: torch.Tensor             # float32 [ceil(N/rows), ceil(K/cols)]
    block: tuple[int, int]          # (rows, cols) of the weight sharing one scale, each >= 1
    zero: torch.Tensor | None = None    # INT4: uint8 0..15 shaped like scale; None for FP8

    def __post_init__(self):
        n, k = self.codes.shape
        rows, cols = self.block
        grid = (-(-n // rows), -(-k // cols))
        assert self.kind in KINDS, self.kind
        assert tuple(self.scale.shape) == grid and self.scale.dtype == torch.float32, (self.scale.shape, grid)
        if self.kind == FP8:
            assert self.codes.dtype == torch.float8_e4m3fn and self.zero is None
        else:
            assert self.codes.dtype == torch.uint8 and self.zero is not None and tuple(self.zero.shape) == grid

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def bits(self) -> int:
        return 8 if self.kind == FP8 else 4

    def expand(self, grid: torch.Tensor) -> torch.Tensor:
        """Per-block values [ceil(N/rows), ceil(K/cols)] spread over [N, K]."""
        n, k = self.shape
        rows, cols = self.block
        return grid.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]

    def dequantize(self) -> torch.Tensor:
        """The weight in float32: exact for e4m3 or int4 codes times scales that were bf16 or fp16."""
        codes = self.codes.float()
        if self.zero is not None:
            codes = codes - self.expand(self.zero.float())
        return codes * self.expand(self.scale)

    def to(self, device: torch.device | str) -> QWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QWeight(self.kind, move(self.codes), move(self.scale), self.block, move(self.zero))

    def nbytes(self) -> int:
        """Bytes a kernel reads for this weight: its codes at ``bits`` each, its scales and zero points."""
        extra = self.scale.numel() * 4 + (self.zero.numel() if self.zero is not None else 0)
        return self.codes.numel() * self.bits // 8 + extra


def quantize(weight: torch.Tensor, kind: str, block: tuple[int, int]) -> QWeight:
    """Round-to-nearest quantization of ``weight`` [N, K] (synthetic weights for benchmarks, the kernels' tests;
    ``xcompile quantize`` calibrates with a library instead). FP8: scale = amax / 448 per block; INT4:
    asymmetric, scale = (max - min) / 15 and zero = round(-min / scale) per block."""
    n, k = weight.shape
    rows, cols = block
    w = weight.float()
    pad = torch.zeros(-(-n // rows) * rows, -(-k // cols) * cols, device=w.device)
    pad[:n, :k] = w
    tiles = pad.reshape(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols).transpose(1, 2)
    view = lambda t: t.transpose(1, 2).reshape(pad.shape)[:n, :k]  # noqa: E731
    if kind == FP8:
        amax = tiles.abs().amax((-2, -1)).clamp_min(1e-12)
        scale = amax / E4M3_MAX
        codes = view(tiles / scale[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return QWeight(FP8, codes.contiguous(), scale.contiguous(), block)
    if kind != INT4:
        raise ValueError(f"unknown quantization kind {kind!r}; one of {KINDS}")
    lo, hi = tiles.amin((-2, -1)).clamp_max(0), tiles.amax((-2, -1)).clamp_min(0)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    zero = (-lo / scale).round().clamp(0, 15)
    codes = (tiles / scale[..., None, None] + zero[..., None, None]).round().clamp(0, 15)
    return QWeight(INT4, view(codes).to(torch.uint8).contiguous(), scale.contiguous(), block,
                   zero.to(torch.uint8).contiguous())
