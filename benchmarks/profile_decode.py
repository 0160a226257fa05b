"""Kernel-time breakdown of one CUDA-graphed decode step of a Qwen3-8B-shaped model (4 layers).

    python benchmarks/profile_decode.py [--layers 4] [--max-seq-len 4352]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

from xcompile.compile.config import KNOWN_MODELS
from xcompile.compile.models.qwen3 import Qwen3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=4352)
    args = ap.parse_args()
    cfg = dataclasses.replace(KNOWN_MODELS["qwen3-8b"].config, num_hidden_layers=args.layers)
    dev = torch.device("cuda")
    with torch.device(dev):
        m = Qwen3(cfg, args.max_seq_len).to(torch.bfloat16).eval()
    for p in m.parameters():
        p.data.normal_(0, 0.02)
    for r in (m.model.rotary,):
        from xcompile.compile.models.layers import rope_tables
        r.cos, r.sin = (t.to(dev) for t in rope_tables(cfg.head_dim, args.max_seq_len, cfg.rope_theta))
    kv = m.new_kv(device=dev)
    i64 = dict(dtype=torch.int64, device=dev)
    args_ = (torch.tensor([[7]], **i64), torch.tensor([[1024]], **i64), torch.tensor([1024], **i64),
             torch.ones(1, 1, 1, dtype=torch.bool, device=dev), torch.zeros(1, 1, **i64))
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                m(*args_, *kv)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            m(*args_, *kv)
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(50):
            g.replay()
        b.record()
        b.synchronize()
        print(f"graph replay: {a.elapsed_time(b) / 50:.3f} ms for {args.layers} layers + head")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
