"""The costs ``xrun bench`` weighs rounds against: the device's copy bandwidth and matmul rate, the bytes and FLOPs
a Qwen3 token reads and costs, one engine step at a time and the sampler's share of a round (measure.py puts them
in the report)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from xcompile.runtime.decoding.drafters import NoDrafter, causal, prompt_pass
from xcompile.runtime.decoding.kernels import use_fused
from xcompile.runtime.decoding.rounds import verifier_for
from xcompile.runtime.decoding.sampling import Sampler
from xcompile.runtime.decoding.speculative import Block, ancestors, chain_block
from xcompile.runtime.enginedir.contract import DRAFT, EAGLE3, EAGLE3_FC, MTP, TARGET
from xcompile.runtime.engines.graphs import CudaGraphCapture, GraphedEngine, GraphUnavailable
from xcompile.runtime.engines.load import EngineSet

if TYPE_CHECKING:
    from xcompile.runtime.bench.measure import BenchOptions


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 4 if device.type == "cuda" else 2**26
    src = torch.randn(n, device=device)        # random data, never zeros, so the copy moves real data
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, repeats=10)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}     # per element of an engine dtype


def weight_bytes(config: dict, dtype: str) -> int:
    """Bytes of weights one decoded token reads, from a Qwen3 config: every layer's projections and
    norms, the final norm and lm_head; of the input embedding only one row (negligible), unless tied,
    when it is the lm_head itself."""
    c = config
    h, d = c["hidden_size"], c["head_dim"]
    layer = _projections(c) + 2 * h + 2 * d                            # + input/post-attention and q/k norms
    params = c["num_hidden_layers"] * layer + h + c["vocab_size"] * h
    return params * _BYTES[dtype]


def kv_bytes(config: dict, element_bytes: int, context: int) -> int:
    """Bytes of KV cache one decoded token reads at ``context``: every layer's keys and values of the cached
    tokens (at 16,384 tokens of the Qwen3-8B shape in bf16, 2.4 GB: 16 % on top of its 15.1 GB of weights)."""
    c = config
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * context * element_bytes


def _projections(config: dict) -> int:
    """Weights of one Qwen3 layer's projections: q/k/v, o, gate/up/down."""
    c = config
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return h * (q + 2 * kv) + q * h + 3 * h * c["intermediate_size"]


def prefill_flops(config: dict, tokens: int) -> int:
    """Matmul FLOPs of a Qwen3 prompt pass over ``tokens`` tokens that returns one logit row: every layer's
    projections for every token, lm_head for the one row, attention's QK^T and PV over the causal half."""
    c = config
    projections = c["num_hidden_layers"] * _projections(c)
    attention = 2 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"] * tokens * tokens
    return 2 * projections * tokens + 2 * c["vocab_size"] * c["hidden_size"] + attention


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of one square matmul in ``dtype`` (8192 on a GPU; 1024 in fp32 on a CPU)."""
    n, dtype = (8192, dtype) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / (timed(lambda: a @ a, device, repeats=5) / 1e3)


def prefill_cost(es: EngineSet, ctx: int) -> dict:
    """TTFT of a ``ctx``-token prompt pass of the target (eager and in chunks, as the Generator runs prompts:
    drafters.prompt_pass) against the matmul rate measured here."""
    dev, engine = es.device, es.engines[TARGET]
    config = es.manifest.models[TARGET].config
    if not engine.kv and engine.kv_shape:
        engine.new_kv()
    prompt = torch.randint(0, config["vocab_size"], (1, ctx), device=dev)
    ms = timed(lambda: prompt_pass(engine, prompt), dev, repeats=5, warmup=1)
    rate = matmul_rate(dev, engine.dtype)
    achieved = prefill_flops(config, ctx) / (ms / 1e3)
    return {"tokens": ctx, "ttft_ms": ms, "tflops": achieved / 1e12, "matmul_tflops": rate / 1e12,
            "fraction_of_matmul": achieved / rate}


def _step_inputs(tokens: int, write_index: int, vocab: int, device: torch.device) -> dict:
    i64 = dict(dtype=torch.int64, device=device)
    return dict(input_ids=torch.randint(0, vocab, (1, tokens), **i64),
                position_ids=write_index + torch.arange(tokens, **i64)[None],
                write_index=torch.full((1,), write_index, **i64), tree_mask=causal(tokens, device),
                logit_rows=torch.arange(tokens, **i64)[None])


def step_sizes(es: EngineSet, opts: BenchOptions, tree_tokens: int | None) -> dict[str, list[int]]:
    """graph -> the token counts ``step_costs`` times it at (graphs the dir holds)."""
    sizes = {TARGET: sorted({1, *(g + 1 for g in opts.gammas), *( [tree_tokens] if tree_tokens else [])}),
             EAGLE3: [1] + ([opts.tree.topk] if opts.tree else []), DRAFT: [1], EAGLE3_FC: [1],
             MTP: [1] + ([opts.tree.topk] if opts.tree else [])}
    return {graph: tokens for graph, tokens in sizes.items() if graph in es.engines}


def step_costs(es: EngineSet, ctx: int, opts: BenchOptions, tree_tokens: int | None,
               tick: Callable[[str], None] = lambda _: None) -> list[dict]:
    """Milliseconds of single engine steps at KV length ``ctx``, eager and (on CUDA) graphed;
    ``tick(label)`` after each."""
    dev, rows = es.device, []
    capture = CudaGraphCapture()
    for engine in es.engines.values():
        if not engine.kv and engine.kv_shape:
            engine.new_kv()
    for graph, tokens_list in step_sizes(es, opts, tree_tokens).items():
        engine = es.engines[graph]
        graphed = GraphedEngine(engine, set(tokens_list), capture) if dev.type == "cuda" else None
        for s in tokens_list:
            if graph == EAGLE3_FC:
                inputs = {"hidden_taps": torch.randn(1, s, _taps_width(es), device=dev, dtype=engine.dtype)}
            else:
                inputs = _step_inputs(s, ctx, es.manifest.models[TARGET].config["vocab_size"], dev)
                if graph in (EAGLE3, MTP):
                    inputs["hidden_states"] = torch.randn(1, s, _hidden(es, graph), device=dev, dtype=engine.dtype)
            row = {"graph": graph, "tokens": s, "eager_ms": timed(lambda: engine.run(**inputs), dev, opts.repeats)}
            if graphed is not None:
                # the step's graph replayed with its inputs in place, as inside a round's graph (copying
                # the inputs in on every call would add host-side launches to a 0.2 ms draft step)
                replay = graphed.replay_of(**inputs) or (lambda: graphed.run(**inputs))
                row["graph_ms"] = timed(replay, dev, opts.repeats)
            rows.append(row)
            tick(f"{graph} x{s}")
        if graphed is not None:
            graphed.graphs.clear()
    return rows


def sampler_costs(es: EngineSet, opts: BenchOptions, tree_tokens: int | None) -> list[dict]:
    """Milliseconds of the sampler's work in a round at the target's vocabulary and dtype, eager and
    (on CUDA) replayed from a graph, by what the loop runs for it (rounds.verifier_for, the drafters' pick): one
    token drawn; one chain draft picked over the target's vocabulary (a draft model's pick; an EAGLE3 head picks
    over its smaller draft vocabulary; sampled: its q row kept too); a chain block of k+1 accepted (with draft
    distributions over the whole vocabulary, as the draft model's); a tree accepted (deterministic picks)."""
    dev, repeats = es.device, opts.repeats
    vocab = es.manifest.models[TARGET].config["vocab_size"]
    dtype = es.engines[TARGET].dtype
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(dev)
    sampler.reset(opts.sampling)
    fused = use_fused(None, dev)

    def logits(s):
        return torch.randn(1, s, vocab, generator=g).to(dev, dtype)

    def verifier(size: int, chains: bool):
        return verifier_for(SimpleNamespace(block_size=size, chains=chains), sampler, fused)

    picker = NoDrafter()
    picker.bind(2, dev, sampler=sampler)              # no engines: the length bounds nothing
    pick_block = chain_block(torch.zeros(1, 2, dtype=torch.int64, device=dev))
    cases = [("sample", 1, lambda x=logits(1): sampler.sample(x[:, 0])),
             ("draft pick", 1, lambda x=logits(1): picker._pick(pick_block, 1, x[:, 0]))]
    for k in opts.gammas:
        block = chain_block(torch.randint(0, vocab, (1, k + 1), generator=g).to(dev))
        if not sampler.greedy:
            block.q = torch.softmax(torch.randn(1, k + 1, vocab, generator=g), -1).to(dev)
            block.q_tok = block.q.gather(2, block.tokens[:, :, None])[:, :, 0]
        cases.append(("accept chain", k + 1, lambda b=block, x=logits(k + 1), v=verifier(k + 1, True): v.accept(b, x)))
    if tree_tokens:
        depth = opts.tree.depth
        parents, level = [0], [0]
        for i in range(1, tree_tokens):        # random attachment under nodes above the last level
            open_ = [j for j in range(i) if level[j] < depth]
            parents.append(open_[int(torch.randint(0, len(open_), (1,), generator=g))])
            level.append(level[parents[-1]] + 1)
        par = torch.tensor([parents], device=dev)
        mask, d = ancestors(par, depth)
        block = Block(torch.randint(0, vocab, (1, tree_tokens), generator=g).to(dev), par, mask, d, depth, False)
        cases.append(("accept tree", tree_tokens, lambda b=block, x=logits(tree_tokens), v=verifier(tree_tokens, False):
                      v.accept(b, x)))
    capture = CudaGraphCapture() if dev.type == "cuda" else None
    rows = []
    for name, s, fn in cases:
        row = {"graph": name, "tokens": s, "eager_ms": timed(fn, dev, repeats)}
        if capture is not None:
            try:
                replay, _ = capture(fn, dev)
                row["graph_ms"] = timed(replay, dev, repeats)
            except (GraphUnavailable, RuntimeError) as e:
                row["graph_error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def _hidden(es: EngineSet, graph: str) -> int:
    return es.manifest.models[graph].config["hidden_size"]


def _taps_width(es: EngineSet) -> int:
    return 3 * es.manifest.models[EAGLE3].config["target_hidden_size"]
