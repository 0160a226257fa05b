"""One Qwen3-8B-shaped decode step on the fast backend vs the reference path, on a GPU, in one run.

    python benchmarks/fast_decode.py [--layers 36] [--contexts 128,4096] [--max-seq-len 4352] [--tiles FILE]
                                     [--chunks 64,128] [--json FILE]
    python benchmarks/fast_decode.py --variants "norm_late=0;early_trigger_verify=0;evict_first=0,norm_late=0"

Weights are random (drawn on the GPU: exact values do not matter for speed, and the CPU-seeded
synthetic weights of ``xrun bench --synthetic`` take a minute to draw). Prints, per context: the
graphed step time of the reference modules and of the fast engines with and without programmatic
dependent launch (PDL), for 1 (decode), 7 (chain verify) and 32 (tree verify) tokens (one token also
on the tile kernel alone and with gemv.cu's shapes on the Triton GEMV); the EAGLE3
head's draft step and fc; and the fast path's teacher-forced agreement with the reference (relative
logit error, argmax agreement) over a few decode steps. ``--variants`` instead times the decode and
verify steps (and the EAGLE3 step) under each kernels.SCHEDULE variant (``;``-separated, each a
``,``-separated list of key=value over the built-in schedule; "" is the built-in one) in one run; with
``--tiles``, a variant's ``tiles=1`` takes that file's tiles (the others keep the built-in ones); a
variant's ``chunk=N`` gives the target's attention N keys per split for the whole cache and every call (the
engine's attribute, 0 unless forced: attention.chunk_for, by the call's rows; the EAGLE3 step keeps its own); ``gemv_NAME=bn/bk/warps[/split/per_sm/ahead]`` gives one weight
shape of the 8B target or the EAGLE3 head (NAME in GEMV_NAMES: qkv, o, gate_up, down, lm_head, eagle3_qkv,
eagle3_lm_head) that one-row GEMV tile (gemv.Gemv's fields; 0: the tile kernel), e.g. ``gemv_gate_up=4/256/4/1/24/2`` for the streaming kernel at 24 programs a SM, 2 tiles
ahead; ``cuda_NAME=cols/warps/stages[/per_sm]`` gives it gemv.cu's CUDA C++ kernel with that tile
(cuda_gemv.CudaGemv; 0: none, the Triton GEMV or tile); ``tile_NAME=bn/bk/warps/stages[/split/per_sm]`` gives
its calls of several rows (and one-row calls of shapes without a GEMV) that tile-kernel tile (linear.Tile),
e.g. ``tile_qkv=64/256/4/2/2``. All three tables are keyed by shape, so the EAGLE3 step's o, gate/up and down
(and fc) take them too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from xcompile.compile.config import KNOWN_MODELS, synthetic_eagle3_config
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.compile.reference import eagle3_engines, qwen3_engine
from xcompile.runtime.bench.measure import matmul_rate, prefill_flops, timed
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.drafters import causal, prompt_inputs
from xcompile.runtime.engines import kernels
from xcompile.runtime.engines.fast import FastEagle3Engine, FastFCEngine, FastQwen3Engine
from xcompile.runtime.engines.graphs import CudaGraphCapture
from xcompile.runtime.engines.kernels import cuda_gemv as C
from xcompile.runtime.engines.kernels import gemv as G
from xcompile.runtime.engines.kernels import linear as L

DEV = torch.device("cuda")


def random_(module: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else std * torch.randn_like(p))
    return module.eval()


def step_inputs(tokens: int, ctx: int, vocab: int) -> dict:
    i64 = dict(dtype=torch.int64, device=DEV)
    return dict(input_ids=torch.randint(0, vocab, (1, tokens), **i64),
                position_ids=ctx + torch.arange(tokens, **i64)[None], write_index=torch.full((1,), ctx, **i64),
                tree_mask=causal(tokens, DEV), logit_rows=torch.arange(tokens, **i64)[None])


def graphed_ms(run, inputs: dict, reps: int = 30) -> float:
    replay, _ = CudaGraphCapture(warmup=2)(lambda: run(**inputs), DEV)
    return timed(replay, DEV, reps)


def timed_ms(fn, reps: int = 5) -> float:
    return timed(fn, DEV, reps, warmup=1)


# the 8B target's weights as GEMV_TILES keys them (N_OUT, K), for the variants' gemv_NAME keys
GEMV_NAMES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (12288, 4096), "down": (4096, 12288),
              "lm_head": (151936, 4096), "eagle3_qkv": (6144, 8192), "eagle3_lm_head": (32000, 4096)}
OWN_KEYS = ("tiles", "chunk")                   # the benchmark's own variant keys (and gemv_NAME), not SCHEDULE's


def tile_key(key: str) -> bool:
    """Whether a variant key is a gemv_NAME, cuda_NAME or tile_NAME tile (NAME in GEMV_NAMES); other keys
    (cuda_gemv among them) are SCHEDULE's."""
    return key.startswith(("gemv_", "cuda_", "tile_")) and key[5:] in GEMV_NAMES


def gemv_value(key: str, text: str) -> tuple[int, ...]:
    """A gemv_NAME variant's tile from 'bn/bk/warps[/split/per_sm/ahead]', a cuda_NAME one's from
    'cols/warps/stages[/per_sm]' (or '0': none), a tile_NAME one's from 'bn/bk/warps/stages[/split/per_sm]';
    SystemExit if malformed."""
    cuda, tile = key.startswith("cuda_"), key.startswith("tile_")
    form = "cols/warps/stages[/per_sm]" if cuda else "bn/bk/warps/stages[/split/per_sm]" if tile \
        else "bn/bk/warps[/split/per_sm/ahead]"
    usage = f"--variants: {key}={text} must be {'' if tile else '0 or '}{form} (integers)"
    try:
        fields = tuple(int(t) for t in text.split("/"))
    except ValueError:
        raise SystemExit(usage) from None
    if fields == (0,) and not tile:
        return fields
    if not (4 if tile else 3) <= len(fields) <= (4 if cuda else 6):
        raise SystemExit(usage)
    shape = GEMV_NAMES[key[5:]]
    if tile:
        bn, bk, warps, stages, *rest = fields
        if min(fields) < 0 or bn < 16 or bk < 16 or bn & (bn - 1) or bk & (bk - 1) or warps not in (1, 2, 4, 8) \
                or stages < 1 or (rest and rest[0] < 1):
            raise SystemExit(f"{usage}: bn and bk powers of two >= 16, warps 1, 2, 4 or 8, stages and split >= 1")
        return fields
    if cuda:
        try:
            C.check(fields, *shape, gated=key == "cuda_gate_up")
        except EngineError as e:
            raise SystemExit(f"--variants: {key}={text}: {e}") from None
        return fields
    saved = dict(G.GEMV_TILES)
    G.GEMV_TILES[shape] = G.Gemv(*fields)
    try:
        G.gemv_tile(*shape)                                 # its checks, before any variant runs
    except EngineError as e:
        raise SystemExit(f"--variants: {key}={text}: {e}") from None
    finally:
        G.GEMV_TILES.clear()
        G.GEMV_TILES.update(saved)
    return fields


def parse_variants(spec: str) -> list[dict]:
    """'a=1,b=0;c=1' -> [{}, {'a': True, 'b': False}, {'c': True}] (the built-in schedule first; counts such as
    rstd_span=1024 stay numbers; tiles, chunk and gemv_NAME are the benchmark's own keys, not SCHEDULE's)."""
    out = [{}]
    for v in spec.split(";"):
        if v.strip():
            pairs = [[t.strip() for t in kv.split("=")] for kv in v.split(",")]
            out.append({k: bool(float(x)) if k == "tiles" else int(x) if k == "chunk"
                        else gemv_value(k, x) if tile_key(k)
                        else kernels.schedule_value(k, x, "--variants") for k, x in pairs})
    return out


def variant_schedule(v: dict, builtin: dict) -> dict:
    """The SCHEDULE a variant runs under: the built-in one with the variant's SCHEDULE keys (not the benchmark's)."""
    return builtin | {k: x for k, x in v.items() if k not in OWN_KEYS and not tile_key(k)}


def variant_gemv(v: dict, cuda_base: dict) -> None:
    """Put a variant's gemv_NAME tiles in GEMV_TILES and its tile_NAME ones in linear.TILES (over whatever they
    hold: the caller restores them) and its cuda_NAME ones in CUDA_GEMVS (over ``cuda_base``); 0 removes the
    shape."""
    C.CUDA_GEMVS.clear()
    C.CUDA_GEMVS.update(cuda_base)
    tables = {"cuda_": (C.CUDA_GEMVS, C.CudaGemv), "gemv_": (G.GEMV_TILES, G.Gemv), "tile_": (L.TILES, L.Tile)}
    for k, fields in v.items():
        if tile_key(k):
            table, tile = tables[k[:5]]
            shape = GEMV_NAMES[k[5:]]
            table.pop(shape, None)
            if fields != (0,):
                table[shape] = tile(*fields)


def variant_name(v: dict) -> str:
    """A variant as its spec writes it ('built-in' for none)."""
    return ",".join(f"{k}={'/'.join(map(str, x)) if isinstance(x, tuple) else int(x)}" for k, x in v.items()) \
        or "built-in"


def use_tiles(tables: dict) -> None:
    """Put kernels.json-style tables {"tiles": {...}, "gemv_tiles": {...}} (or the built-in copies) in place."""
    for table, key in ((L.TILES, "tiles"), (G.GEMV_TILES, "gemv_tiles")):
        for shape, tile in tables.get(key, {}).items():
            table[tuple(map(int, shape.split(","))) if isinstance(shape, str) else shape] = tuple(tile)


def time_variants(variants: list[dict], contexts: list[int], fast, fe3, ref, cfg, tiles: dict | None) -> list[dict]:
    """Graphed step ms of the fast target (1 / 7 / 32 tokens) and the EAGLE3 step (1 token) per variant."""
    builtin = dict(kernels.SCHEDULE)
    builtin_tiles = {"tiles": dict(L.TILES), "gemv_tiles": dict(G.GEMV_TILES)}
    builtin_chunk = fast.chunk
    builtin_cuda = dict(C.CUDA_GEMVS)
    rows = []
    print(f"built-in schedule {builtin}")
    print(f"{'schedule variant':<48}{'ctx':>6}{'1 tok':>8}{'7 tok':>8}{'32 tok':>8}{'eagle3':>8}")
    for ctx in contexts:
        ref.run(**prompt_inputs(torch.randint(0, cfg.vocab_size, (1, ctx), device=DEV)))
        for v in variants:
            kernels.SCHEDULE.clear()
            kernels.SCHEDULE.update(variant_schedule(v, builtin))
            fast.chunk = v.get("chunk", builtin_chunk)
            G.GEMV_TILES.clear()
            use_tiles(builtin_tiles)
            if v.get("tiles") and tiles:
                use_tiles(tiles)
            variant_gemv(v, builtin_cuda)
            row = {"variant": v, "ctx": ctx}
            for tokens in (1, 7, 32):
                row[f"fast_ms_{tokens}"] = graphed_ms(fast.run, step_inputs(tokens, ctx, cfg.vocab_size))
            e3_in = step_inputs(1, ctx, cfg.vocab_size)
            e3_in["hidden_states"] = torch.randn(1, 1, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
            row["eagle3_ms"] = graphed_ms(fe3.run, e3_in)
            rows.append(row)
            name = variant_name(v)
            print(f"{name:<48}{ctx:>6}{row['fast_ms_1']:>8.3f}{row['fast_ms_7']:>8.3f}{row['fast_ms_32']:>8.3f}"
                  f"{row['eagle3_ms']:>8.3f}")
    kernels.SCHEDULE.clear()
    kernels.SCHEDULE.update(builtin)
    G.GEMV_TILES.clear()
    use_tiles(builtin_tiles)
    variant_gemv({}, builtin_cuda)
    fast.chunk = builtin_chunk
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--contexts", default="128,4096")
    ap.add_argument("--max-seq-len", type=int, default=4352, help="KV slots of the target's and the head's caches")
    ap.add_argument("--json")
    ap.add_argument("--tiles", help="kernels.json of benchmarks/kernels.py --sweep: use its chosen tiles")
    ap.add_argument("--chunks", default="", help="attention chunks (keys per split) to time the step with too")
    ap.add_argument("--variants", help="only time the steps under these kernels.SCHEDULE variants (docstring)")
    args = ap.parse_args()
    contexts = list(map(int, args.contexts.split(",")))
    if max(contexts) + 32 > args.max_seq_len:                             # the 32-token step at that context
        raise SystemExit(f"--max-seq-len {args.max_seq_len} holds no 32-token step at context {max(contexts)}; "
                         "raise it or lower --contexts")
    variants = parse_variants(args.variants) if args.variants is not None else None
    builtin_gemv = dict(G.GEMV_TILES)
    chosen = json.load(open(args.tiles)) if args.tiles else None
    if chosen and variants is None:
        use_tiles(chosen)
        print("tiles:", L.TILES, "\none-row gemv tiles:", G.GEMV_TILES)
    elif chosen:
        print("tiles=1 variants take:", chosen.get("tiles"), chosen.get("gemv_tiles"))
    torch.manual_seed(0)
    cfg = dataclasses.replace(KNOWN_MODELS["qwen3-8b"].config, num_hidden_layers=args.layers)
    taps = tuple(sorted({1, args.layers // 2 - 1, args.layers - 4}))
    with torch.device(DEV):
        target = random_(Qwen3(cfg, args.max_seq_len, taps).to(torch.bfloat16))
        head = Eagle3(synthetic_eagle3_config(cfg), args.max_seq_len).to(torch.bfloat16)
    head.embed_tokens.weight = target.model.embed_tokens.weight
    random_(head)
    ref = qwen3_engine(target)
    fast = FastQwen3Engine(qwen3_engine(target), dataclasses.asdict(cfg), taps)   # re-points target's weights
    kv = ref.new_kv()
    fast.bind_kv(kv)
    e3, fc = eagle3_engines(head)
    fe3, ffc = FastEagle3Engine(eagle3_engines(head)[0], dataclasses.asdict(head.cfg)), FastFCEngine(fc, {})
    fe3.bind_kv(e3.new_kv())
    out = {"layers": args.layers, "rows": []}
    if variants is not None:
        out["variants"] = time_variants(variants, contexts, fast, fe3, ref, cfg, chosen)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    print(f"{'what':<22}{'ctx':>6}{'tokens':>7}{'ref ms':>9}{'fast ms':>9}{'no-PDL ms':>11}{'tile-only ms':>12}"
          f"{'Triton GEMV ms':>16}" + (f"{'built-in GEMV tiles ms':>24}" if args.tiles else ""))
    for ctx in contexts:
        ref.run(**prompt_inputs(torch.randint(0, cfg.vocab_size, (1, ctx), device=DEV)))
        for tokens in (1, 7, 32):
            inputs = step_inputs(tokens, ctx, cfg.vocab_size)
            row = {"what": "target step", "ctx": ctx, "tokens": tokens, "ref_ms": graphed_ms(ref.run, inputs)}
            row["fast_ms"] = graphed_ms(fast.run, inputs)
            if tokens == 1 and kernels.SCHEDULE["cuda_gemv"] and C.CUDA_GEMVS:    # gemv.cu's shapes on Triton
                kernels.SCHEDULE["cuda_gemv"] = False
                row["fast_triton_gemv_ms"] = graphed_ms(fast.run, inputs)
                kernels.SCHEDULE["cuda_gemv"] = True
            if tokens == 1 and (G.GEMV_TILES or C.CUDA_GEMVS):  # the tile kernel for one row too
                saved, cuda = dict(G.GEMV_TILES), kernels.SCHEDULE["cuda_gemv"]
                G.GEMV_TILES.clear()
                kernels.SCHEDULE["cuda_gemv"] = False
                row["fast_tile_kernel_ms"] = graphed_ms(fast.run, inputs)
                G.GEMV_TILES.update(saved)
                kernels.SCHEDULE["cuda_gemv"] = cuda
            kernels.PDL["enabled"] = False
            row["fast_nopdl_ms"] = graphed_ms(fast.run, inputs)
            kernels.PDL["enabled"] = True
            if tokens == 1 and args.tiles:                     # the built-in one-row tiles, for comparison
                chosen_gemv = dict(G.GEMV_TILES)
                G.GEMV_TILES.clear()
                G.GEMV_TILES.update(builtin_gemv)
                row["fast_builtin_gemv_ms"] = graphed_ms(fast.run, inputs)
                G.GEMV_TILES.clear()
                G.GEMV_TILES.update(chosen_gemv)
            out["rows"].append(row)
            print(f"{row['what']:<22}{ctx:>6}{tokens:>7}{row['ref_ms']:>9.3f}{row['fast_ms']:>9.3f}"
                  f"{row['fast_nopdl_ms']:>11.3f}{row.get('fast_tile_kernel_ms', float('nan')):>12.3f}"
                  f"{row.get('fast_triton_gemv_ms', float('nan')):>16.3f}"
                  + (f"{row.get('fast_builtin_gemv_ms', float('nan')):>24.3f}" if args.tiles else ""))
        for chunk in [int(c) for c in args.chunks.split(",") if c]:
            default, fast.chunk = fast.chunk, chunk
            for tokens in (1, 32):
                row = {"what": f"chunk {chunk}", "ctx": ctx, "tokens": tokens,
                       "fast_ms": graphed_ms(fast.run, step_inputs(tokens, ctx, cfg.vocab_size))}
                out["rows"].append(row)
                print(f"{row['what'] + ' (default ' + str(default) + ')':<22}{ctx:>6}{tokens:>7}{'':>9}"
                      f"{row['fast_ms']:>9.3f}")
            fast.chunk = default
        for tokens in (1, 10):
            inputs = step_inputs(tokens, ctx, cfg.vocab_size)
            inputs["hidden_states"] = torch.randn(1, tokens, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
            row = {"what": "eagle3 step", "ctx": ctx, "tokens": tokens, "ref_ms": graphed_ms(e3.run, inputs),
                   "fast_ms": graphed_ms(fe3.run, inputs)}
            out["rows"].append(row)
            print(f"{row['what']:<22}{ctx:>6}{tokens:>7}{row['ref_ms']:>9.3f}{row['fast_ms']:>9.3f}")
        taps_in = {"hidden_taps": torch.randn(1, 7, 3 * cfg.hidden_size, device=DEV, dtype=torch.bfloat16)}
        row = {"what": "eagle3 fc", "ctx": ctx, "tokens": 7, "ref_ms": graphed_ms(fc.run, taps_in),
               "fast_ms": graphed_ms(ffc.run, taps_in)}
        out["rows"].append(row)
        print(f"{row['what']:<22}{ctx:>6}{7:>7}{row['ref_ms']:>9.3f}{row['fast_ms']:>9.3f}")
    # prefill: TTFT of a 4096-token prompt (the fast engine runs it on the reference modules; a smaller cache's
    # length) against the bf16 matmul rate measured here, FLOPs counted as xrun bench counts them
    # (runtime/bench/measure.py prefill_flops: lm_head over the one logit row; until 2026-12-01 this script took it
    # over every token)
    n = min(4096, args.max_seq_len)
    prompt = prompt_inputs(torch.randint(0, cfg.vocab_size, (1, n), device=DEV))
    ttft = timed_ms(lambda: fast.run(**prompt))
    rate = matmul_rate(DEV, torch.bfloat16)
    flops = prefill_flops(dataclasses.asdict(cfg), n)
    out["prefill"] = {"tokens": n, "ttft_ms": ttft, "matmul_tflops": rate / 1e12, "fraction": flops / (ttft / 1e3) / rate}
    print(f"prefill {n} tokens: {ttft:.1f} ms, {flops / (ttft / 1e3) / 1e12:.0f} TFLOP/s = "
          f"{100 * out['prefill']['fraction']:.0f} % of the {rate / 1e12:.0f} TFLOP/s bf16 matmul rate measured here")
    # teacher-forced agreement: the same tokens into both paths (separate caches), logits compared
    ref_kv = [b.clone() for b in kv]
    ref.bind_kv(ref_kv)
    ctx = contexts[0]
    errs, agree = [], 0
    for i in range(16):
        inputs = step_inputs(1, ctx + i, cfg.vocab_size)
        a, b = ref.run(**inputs)["logits"].float(), fast.run(**inputs)["logits"].float()
        errs.append(((a - b).norm() / a.norm()).item())
        agree += int(a.argmax() == b.argmax())
    out["agreement"] = {"rel_err_max": max(errs), "argmax_agree": agree, "steps": 16}
    print(f"teacher-forced 16 decode steps at ctx {ctx}: max rel logit error {max(errs):.2e}, argmax agree {agree}/16")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
