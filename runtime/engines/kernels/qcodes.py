"""What a quantized code is worth (runtime/engines/qweight.py's codes as the kernels load them): float8 e4m3
bytes and 4-bit integers turned into numbers, exactly, by the cheapest instructions found for each use.

The tile kernel (qlinear.py) feeds the codes to the tensor cores in bf16, four codes an instruction group
from a 32-bit register (PTX): an e4m3 byte's exponent and mantissa shifted into bf16's fields is the value
times 2^-120 (subnormals too, as bf16 subnormals), and one bf16x2 multiply by 2^120 makes it exact; a 4-bit
code q placed in the low mantissa bits of 128.0 is 128 + q, minus 128 + z is q - z. Each takes about 3 (e4m3)
or 1.5 (INT4) integer or bf16x2 instructions a code (fma.rn.bf16x2: sm_80 and later), where converting through
fp16 and fp32 takes a quarter-rate float-to-float conversion a code. e4m3's NaN bytes (0x7F, 0xFF) would read as 480: the loaders
refuse NaN codes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 4 e4m3 bytes (b0..b3 of $4) -> bf16 pairs (b0, b1) in $0 and (b2, b3) in $1: bytes reordered b0 b2 b1 b3,
# then bytes 0 and 2 of the word shifted 4 up (signs 8 up), bytes 1 and 3 shifted 4 down (signs in place)
_E4M3_BF16 = tl.constexpr("""{
.reg .b32 w, e, o, s, m;
prmt.b32 w, $2, 0, 0x3120;
shl.b32 e, w, 4;
and.b32 e, e, 0x07F007F0;
shl.b32 s, w, 8;
and.b32 s, s, 0x80008000;
or.b32 e, e, s;
shr.u32 o, w, 4;
and.b32 o, o, 0x07F007F0;
and.b32 s, w, 0x80008000;
or.b32 o, o, s;
mov.b32 m, 0x7B807B80;
mov.b32 s, 0x80008000;
fma.rn.bf16x2 $0, e, m, s;
fma.rn.bf16x2 $1, o, m, s;
}""")

# 4 bytes of two 4-bit codes each ($4) and -(128 + their row's zero point) as 4 bf16 ($5, $6) -> q - z of the
# low nibbles as 4 bf16 ($0, $1) and of the high ones ($2, $3): 128 + q by a bitwise or, 1 * that - (128 + z)
_U4_BF16 = tl.constexpr("""{
.reg .b32 a, b, m;
mov.b32 m, 0x43004300;
prmt.b32 a, $4, 0, 0x4140;
prmt.b32 b, $4, 0, 0x4342;
lop3.b32 $0, a, 0x000F000F, m, 0xEA;
lop3.b32 $1, b, 0x000F000F, m, 0xEA;
shr.u32 a, a, 4;
shr.u32 b, b, 4;
lop3.b32 $2, a, 0x000F000F, m, 0xEA;
lop3.b32 $3, b, 0x000F000F, m, 0xEA;
mov.b32 m, 0x3F803F80;
fma.rn.bf16x2 $0, $0, m, $5;
fma.rn.bf16x2 $1, $1, m, $6;
fma.rn.bf16x2 $2, $2, m, $5;
fma.rn.bf16x2 $3, $3, m, $6;
}""")


@triton.jit
def _e4m3(b, NATIVE: tl.constexpr):
    """float8 e4m3 bits (uint8) -> their fp32 values."""
    if NATIVE:
        w = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:       # the interpreter has no float8: e4m3 bits -> fp16 bits (exponent bias 7 -> 15), times 2^8
        h = ((b & 0x80).to(tl.uint16) << 8) | ((b & 0x7F).to(tl.uint16) << 7)
        w = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return w


@triton.jit
def _to_e4m3(x):
    """fp32 values -> float8 e4m3 bytes (uint8), rounded to nearest even as torch converts, values past +-448
    saturated: an FP8 KV cache's write. Integer ops only (the interpreter has no float8), so every device and
    torch give the same bytes."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # |x| >= 2^-6: the exponent rebiased 127 -> 7 and 23 mantissa bits rounded to 3 (ties to even; a carry
    # steps the exponent)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # below: a subnormal m x 2^-9, m = |x| x 2^9 rounded to nearest even (8 is the first normal's code)
    t = a.to(tl.float32, bitcast=True) * 512.0
    f = tl.floor(t)
    fi = f.to(tl.int32)
    m = fi + ((t - f > 0.5) | ((t - f == 0.5) & ((fi & 1) == 1))).to(tl.int32)
    return (tl.where(t < 8.0, m, normal) | sign).to(tl.uint8)


@triton.jit
def _f(w, BIT: tl.constexpr):
    """The 4-bit codes (0..15) at bits BIT..BIT+3 of int32 words -> 1 + q / 16 in fp32: q moved into the top 4
    bits of 1.0's mantissa (two integer ops)."""
    if BIT <= 19:
        q = w << (19 - BIT)
    else:
        q = w >> (BIT - 19)
    return ((q & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _u4(q):
    """4-bit codes (integers 0..15) -> fp32 by placing them in the mantissa of 2^23 (integer ops at full rate
    where an int-to-float conversion runs at a quarter of it)."""
    return (q.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _tile_codes(b, z, DT: tl.constexpr, INT4: tl.constexpr, NATIVE: tl.constexpr):
    """A loaded codes tile (uint8 [BLOCK_N, n]) -> the values in DT (exact): FP8 the codes (twice); INT4 q - z
    of its low and of its high nibbles (z [BLOCK_N]: each row's zero point, 0..15, so q - z is an integer
    within +-15). bf16 on a GPU (NATIVE): the PTX above; else through fp32."""
    if NATIVE and DT == tl.bfloat16:
        if INT4:
            zb = tl.broadcast_to((-128.0 - z).to(tl.bfloat16)[:, None], b.shape)
            lo, hi = tl.inline_asm_elementwise(_U4_BF16, "=r,=r,=r,=r,r,r,r", [b, zb],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            lo = tl.inline_asm_elementwise(_E4M3_BF16, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
            hi = lo
    elif INT4:
        lo = (_u4(b & 0xF) - z[:, None]).to(DT)
        hi = (_u4(b >> 4) - z[:, None]).to(DT)
    else:
        lo = _e4m3(b, NATIVE).to(DT)
        hi = lo
    return lo, hi
