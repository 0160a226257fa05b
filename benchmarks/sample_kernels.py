"""Where a sampled token's time goes: the sampling kernels (runtime/decoding/kernels/sample.py) and the torch
sampler on one row of a Qwen3 vocabulary, each call replayed from a CUDA graph. Not a test: it times a GPU.

    python benchmarks/sample_kernels.py [--vocab 151936] [--top-k 20] [--top-p 0.95] [--temperature 0.6]

Rows timed, each the median µs of one call over --calls replays:

    kernels, no tie     sample.sample on fp32 logits drawn from N(0, 3): the k-th and (k + 1)-th values differ,
                        so the rows launch draws among the candidates
    kernels, tie        the same logits rounded to bf16's steps at the top and the (k + 1)-th set to the k-th: the
                        rows launch counts the tied tokens from the blocks (none is open: no column is read again)
    kernels, tie, blocks open   integer logits and top-p 1: every block's last candidate ties the k-th and the
                        tied tokens are kept, so the draw reads every block again (the worst case)
    blocks launch       the first launch alone (each column block's K1 largest), tie logits
    torch sampler       Sampler.draw(Sampler.warp(x)), the ops the kernels replace
    argmax              greedy's pick, for scale
"""

from __future__ import annotations

import argparse
import statistics

import torch


def timed(fn, calls: int) -> float:
    """Median µs of one ``fn()`` replayed from a CUDA graph (warmed and captured first)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(calls):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    from xcompile.runtime.decoding.kernels import sample
    from xcompile.runtime.decoding.sampling import Sampler, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sample_kernels.py: no CUDA device is visible here (it times CUDA graphs)")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    plain = torch.randn(1, args.vocab, device=dev, generator=g) * 3
    tied = plain.to(torch.bfloat16).float()
    top = tied[0].topk(args.top_k + 1)
    tied[0, top.indices[-1]] = top.values[-2]                   # the (k + 1)-th ties the k-th
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=0)
    fused, torch_sampler = Sampler(dev, fused=True), Sampler(dev, fused=False)
    fused.reset(params)
    torch_sampler.reset(params)
    c = sample.Candidates.of(args.top_k, args.vocab)                 # what sample.sample launches
    pv, pi, pn, _ = sample._SCRATCH.get(1, c.nb, c.kp2, dev)
    # the worst case: integer logits (every block's last candidate ties the k-th) and no top-p cut, so the tied
    # tokens are kept and every block is read again
    integer = (plain * 2).round()
    wide = Sampler(dev, fused=True)
    wide.reset(SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=1.0, seed=0))

    def blocks():
        sample._sample_blocks_kernel[(1, c.nb)](tied, fused.temperature, pv, pi, pn, tied, args.vocab, c.nb, 1,
                                                tied.stride(0), tied.stride(0), K1=c.k1, KP2=c.kp2, BLOCK=c.block,
                                                HAS_Q=False, PDL=sample.pdl(), num_warps=8, **sample.launch())

    rows = [("kernels, no tie", lambda: sample.sample(plain, fused)),
            ("kernels, tie", lambda: sample.sample(tied, fused)),
            ("kernels, tie, blocks open", lambda: sample.sample(integer, wide)),
            ("blocks launch (tie logits)", blocks),
            ("torch sampler", lambda: torch_sampler.draw(torch_sampler.warp(tied))),
            ("argmax", lambda: tied.argmax(-1))]
    print(f"vocab {args.vocab}, top-k {args.top_k}, top-p {args.top_p}, T {args.temperature}; "
          f"{torch.cuda.get_device_name(dev)}; median µs of one graphed call over {args.calls}")
    for name, fn in rows:
        print(f"{name:28s} {timed(fn, args.calls):8.1f}")


if __name__ == "__main__":
    main()
