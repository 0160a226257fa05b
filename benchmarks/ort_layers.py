"""Where ONNX Runtime and the torch backend part on an engine dir's target graph, layer by layer.

    python benchmarks/ort_layers.py ENGINE_DIR [--device cuda] [--prompt-len 32] [--steps 4] [--against fast]

Both backends run the same steps (a prefill of random prompt tokens, then greedy decode steps fed with
the torch backend's tokens), each on its own KV buffers. After every step it prints, per layer, the
cosine and max |diff| of the K and V rows the step wrote (a layer's K/V depend on its input only, so
the first layer whose rows part is where the computation does), then the taps and the logits. A
diagnostic for `xcompile diff` failures; the cosine of two bf16 computations of one value is ~0.9999.
``--against fast`` compares ORT with the fast backend instead (fp32 attention scores, as ORT's), to
tell a reference-path rounding from an ORT fault.
"""

from __future__ import annotations

import argparse

import torch

from xcompile.runtime.decoding.drafters import causal, prompt_inputs
from xcompile.runtime.engines.load import open_engine_dir


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine_dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--against", default="torch", choices=["torch", "fast"])
    args = ap.parse_args()
    with open_engine_dir(args.engine_dir, args.against, args.device) as ref, \
            open_engine_dir(args.engine_dir, "ort", args.device, cuda_graphs=False) as ort:
        a, b = ref.engines["target"], ort.engines["target"]
        a.new_kv()
        b.new_kv()
        dev = a.device
        i64 = dict(dtype=torch.int64, device=dev)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, ref.manifest.graphs["target"].dims["vocab"], (1, args.prompt_len), generator=g).to(dev)
        feeds = [("prefill", prompt_inputs(prompt), 0, args.prompt_len)]
        pos = args.prompt_len
        for i in range(args.steps + 1):
            label, inputs, start, n = feeds[-1]
            out_a = {k: v.clone() for k, v in a.run(**inputs).items()}
            out_b = {k: v.clone() for k, v in b.run(**inputs).items()}
            print(f"== {label}: {n} tokens written at {start} ({args.against} vs ort)")
            for layer in range(len(a.kv) // 2):
                rows = slice(start, start + n)
                ka, kb = a.kv[2 * layer][:, :, rows], b.kv[2 * layer][:, :, rows]
                va, vb = a.kv[2 * layer + 1][:, :, rows], b.kv[2 * layer + 1][:, :, rows]
                print(f"  layer {layer:>2}  K cos {cos(ka, kb):.6f} max {float((ka.float() - kb.float()).abs().max()):.4g}"
                      f"   V cos {cos(va, vb):.6f} max {float((va.float() - vb.float()).abs().max()):.4g}")
            for name in out_a:
                x, y = out_a[name], out_b[name]
                print(f"  {name:<12} cos {cos(x, y):.6f} max {float((x.float() - y.float()).abs().max()):.4g}"
                      + (f"  argmax {int(x[0, -1].argmax())} / {int(y[0, -1].argmax())}" if name == "logits" else ""))
            if i == args.steps:
                break
            token = out_a["logits"][0, -1].argmax()
            inputs = dict(input_ids=token.view(1, 1), position_ids=torch.tensor([[pos]], **i64),
                          write_index=torch.tensor([pos], **i64), tree_mask=causal(1, dev),
                          logit_rows=torch.zeros(1, 1, **i64))
            feeds.append((f"decode{i + 1}", inputs, pos, 1))
            pos += 1


if __name__ == "__main__":
    main()
