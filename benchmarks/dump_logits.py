"""Dump every output of a fixed sequence of fast-backend steps, and compare two dumps bit for bit.

    python benchmarks/dump_logits.py --out new.pt [--layers 36]        # Qwen3-8B shape + EAGLE3 head, on a GPU
    python benchmarks/dump_logits.py --out tiny.pt --tiny               # the tests' tiny dimensions, fp32 (CPU:
                                                                        # the interpreter, TRITON_INTERPRET=1)
    python benchmarks/dump_logits.py --compare old.pt new.pt

The weights are seeded per tensor name (drawn on the run's device, so a dump is reproducible on one machine with
one torch), the step inputs are seeded tokens fed in a fixed order (teacher-forced: a difference in one step
changes no later step's tokens, only the KV rows it wrote), and the steps are those a speculative round runs:

    prefill       the target over a 100-token prompt (longer than the kernels' rows: the reference modules),
                  the EAGLE3 fc and head over it
    decode0..3    one-token target steps; the fc of their taps (one row)
    eagle3        a one-token EAGLE3 draft step, then a 10-token one (a tree level)
    verify7       a 7-token chain verify (causal), the fc of its taps
    verify32      a 32-token tree verify (a fixed random tree)

Every logits / hidden tensor is saved (``{name: tensor}`` with a ``meta`` entry) to ``--out``. ``--compare`` says
whether two dumps hold the same bits, or names the first tensor that differs, where and by how much; exit 0 /
1 (a difference) / 2 (not comparable: other models, tensors or shapes). The script runs against this tree and
against a tree before the runtime's restructure (its fast engines under xcompile.runtime.backends), so that one
device call can dump both (scripts/h200_check.sh compare).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import sys
import zlib

import torch

SEED = 0
PROMPT = 100                       # > the kernels' 64 rows: the prompt pass runs the reference modules
CAPACITY = {"8b": 4352, "tiny": 256}   # KV slots (xrun bench's 4352 for contexts 128,4096); the attention's
                                       # splits follow it, so both dumps of a comparison must use the same
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)     # tests/fixtures.py TINY_QWEN3's dimensions


def fast_module():
    """The fast engines' module: runtime/engines/fast.py, or runtime/backends/fast.py in trees before 6d9723b."""
    try:
        from xcompile.runtime.engines import fast
    except ModuleNotFoundError:
        from xcompile.runtime.backends import fast
    return fast


def seeded_(module: torch.nn.Module, seed: int, std: float = 0.02) -> torch.nn.Module:
    """Each parameter drawn from a generator seeded by (seed, its name) on its device: N(0, std), norm weights
    1 + N(0, 0.1) (so that the norms folded into the weights are not ones)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            g = torch.Generator(p.device).manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            r = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            p.copy_(1 + 0.1 * r if name.endswith("norm.weight") else std * r)
    return module.eval()


def causal(s: int, device: torch.device) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool, device=device).tril()[None]


def tree(s: int, device: torch.device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of s nodes (node i under a node before it, node 0 the root): its mask [1, s, s] and depths."""
    mask = torch.eye(s, dtype=torch.bool)
    depth = torch.zeros(s, dtype=torch.int64)
    for i in range(1, s):
        parent = int(torch.randint(0, i, (1,), generator=g))
        mask[i] |= mask[parent]
        depth[i] = depth[parent] + 1
    return mask[None].to(device), depth.to(device)


def step(ids: torch.Tensor, start: int, mask: torch.Tensor | None = None, depth: torch.Tensor | None = None,
         all_rows: bool = True) -> dict:
    """Step inputs of the token ids [S] written at ``start`` (causal unless a tree mask and its depths are given);
    logits of every row, or of the last only."""
    s, dev = ids.shape[0], ids.device
    i64 = dict(dtype=torch.int64, device=dev)
    pos = start + (depth if depth is not None else torch.arange(s, **i64))
    rows = torch.arange(s, **i64) if all_rows else torch.full((1,), s - 1, **i64)
    return dict(input_ids=ids[None], position_ids=pos[None], write_index=torch.tensor([start], **i64),
                tree_mask=mask if mask is not None else causal(s, dev), logit_rows=rows[None])


def build(tiny: bool, layers: int | None, device: torch.device):
    """(target, EAGLE3 step, fc) fast engines of seeded weights, and the target's config."""
    from xcompile.compile.config import KNOWN_MODELS, Qwen3Config, synthetic_eagle3_config
    from xcompile.compile.models.eagle3 import Eagle3
    from xcompile.compile.models.qwen3 import Qwen3
    from xcompile.compile.reference import eagle3_engines, qwen3_engine

    fast = fast_module()
    cfg = Qwen3Config(**TINY) if tiny else KNOWN_MODELS["qwen3-8b"].config
    cfg = dataclasses.replace(cfg, num_hidden_layers=layers or cfg.num_hidden_layers)
    dtype, capacity = (torch.float32, CAPACITY["tiny"]) if tiny else (torch.bfloat16, CAPACITY["8b"])
    with torch.device(device):
        target = seeded_(Qwen3(cfg, capacity, cfg.default_tap_layers).to(dtype), SEED)
        head = seeded_(Eagle3(synthetic_eagle3_config(cfg), capacity).to(dtype), SEED + 1)
    t = fast.FastQwen3Engine(qwen3_engine(target), dataclasses.asdict(cfg), cfg.default_tap_layers)
    e3, fc = eagle3_engines(head)
    e3, fc = fast.FastEagle3Engine(e3, dataclasses.asdict(head.cfg)), fast.FastFCEngine(fc, {})
    t.new_kv()
    e3.new_kv()
    return t, e3, fc, cfg, fast.__name__


def dump(tiny: bool, layers: int | None, device: torch.device) -> dict[str, torch.Tensor]:
    """Every output of the fixed sequence of steps (module docstring), by name, on the CPU."""
    target, e3, fc, cfg, module = build(tiny, layers, device)
    g = torch.Generator().manual_seed(SEED)
    out: dict[str, torch.Tensor] = {}

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (n,), generator=g).to(device)

    def keep(prefix: str, outputs: dict) -> dict:
        for name, t in outputs.items():
            out[f"{prefix}.{name}"] = t.detach().to("cpu", copy=True)
        return outputs

    def fc_of(prefix: str, taps: torch.Tensor) -> torch.Tensor:
        return keep(prefix, {"fc": fc.run(hidden_taps=taps)["hidden_states"]})["fc"]

    with torch.inference_mode():
        prompt = tokens(PROMPT)
        taps = keep("prefill", target.run(**step(prompt, 0, all_rows=False)))["hidden_taps"]
        hidden = fc_of("prefill", taps)
        keep("prefill.eagle3", e3.run(**step(prompt, 0, all_rows=False), hidden_states=hidden))
        pos = PROMPT
        for i in range(4):
            taps = keep(f"decode{i}", target.run(**step(tokens(1), pos)))["hidden_taps"]
            hidden = fc_of(f"decode{i}", taps)
            pos += 1
        keep("eagle3.1", e3.run(**step(tokens(1), pos), hidden_states=hidden))
        hidden10 = torch.randn(1, 10, cfg.hidden_size, generator=g).to(device, hidden.dtype)
        keep("eagle3.10", e3.run(**step(tokens(10), pos + 1), hidden_states=hidden10))
        taps = keep("verify7", target.run(**step(tokens(7), pos)))["hidden_taps"]
        fc_of("verify7", taps)
        mask, depth = tree(32, device, g)
        keep("verify32", target.run(**step(tokens(32), pos + 7, mask, depth)))
    out["meta"] = {"module": module, "layers": cfg.num_hidden_layers, "tiny": tiny, "device": str(device),
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   "torch": str(torch.__version__)}
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaNs compare by payload, -0 differs from +0)."""
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def load(path: str) -> dict:
    """A dump written by this script; SystemExit naming the file otherwise."""
    try:
        found = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as e:   # not a .pt
        raise SystemExit(f"{path}: not readable as a dump of this script ({type(e).__name__}: {e})") from None
    if not isinstance(found, dict) or "meta" not in found:
        raise SystemExit(f"{path}: not a dump of this script (no meta entry)")
    return found


def compare(a_path: str, b_path: str) -> int:
    """Print whether two dumps hold the same bits (module docstring); the exit status."""
    a, b = (load(p) for p in (a_path, b_path))
    meta_a, meta_b = a.pop("meta"), b.pop("meta")
    print(f"A {a_path}: {meta_a}\nB {b_path}: {meta_b}")
    if (meta_a["tiny"], meta_a["layers"]) != (meta_b["tiny"], meta_b["layers"]):
        print("not comparable: dumps of other models (tiny / layers)")
        return 2
    if list(a) != list(b) or any(a[k].shape != b[k].shape or a[k].dtype != b[k].dtype for k in a):
        shapes = {k: (tuple(a[k].shape), a[k].dtype) for k in a}, {k: (tuple(b[k].shape), b[k].dtype) for k in b}
        print(f"not comparable: other tensors, shapes or dtypes\n  A {shapes[0]}\n  B {shapes[1]}")
        return 2
    differ = [k for k in a if not torch.equal(bits(a[k]), bits(b[k]))]
    if not differ:
        print(f"all {len(a)} tensors bit-identical ({sum(t.numel() for t in a.values())} values)")
        return 0
    k = differ[0]
    x, y = a[k].float(), b[k].float()
    where = (bits(a[k]) != bits(b[k])).nonzero()
    first = tuple(where[0].tolist())
    print(f"first difference: {k} {tuple(a[k].shape)} {a[k].dtype}: {where.shape[0]} of {a[k].numel()} values differ, "
          f"the first at {first}: {x[first].item()!r} vs {y[first].item()!r}; max |A - B| "
          f"{(x - y).abs().max().item():.4g}, relative {((x - y).norm() / x.norm().clamp(min=1e-30)).item():.3g}")
    print(f"{len(differ)} of {len(a)} tensors differ: {', '.join(differ)}")
    return 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="dump the steps' outputs to this .pt file")
    what.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two dumps")
    ap.add_argument("--layers", type=int, help="decoder layers (default: all of the model's)")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny dimensions in fp32 instead of the 8B shape")
    ap.add_argument("--device", help="default: cuda where there is one, else cpu (the kernels in Triton's "
                    "interpreter: set TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if args.layers is not None and args.layers < 1:
        raise SystemExit(f"--layers {args.layers}: at least 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and (not args.tiny or os.environ.get("TRITON_INTERPRET") != "1"):
        raise SystemExit("no CUDA device here: the kernels run on the CPU only in Triton's interpreter, and only the "
                         "--tiny model in reasonable time (TRITON_INTERPRET=1 ... --tiny)")
    out = dump(args.tiny, args.layers, device)
    torch.save(out, args.out)
    print(f"{args.out}: {len(out) - 1} tensors of {out['meta']}")


if __name__ == "__main__":
    main()
