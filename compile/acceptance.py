"""A trained drafter's real acceptance: greedy generation through the runtime (torch backend) with the head drafting
chains, beside plain greedy decoding on the same target (what ``xcompile train-eagle3`` / ``train-mtp`` report on
held-out text, and benchmarks/quant_quality.py and kv_cache_quality.py measure)."""

from __future__ import annotations

import torch

from xcompile.compile.models.mtp import MTP
from xcompile.compile.reference import eagle3_engines, qwen3_engine, torch_engines
from xcompile.runtime.common import logs
from xcompile.runtime.decoding.drafters import Drafter, Eagle3ChainDrafter, MTPChainDrafter, NoDrafter
from xcompile.runtime.decoding.generator import Generator
from xcompile.runtime.enginedir.contract import MTP as MTP_GRAPH


def chain_drafter(head: torch.nn.Module, k: int) -> Drafter:
    """The runtime's chain drafter of a trained head (an EAGLE3 head or an MTP module) on torch engines."""
    if isinstance(head, MTP):
        return MTPChainDrafter(torch_engines(head, MTP_GRAPH)[MTP_GRAPH], k, d2t=getattr(head, "d2t", None))
    return Eagle3ChainDrafter(*eagle3_engines(head), head.d2t, k)


@torch.no_grad()
def measure_acceptance(target, head: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, k: int = 4,
                       kv_dtype: torch.dtype | None = None) -> dict:
    """Real acceptance: greedy generation through the runtime (torch backend) with ``head`` (an EAGLE3 head or
    an MTP module) drafting chains of ``k``, next to plain greedy decoding on the same target engine. Returns τ
    (tokens emitted per verify round, bonus included, as ``Stats.acceptance_length``), acceptance by draft
    depth, and the fraction of prompts whose output equals plain greedy token for token (1.0 in fp32; bf16
    near-ties may flip a few). ``kv_dtype``: the target's KV cache in that dtype (an FP8 cache)."""
    n = min(target.max_seq_len, head.max_seq_len)
    target_engine = qwen3_engine(target)
    if kv_dtype is not None:
        target_engine.set_kv_dtype(kv_dtype)
    plain = Generator(target_engine, NoDrafter(), [], n)                       # no EOS: full-length runs
    spec = Generator(target_engine, chain_drafter(head, k), [], n)
    rounds = emitted = same = 0
    at = [0] * k
    for p in logs.each(prompts, "acceptance", "prompts"):
        want, got = plain.generate(p, max_new_tokens), spec.generate(p, max_new_tokens)
        same += got.tokens == want.tokens
        rounds, emitted = rounds + got.stats.rounds, emitted + got.stats.new_tokens - 1     # τ as Stats defines it
        at = [a + b for a, b in zip(at, got.stats.accepted_at)]
    return {"k": k, "prompts": len(prompts), "new_tokens": max_new_tokens,
            "tau": round(emitted / max(rounds, 1), 3),
            "acceptance_by_position": [round(a / max(rounds, 1), 3) for a in at],
            "match_plain": same / max(len(prompts), 1)}
