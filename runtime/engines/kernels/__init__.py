"""Fused Triton kernels for the decode/verify fast path (runtime/engines/fast.py).

One module per fused step, each with the plain-torch reference it is tested against:

    linear.py     RMSNorm prologue + skinny GEMM + residual or SiLU*mul epilogue (every projection)
    gemv.py       the same for one row on the CUDA cores (decode, single draft steps)
    cuda_gemv.py  the same in CUDA C++ (gemv.cu, built with nvcc as the fast engines load) for the shapes
                  it lists: weight rows streamed into shared memory by cp.async.bulk; else Triton's GEMV
    rope_kv.py    q/k RMSNorm + RoPE + KV-cache write of one step's new tokens
    attention.py  split-KV attention over the live KV length with the tree mask, and its reduction
    norm.py       RMSNorm launches of their own: the EAGLE3 step's input, the tile kernel's norms (norm_apart)
    accept.py     greedy verification of a chain (argmax, accepted count, the host row) and the round's
                  state update, for the generation loop (runtime/decoding/generator.py)
    topk.py       the tree drafter's per level work: the draft's top-k log-probs, the candidate pool update
    tree.py       the EAGLE-2 tree's selection from the pool (sorts, parent ranks, ancestor mask)

The kernels take up to ``MAX_ROWS`` query rows (decode, chain and tree verify, draft steps); longer
passes (prompts) run the reference modules. The tile kernels reduce each row in an order that does
not depend on how many rows the call carries (fixed tiles of 16 rows, tiles chosen by the weight
shape only, attention chunks at absolute key positions). One-row calls of the shapes in
``gemv.GEMV_TILES`` (and ``cuda_gemv.CUDA_GEMVS``) take a faster CUDA-core GEMV instead, whose order
(and, with SCHEDULE's norm_late, the RMSNorm's rounding) differs: a token decoded alone and the same
token verified in a block then round differently, and in bf16 speculative and plain greedy decoding
may part at a near tie (benchmarks/fast_agreement.py counts them).

On a machine without a CUDA device the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported), which is how CI checks their logic against the references.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

MAX_ROWS = 64       # query rows per fused call: a 64-node tree or a chain of 63 drafts
ROW_TILE = 16       # rows per tile: the smallest tl.dot M, fixed so results do not depend on the row count


def available() -> bool:
    """Whether triton is importable (the fast backend also needs a CUDA device or the interpreter)."""
    return importlib.util.find_spec("triton") is not None


# Programmatic dependent launch (Hopper+): each kernel starts while the previous one drains and waits
# for its results with gdc_wait (weight loads go before the wait). Off in the interpreter and before
# sm_90; benchmarks may switch it off to measure what it gives.
PDL = {"enabled": True}


@functools.cache
def _pdl_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


# How the projection and attention kernels overlap, measured with `benchmarks/fast_decode.py --variants` on
# the H200 (2026-12-01, fifth session, docs/BENCHMARKS.md), each a switch:
#   evict_first           weights (read once per step) load evict-first in L2: within run-to-run noise (a decode
#                         step 4.578 -> 4.551 ms in one run, 4.510 -> 4.495 in another; at context 4096 the
#                         second run had it 4.725 -> 4.749), kept on
#   early_trigger_verify  calls of several rows let the next kernel launch right after their own wait, not
#                         at the end of their loop (its weight loads before its wait overlap this kernel):
#                         7-token verify 4.943 -> 4.843 ms, 32-token 5.974 -> 5.930 (4.897 -> 4.795 and
#                         5.951 -> 5.885 in a second run)
#   early_trigger_decode  the same for one-row calls: slower in the fifth session (4.578 -> 4.618); faster with
#                         the seventh session's kernels in three runs out of three (below), on
# (L2 prefetches of the next projection's weights, from rope_kv or a projection's tail, measured slower in
# every amount tried, 0.5-33 MB: 4.61-4.85 ms; not kept.) None of those changes a result. One that does:
#   norm_late             a one-row GEMV's RMSNorm prologue multiplies x by its weight only (rounded) and the
#                         1/rms scales the fp32 sums at the end, x^2 gathered per lane in the main loop: no
#                         pass over x before the weights stream (not with split K: those keep the pass).
#                         With the GEMV tiles chosen under it (gemv.GEMV_TILES): decode 4.525 -> 4.468 ms
#   norm_late_tile        the same in the tile kernel: slower (gate/up 55.2 -> 67.8 us; 7 tokens 4.821 ->
#                         5.374 ms), off
# And one that changes no result (the same sums in the same order), measured in the sixth session:
#   rstd_span             columns of x whose loads the RMSNorm pre-pass (tile kernel, split-K GEMVs) has in
#                         flight at once, over all row tiles: that many / BLOCK_K steps per loop iteration
#                         (0: one step, a round trip to L2 per BLOCK_K columns, 16-32 in a row before the
#                         weights of a verify call stream). 7 / 32 tokens at context 128: 4.839 / 5.949 ms
#                         at 0, 4.766 / 5.755 at 512, 4.730 / 5.633 at 1024, 4.667 / 5.601 at 2048, 4.702 /
#                         5.618 at 4096; decode 4.439 -> 4.463 (its only pre-pass is lm_head's, noise level).
#                         Measured before norm_apart (below), which takes the norm out of the tile kernel's
#                         calls: with it on, no engine call runs this pre-pass; it serves norm_apart off
# And one that changes the rounding of the tile kernel's calls with a norm (a 1/rms summed in another order):
#   norm_apart            those calls normalise x in a launch of their own (kernels/norm.py rms_norm), not in
#                         every column block's pre-pass and main loop (the one-row GEMVs keep their prologue):
#                         32 tokens 5.624 -> 5.314 ms at context 128 and 7.568 -> 7.271 at 4096, 7 tokens
#                         4.703 -> 4.684 and 5.220 -> 5.155 (measured with several rows only; one-row
#                         calls on the tile kernel, lm_head's, take it too so a row's bits stay those of
#                         a block's row)
# Seventh session (graphed step ms, 1 / 7 / 32 tokens at context 128 | 4096, each against the built-in
# schedule of its run, benchmarks/fast_decode.py --variants, four runs on one machine):
#   early_trigger_decode  4.401 -> 4.337, 4.384 -> 4.336, 4.373 -> 4.358 at one token, context 128; 4.635 ->
#                         4.558, 4.634 -> 4.568, 4.646 -> 4.578 at 4096; verify unchanged
#   attn_early            rope_kv, the split-KV attention and its reduction let their dependents launch before
#                         their own wait (the o projection's programs resident while attention runs), for
#                         calls of several rows: 7 / 32 tokens 4.638 / 5.276 -> 4.604 / 5.181, 4.634 / 5.252
#                         -> 4.578 / 5.151, 4.620 / 5.274 -> 4.600 / 5.170 (context 4096: 7.224 -> 7.127,
#                         7.226 -> 7.124, 7.219 -> 7.144 at 32); one-row calls slower at context 128 (4.375
#                         -> 4.425, 4.401 -> 4.432, 4.384 -> 4.405), so not for them
# Eighth session:
#   attn_early_decode     attn_early for one-row calls, by how many of attention's launches take it (0: none,
#                         1: rope_kv, 2: and the split kernel, 3: and the reduction too; 3 was attn_early for
#                         every call in the seventh session's runs: slower at context 128, faster at 4096).
#                         One run: decode 4.412 -> 4.376 / 4.483 / 4.450 ms at context 128 (levels 1 / 2 / 3),
#                         4.639 -> 4.600 / 4.604 / 4.586 at 4096; verify unchanged. 1: only rope_kv lets the
#                         split kernel launch (and request its cached keys) before rope_kv's own wait
# (And each attention split requesting its second block of cached keys before its wait too, not
# only the first, was slower at every shape in one run: 4.357 / 4.574 / 5.171 -> 4.371 / 4.606 / 5.231 ms at
# context 128, 4.566 / 5.080 / 7.123 -> 4.623 / 5.183 / 7.409 at 4096, its registers at the 255 limit with a
# spill; not kept.)
# Ninth session (2026-12-02, docs/BENCHMARKS.md):
#   short_chunk           keys per attention split while write_index + MAX_ROWS keys fit the launch's splits at
#                         that size (0: the cache's chunk always). 64: every split one BLOCK_S step, all of its
#                         cached keys requested before the PDL wait. Changes bits (another split of the keys);
#                         chosen from write_index alone, so the same for a row alone and in a block at one
#                         write_index (not for a token decoded alone at wi + r against row r of a block at wi
#                         when the two straddle the switch: 63 positions a cache, e.g. 2049-2112 of 4352,
#                         where speculative and plain greedy may part at a near tie). Graphed ms,
#                         1 / 7 / 32 tokens, 4352-slot cache, context 128: 4.323 / 4.614 / 5.203 (0) -> 4.257 /
#                         4.564 / 5.142 (64) -> 4.336 / 4.618 / 5.208 (0); context 4096 (past the switch), one
#                         token: 4.546 (0) / 4.550 (64) / 4.546 (0). (A fixed 64-key chunk for one row: 4096
#                         slower, 4.529 -> 4.762; a 256-key one slower at both, 4.330 -> 4.378, 4.529 -> 4.607.)
# (Tried and removed in the ninth session: the split reduction done by each row tile's last live split program,
# an arrival counter instead of its launch: at one row 4.327 -> 4.337 / 4.545 -> 4.542 ms at context 128 / 4096
# with the reduction in steps of 16 splits, 4.509 / 4.692 with it head by head; for calls of several rows
# slower by 0.15-0.3 ms (steps) and 0.9-1.8 ms (head by head). PDL hides the launch it saves.)
# Tenth session (2026-12-02; the split kernel's registers from scripts/compile_sm90.py --resources _split_kernel:
# ~180 a thread at 4 warps once the step's new keys load in place, 210 before, i.e. two programs a SM).
# Attention's launch options, none of which changes a result (GPU-tested), graphed ms at 1 / 7 / 32 tokens:
#   attn_maxnreg          the split kernel's register cap (ptxas .maxnreg; 128: four programs a SM, a few bytes
#                         spilled) for launches of more than four programs a SM at the cache's full length
#                         (attention.many: on a 4352-slot cache the 7- and 32-row calls, not one row, nor
#                         32 rows on a 512-slot cache). Interleaved 0 / 128 / 0 / 128 / 0, 4352-slot cache:
#                         32 tokens at context 4096 7.060 / 6.732 / 7.062 / 6.719 / 7.071, 7 tokens 5.042 /
#                         5.021 / 5.043 / 5.024 / 5.045; at context 128 32 tokens 5.079 / 5.122 / 5.060 /
#                         5.115 / 5.062 (the cost), 7 tokens unchanged. Shipped: 128
#   attn_stages           its num_stages: 1 (smaller shared memory, 161 registers: three programs a SM)
#                         within noise of 2 at every shape (4096, one token: 4.594-4.612 against 4.566-4.597)
#   attn_prefetch         a bulk L2 prefetch of each split's later cached keys before its PDL wait: slower at
#                         4096 (4.617-4.633 against 4.566-4.597 at one token; 7.524 against 7.08 at 32)
#   attn_warps            8 warps: within noise at one token (4.580 at 4096), slower at 32 (7.170)
# The one-row step at context 4096 moved with none of them: its limit is not the split kernel's occupancy.
# Eleventh session (2026-12-02; benchmarks/step_timeline.py: at context 4096 the split reduction's share of the
# one-row step was 178.5 us a step against 97.6 at 128, i.e. overhead, not bytes):
#   combine_block         columns of a head each program of the split reduction sums (0: the whole head): 32
#                         puts a one-row call's reduction on a 4352-slot cache (34 splits) on 128 one-warp
#                         programs, not 32 of four warps.
#                         Changes bits at long contexts (the fp32 sum over the splits runs over another thread
#                         layout), the same for every row count. Graphed ms, 1 / 7 / 32 tokens, 4352-slot cache,
#                         context 4096: 4.563 / 5.069 / 6.737 (0), 4.454 / 4.946 / 6.732 (32), 4.456 / 4.961 /
#                         6.894 (16), 4.471 / 4.943 / 6.694 (64), 4.529 / 5.048 / 6.736 (0 again), 4.447 /
#                         4.941 / 6.730 (32 again); context 128 within noise (4.22-4.27 at one token)
# (Tried there and removed: 64-key splits over the whole cache, slower everywhere, 4.581 -> 4.748 ms at 4096;
# the split's second key step requested right after the PDL wait, one token unchanged and verify slower;
# the reduction's write_index read before its wait, within noise.)
# Thirteenth session (2026-12-02):
#   cuda_gemv             one-row calls of the shapes in cuda_gemv.CUDA_GEMVS run gemv.cu's CUDA C++ kernel
#                         (built with nvcc as the fast engines load) instead of the Triton GEMV; changes
#                         bits (another reduction order). Figures: docs/BENCHMARKS.md, thirteenth and
#                         fourteenth sessions
# Fifteenth session (2026-12-03):
#   norm_sums             calls of several rows on the tile kernel whose RMSNorm input the previous projection
#                         wrote (qkv after the down projection, gate/up after o) take each row's 1/rms from the
#                         sums of squares that projection's epilogue left, one fp32 partial per column block
#                         (linear.RowSums), not from a norm launch of their own (norm_apart): 71 fewer launches
#                         a 36-layer verify step. The norm weights are folded into the weights they feed at
#                         load (backends/fast.py), so those calls multiply x as it is and scale their sums by
#                         the 1/rms at the end. Changes the bits of those calls (x unrounded by a norm, another
#                         summation order); the same for every row count. A first form that normalised x in
#                         the main loop (x * 1/rms * g, the weights unfolded) was slower: 7 / 32 tokens 4.489 /
#                         5.099 -> 4.586 / 5.529 ms at context 128. Figures: docs/BENCHMARKS.md, fifteenth session
# Sixteenth session (2026-12-03), tried and removed (docs/BENCHMARKS.md, sixteenth session): a one-row tile-kernel
# call's RMSNorm (the lm_heads') as the kernel's prologue, not a launch: within noise (a decode step 4.060 ->
# 4.074 ms, the EAGLE3 step 0.186 either way; in norm_late_tile's form 4.228 / 0.224); the EAGLE3 step's qkv
# GEMV reading u's halves (the embedding row, the hidden, each with its 1/rms at the end) in place, not after
# embed_norms' launch: slower, 0.191-0.194 ms a step against 0.186-0.187.
# Seventeenth session (2026-12-03):
#   embed_sums            (with norm_sums) the target step's embedding gather is a launch of ours
#                         (linear.embedding) that also leaves the rows' sums of squares, so the first layer's
#                         qkv of a call of several rows takes its norm from them like the other layers' (no
#                         norm launch); off: torch's F.embedding and the norm launch. Changes the bits of
#                         that qkv (as norm_sums did the others'). Figures: docs/BENCHMARKS.md, seventeenth
#                         session
# (Tried there and removed: attn_loop, each program of the split kernel taking splits p, p + P, ... so that a
# short context on a 4352-slot cache launches fewer programs past the live length; the same bits (GPU-tested),
# but within noise at context 128 (7 tokens 4.421 / 4.426 -> 4.439 / 4.441 at 2 splits a program, 4.424 at 3,
# 4.418 at 4) and slower at 4096 (one token 4.420 / 4.406 -> 4.602 / 4.593, 5.032, 5.557).)
SCHEDULE = {"evict_first": True, "early_trigger_verify": True, "early_trigger_decode": True, "norm_late": True,
            "norm_late_tile": False, "rstd_span": 2048, "norm_apart": True, "attn_early": True,
            "attn_early_decode": 1, "short_chunk": 64, "attn_prefetch": False, "attn_stages": 2, "attn_warps": 4,
            "attn_maxnreg": 128, "combine_block": 32, "cuda_gemv": True,
            "norm_sums": True, "embed_sums": True,
            "verify_splits": 17, "tma": True}
# Eighteenth session (2026-12-03): what the 4352-slot cache cost a verify at context 128 (7 tokens 4.408 ms
# against 4.331 on a 512-slot cache) was the number of splits: the engine's chunk forced to 1088 keys (4 splits,
# the same live ones at that context, short_chunk's) ran 4.340 / 4.330 (32 tokens 4.823 / 4.818 against 5.007);
# the register cap off 4.385 / 4.399.
#   verify_splits         the most splits a call of several rows divides the cache into (attention.chunk_for;
#                         0: MAX_SPLITS, as one row): 17 on a 4352-slot cache is 256 keys a split, against one
#                         row's 34 of 128 (a decode step at context 4096 wants those: 4.407 -> 4.479 ms at 17).
#                         Changes the bits of those calls where their chunk differs from one row's (past
#                         short_chunk's range); the same at every row count from 2. 7 / 32 tokens at context
#                         128: 4.400 / 4.993 (0) against 4.330 / 4.910 and 4.357 / 4.909 (17), 4.349 / 4.912
#                         (23), 4.350 / 4.904 (12), 4.343 / 4.894 (9); at 4096 4.783 / 6.542 (0) against 4.717 /
#                         6.159 and 4.710 / 6.166 (17), 4.967 / 6.310 (23), 4.972 / 6.392 (12), 5.090 / 6.045 (9).
#                         With it the register cap (attn_maxnreg) takes the 32-row call only
# Nineteenth session (2026-12-03):
#   tma                   the tile kernel's weight tiles by tensor descriptor (linear.weight_descriptor): 2-D
#                         copies by the copy engine into shared memory, num_stages ahead, where the loads
#                         went through the registers (ptxas: no cp.async, 8 KB of shared memory). The same
#                         bits. Graphed ms at context 128, 1 / 7 / 32 tokens: 4.132 / 4.401 / 4.942 off,
#                         4.128 / 4.328 / 4.909 on; with the built-in tiles at 2 stages 5.365 at 7 tokens,
#                         at BLOCK_K 128 and 4 stages 5.063. A second run: 4.095 / 4.301 / 4.897 on, 4.111 /
#                         4.333 / 4.926 off; no other tile faster at 7 tokens with it on (4 stages, 8 warps,
#                         BLOCK_K 128 at 6 stages: 4.33-4.53). The chain round 5.552 ms = 1.347x off (one
#                         machine), 5.418 / 5.424 = 1.328x / 1.329x on (another, two runs)
# (Tried there and not kept, branch wip/split-last-combine-splits: the splits on the grid's last axis, so the
# live ones launch first, 7 tokens 4.416 -> 4.420; the reduction over the live splits 8 at a time, not one
# masked tile of every split, 4.412 at 7 tokens, 5.006 -> 4.946 at 32, slower at 4096: 4.845 -> 4.902 at 7.)


def schedule_value(key: str, text: str, flag: str = "--schedule") -> bool | int:
    """A SCHEDULE entry's value from its text ('0' / '1' for the switches, a count for rstd_span, short_chunk,
    combine_block and attention's launch options);
    SystemExit on an unknown key."""
    if key not in SCHEDULE:
        raise SystemExit(f"{flag}: unknown key {key!r}; known: {list(SCHEDULE)}")
    value = type(SCHEDULE[key])(float(text or 1))
    if key == "short_chunk":
        from xcompile.runtime.engines.kernels.attention import BLOCK_S  # here: attention.py imports this module
        if value % BLOCK_S:
            raise SystemExit(f"{flag}: short_chunk={text} must be 0 or a multiple of {BLOCK_S} (attention's key step)")
    if key == "attn_warps" and value not in (1, 2, 4, 8):
        raise SystemExit(f"{flag}: attn_warps={text} must be 1, 2, 4 or 8")
    if key == "attn_stages" and value < 1:
        raise SystemExit(f"{flag}: attn_stages={text} must be at least 1")
    if key == "verify_splits":
        from xcompile.runtime.engines.kernels.attention import MAX_SPLITS
        if not 0 <= value <= MAX_SPLITS:
            raise SystemExit(f"{flag}: verify_splits={text} must be 0 (one row's) to {MAX_SPLITS}")
    if key == "combine_block" and value and (value < 16 or value & (value - 1)):
        raise SystemExit(f"{flag}: combine_block={text} must be 0 (the head's width) or a power of two >= 16")
    if key == "attn_maxnreg" and value and not 24 <= value <= 255:
        raise SystemExit(f"{flag}: attn_maxnreg={text} must be 0 (no cap) or 24-255 registers")
    return value


def set_schedule(spec: str) -> None:
    """Set SCHEDULE entries from 'key=value,...' (the benchmarks' --schedule)."""
    for kv in filter(None, spec.split(",")):
        key, _, value = kv.partition("=")
        SCHEDULE[key] = schedule_value(key, value)


def pdl() -> bool:
    """Whether kernels are launched with programmatic dependent launch (their PDL constexpr)."""
    return PDL["enabled"] and not interpreted() and _pdl_capable()


def launch() -> dict:
    """Launch options of every kernel: ``launch_pdl`` when ``pdl()``."""
    return {"launch_pdl": True} if pdl() else {}


def use_fused(fused: bool | None, device: torch.device) -> bool:
    """Whether the generation loop's and drafters' kernels run (accept.py, topk.py, tree.py), from their
    ``fused`` option: None on a CUDA device with triton, True also in Triton's interpreter, False never."""
    runs = available() and (device.type == "cuda" or interpreted())
    return fused is not False and runs and (bool(fused) or device.type == "cuda")


def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def ieee_dot(dtype: torch.dtype) -> bool:
    """Whether tl.dot must multiply in full fp32: fp32 engines (not tf32), and the interpreter, whose
    bf16 tl.dot is wrong (it multiplies the raw bits)."""
    return dtype == torch.float32 or interpreted()


def _interpreter_fixes() -> None:
    """Two shims for Triton's CPU interpreter (tests only; nothing changes on a GPU):
    - round fp32 -> bf16 to nearest even, as the GPU does: the interpreter truncates (its
      ``create_fp_trunc`` ignores the rounding mode), which would double every rounding error the
      tests compare against the torch references;
    - patch triton.language once per kernel launch, not again at every nested @triton.jit helper
      call (the enclosing launch has patched it already): this re-patching was ~40 % of the time."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    patch_lang = interpreter._patch_lang

    def patch_lang_once(fn):
        # the language modules this function sees (triton.language and/or triton.language.core)
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and not any(tl.core.is_builtin(lang.full) for lang in langs):   # patched by the enclosing launch
            return interpreter._LangPatchScope()
        return patch_lang(fn)

    interpreter._patch_lang = patch_lang_once

    cast = InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    InterpreterBuilder.cast_impl = cast_impl


if interpreted() and available():
    _interpreter_fixes()
