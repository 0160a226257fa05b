"""What opening a Qwen3-8B-shape engine set costs on the fast backend, and what a request pays after it (issue
37, item 5), on a GPU.

    python benchmarks/open_dir.py [--model qwen3-8b] [--checkpoint DIR] [--new-tokens 256] [--json FILE]

Each figure with the device synchronised, bf16, the EAGLE3 head beside the target:
    open, synthetic     the fast backend's load (runtime/engines/load.py's _fast_load: the reference modules
                        filled from the manifest's weight source, then put on the kernels) of the manifest a
                        ``--synthetic`` export writes: weights drawn on the GPU (compile/synthetic.py)
    write checkpoint    (--checkpoint DIR without a config.json in it) that target saved to DIR as a sharded
                        safetensors checkpoint in Qwen3's HF names; an existing DIR is reused
    open, checkpoint    the load of the same manifest naming DIR as the target's source (the OS page cache holds
                        what was just written, or what an earlier run read)
    warm-up             Generator.warm_up: every prompt shape and the chain's rounds (gamma 6), greedy
    prefill 8           an 8-token request's prompt pass after the warm-up (median of 5 requests)
    prefill 16-79       the prompt pass of every length 16..79 (median of 3 requests each), its short steps
                        replayed from graphs, then eager (a generator without graphs): the spread that
                        serve_load.py --lengths meets through HTTP
    request             one request of 8 prompt tokens and --new-tokens, greedy: its ms a round
Not in these: Manifest.load and the integrity check of the dir's files (sampled blocks, a few ms;
docs/performance.md, "The CPU machine: export and load-time checks").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from xcompile.compile.config import KNOWN_MODELS
from xcompile.compile.reference import synthetic_manifest
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.registry import DrafterSpec, make_drafter
from xcompile.runtime.enginedir.contract import EAGLE3, TARGET
from xcompile.runtime.engines.load import BACKENDS, EngineSet, OpenOptions

MAX_SEQ_LEN = 4096          # what the 8B exports of docs/performance.md hold
SHARD_BYTES = 5 << 30       # HF's default shard size for Qwen3-8B's safetensors (5 GB)


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def open_fast(manifest) -> EngineSet:
    engines = BACKENDS["fast"].load(None, manifest, torch.device("cuda"), OpenOptions())
    d2t = engines[EAGLE3].reference.module.d2t if EAGLE3 in engines else None
    return EngineSet(None, manifest, "fast", engines, d2t)


def write_checkpoint(es: EngineSet, out: Path) -> None:
    """The target's weights as an HF Qwen3 checkpoint (config.json, sharded safetensors and their index)."""
    from safetensors.torch import save_file

    module = es.engines[TARGET].reference.module
    state = dict(module.state_dict())
    keys = module.key_map().tensors
    out.mkdir(parents=True, exist_ok=True)
    shards, size = [{}], 0
    for name, key in keys.items():
        t = state[name]
        if size and size + t.numel() * t.element_size() > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.numel() * t.element_size()
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous().cpu() for k, v in shard.items()}, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                                 **module.cfg.to_dict(), "torch_dtype": "bfloat16"}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b", choices=[k for k, m in KNOWN_MODELS.items() if m.config])
    ap.add_argument("--checkpoint", type=Path, help="where to write (or find) the target as a checkpoint")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.new_tokens < 1:
        ap.error("--new-tokens must be at least 1")
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json {args.json}: its folder does not exist")
    if not torch.cuda.is_available():
        print("open_dir.py times the fast backend on a GPU: no CUDA device is visible here", file=sys.stderr)
        return 2
    out: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    manifest = synthetic_manifest(args.model, MAX_SEQ_LEN)
    es, out["open_synthetic_s"] = timed(lambda: open_fast(manifest))
    print(f"open, synthetic: {out['open_synthetic_s']:.2f} s")
    if args.checkpoint is not None:
        if not (args.checkpoint / "config.json").is_file():
            _, out["write_checkpoint_s"] = timed(lambda: write_checkpoint(es, args.checkpoint))
            print(f"write checkpoint: {out['write_checkpoint_s']:.2f} s ({args.checkpoint})")
        es.close()
        manifest = synthetic_manifest(args.model, MAX_SEQ_LEN)
        manifest.models[TARGET].source = str(args.checkpoint)
        es, out["open_checkpoint_s"] = timed(lambda: open_fast(manifest))
        files = sum(f.stat().st_size for f in args.checkpoint.glob("*.safetensors"))
        out["checkpoint_gb"] = round(files / 1e9, 3)
        print(f"open, checkpoint: {out['open_checkpoint_s']:.2f} s ({out['checkpoint_gb']} GB of safetensors)")
    spec = DrafterSpec.from_options("eagle3", 6).resolve(es)
    gen = Generator(es.engines[TARGET], make_drafter(es, spec), [], MAX_SEQ_LEN, options=LoopOptions(cuda_graphs=True))
    parts, out["warm_up_s"] = timed(gen.warm_up)
    out["warm_up_parts"] = {p.what: round(p.seconds, 3) for p in parts}
    print(f"warm-up: {out['warm_up_s']:.2f} s ({len(parts)} parts)")
    prompt = list(range(1000, 1008))
    prefills = [gen.generate(prompt, 1).stats.prefill_s for _ in range(5)]
    out["prefill_8_ms"] = round(1e3 * statistics.median(prefills), 3)
    print(f"prefill 8: {out['prefill_8_ms']:.1f} ms (median of 5; {', '.join(f'{1e3 * s:.1f}' for s in prefills)})")
    # every prompt length of serve_load.py's --lengths window (16-79 ids: one short step, then two), median of 3;
    # then the same with the prompt steps eager (a generator without CUDA graphs over the same engines)
    eager = Generator(es.engines[TARGET], make_drafter(es, spec), [], MAX_SEQ_LEN, options=LoopOptions())
    for name, g in (("graphed", gen), ("eager", eager)):
        by_length = {n: statistics.median(g.generate(list(range(1000, 1000 + n)), 1).stats.prefill_s
                                          for _ in range(3)) for n in range(16, 80)}
        median = statistics.median(by_length.values())
        slowest = max(by_length, key=by_length.get)
        out[f"prefill_by_length_ms_{name}"] = {str(n): round(1e3 * t, 3) for n, t in by_length.items()}
        print(f"prefill 16-79, {name} steps: median {1e3 * median:.1f} ms, slowest {1e3 * by_length[slowest]:.1f} ms "
              f"= {by_length[slowest] / median:.2f}x the median (length {slowest}); 16: {1e3 * by_length[16]:.1f} ms, "
              f"64: {1e3 * by_length[64]:.1f} ms, 65: {1e3 * by_length[65]:.1f} ms")
    stats = gen.generate(prompt, args.new_tokens).stats
    out["round_ms"] = round(1e3 * stats.decode_s / max(stats.rounds, 1), 3)
    print(f"request: {stats.new_tokens} tokens, {stats.rounds} rounds, {out['round_ms']:.3f} ms a round")
    es.close()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
