"""Decode-step attention on an H200: SDPA vs plain matmuls (compile/models/layers.py), Qwen3-8B shapes.

    python benchmarks/attention_decode.py [--max-seq-len 4352]

q [1, 32, S, 128] against a static bf16 cache [1, 8, S_max, 128] with an additive mask, for the
query counts of decode (1), chain verify (7) and tree verify (32). Prints microseconds per call
(CUDA events, median of 200 after warm-up) and per token for 36 layers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from xcompile.compile.models.layers import group_mask, matmul_attention


def time_us(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-seq-len", type=int, default=4352)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    k = torch.randn(1, 8, args.max_seq_len, 128, device=dev, dtype=dt)
    v = torch.randn_like(k)
    print(f"{'queries':>8}{'sdpa us':>10}{'matmul us':>11}{'x36 sdpa ms':>13}{'x36 matmul ms':>15}")
    for s in (1, 7, 32):
        q = torch.randn(1, 8, 4 * s, 128, device=dev, dtype=dt)           # 32 heads grouped by 4 per KV head
        visible = torch.arange(args.max_seq_len, device=dev) < args.context + s
        mask = torch.zeros(1, 1, s, args.max_seq_len, device=dev, dtype=dt).masked_fill(~visible, float("-inf"))
        mask = group_mask(mask, 4)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float())
        for name, fn in (("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
                         ("matmul", lambda: matmul_attention(q, k, v, mask))):
            err = (fn().float() - ref).norm() / ref.norm()
            assert err < 2e-2, (name, s, float(err))
        a = time_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        b = time_us(lambda: matmul_attention(q, k, v, mask))
        print(f"{s:>8}{a:>10.1f}{b:>11.1f}{36 * a / 1e3:>13.3f}{36 * b / 1e3:>15.3f}")


if __name__ == "__main__":
    main()
