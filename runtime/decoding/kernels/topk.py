"""The tree drafter's per-level work in three launches: the draft's top-k children and the pool update.

    topk_children   draft logits [B, R, V] -> (log-probs [B, R, k] fp32, target ids [B, R, k]): the k largest
                    of each row's log_softmax, largest first (ties: the lower column first), ids mapped
                    through ``targets`` (draft_tree.target_table) when given
    expand_level    one level's children into the candidate pool (score = the parent's + log-prob, token,
                    parent's pool index) and, but for the last level, the k best of them as the next level's
                    expanded nodes (their token, input hidden, ancestor mask row, score and pool index)

topk_children is two launches (column blocks of BLOCK_V: each block's max, sum of exponentials and top k;
then per row the merge of its blocks' candidates and the log-sum-exp), in place of the float copy,
log_softmax, torch.topk's kernels and the id lookup. The log-sum-exp adds the blocks' sums in block
order, so a log-prob can differ from torch.log_softmax's in the last bit (tested to 1e-6). expand_level
is one program per batch row in place of nine small ops. The plain-torch references are what the tree
drafter runs without these kernels (draft_tree.topk_children, draft_tree.expand_level).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xcompile.runtime.decoding.kernels import launch, pdl

BLOCK_V = 4096      # vocabulary columns per program of the first launch (at most: smaller vocabularies, one block)
MAX_K = 32          # larger k: the torch ops


_BIG = tl.constexpr(2147483647)


@triton.jit
def _top(x, key, K: tl.constexpr, KP2: tl.constexpr):
    """The K largest of x (any shape, no NaN) by value, ties and -inf to the lower ``key`` (unique where it
    counts; _BIG: not a candidate), as ([KP2] values, [KP2] keys), largest first. Each pick is marked taken,
    so a key is never picked twice, even among -inf values; once every candidate is taken the rest are
    (-inf, _BIG). A pick is one max over value and key packed into an int64 (the value's bits made ordered as a
    signed int above, _BIG - key below; -0.0 counted as 0.0), where a max, a min over the ties' keys and a
    fallback min were three reductions a pick, each a barrier of the program's warps."""
    j = tl.arange(0, KP2)
    vals = tl.full([KP2], float("-inf"), dtype=tl.float32)
    keys = tl.full([KP2], _BIG, dtype=tl.int32)
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)            # float order as signed int order
    packed = (ordered.to(tl.int64) << 32) | (2147483647 - key).to(tl.int64)
    none = -9223372036854775807 - 1                         # int64's least: a taken candidate
    taken = key == _BIG
    for t in range(K):                                      # K may be a launch argument
        best = tl.max(tl.reshape(tl.where(taken, none, packed), [packed.numel]), axis=0)
        hi = (best >> 32).to(tl.int32)
        v = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        c = 2147483647 - (best & 0x7FFFFFFF).to(tl.int32)
        left = best != none
        vals = tl.where((j == t) & left, v, vals)
        keys = tl.where((j == t) & left, c, keys)
        taken = taken | ((key == c) & left)
    return vals, keys


@triton.jit
def _topk_block_kernel(X, PV, PI, PM, PS, V, NB, stride_x, K: tl.constexpr, KP2: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))                  # NaN as -inf: ids in range, values meaningless
    m = tl.max(x, axis=0)
    tl.store(PM + row * NB + blk, m)
    m_safe = tl.where(m == float("-inf"), 0.0, m)         # a block of -inf only: its sum is 0, not NaN
    tl.store(PS + row * NB + blk, tl.sum(tl.exp(x - m_safe), axis=0))
    vals, idx = _top(x, cols, K, KP2)                        # the block's k largest (padding columns last)
    j = tl.arange(0, KP2)
    out = (row * NB + blk) * KP2 + j
    tl.store(PV + out, vals)
    tl.store(PI + out, idx)


@triton.jit
def _topk_merge_kernel(PV, PI, PM, PS, T, LOGP, IDS, NB, TARGETS: tl.constexpr, K: tl.constexpr,
                       KP2: tl.constexpr, NBP2: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    b = tl.arange(0, NBP2)
    m = tl.load(PM + row * NB + b, mask=b < NB, other=float("-inf"))
    s = tl.load(PS + row * NB + b, mask=b < NB, other=0.0)
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), axis=0))
    j = tl.arange(0, KP2)
    cand = (row * NB + b[:, None]) * KP2 + j[None, :]                     # [NBP2, KP2]
    ok = (b[:, None] < NB) & (j[None, :] < K)
    x = tl.load(PV + cand, mask=ok, other=float("-inf"))
    col = tl.load(PI + cand, mask=ok, other=_BIG)
    vals, idx = _top(x, col, K, KP2)
    ids = idx.to(tl.int64)
    if TARGETS:
        ids = tl.load(T + idx, mask=j < K, other=0)
    tl.store(LOGP + row * K + j, vals - lse, mask=j < K)
    tl.store(IDS + row * K + j, ids, mask=j < K)


class TopkScratch:
    """The block partials of topk_children for [rows, V] logits and k, allocated once per shape and shared
    by every call of that shape (one request at a time on one stream, as the runtime runs them)."""

    def __init__(self):
        self.bufs: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def get(self, rows: int, nb: int, kp2: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        key = (rows, nb, kp2, device)
        if key not in self.bufs:
            f32 = dict(dtype=torch.float32, device=device)
            self.bufs[key] = (torch.empty(rows, nb, kp2, **f32), torch.empty(rows, nb, kp2, dtype=torch.int32,
                                                                              device=device),
                              torch.empty(rows, nb, **f32), torch.empty(rows, nb, **f32))
        return self.bufs[key]


_SCRATCH = TopkScratch()


def topk_children(logits: torch.Tensor, targets: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tree.topk_children in two launches: logits [B, R, V] (rows contiguous) -> (log-probs
    [B, R, k] fp32, target ids [B, R, k] int64)."""
    b, r, v = logits.shape
    assert 1 <= k <= MAX_K and k <= v and logits.stride(-1) == 1
    x = logits.reshape(b * r, v)
    block = min(BLOCK_V, triton.next_power_of_2(v))
    rows, nb, kp2 = b * r, triton.cdiv(v, block), triton.next_power_of_2(k)
    pv, pi, pm, ps = _SCRATCH.get(rows, nb, kp2, logits.device)
    _topk_block_kernel[(rows, nb)](x, pv, pi, pm, ps, v, nb, x.stride(0), K=k, KP2=kp2, BLOCK=block, PDL=pdl(),
                                   num_warps=8, **launch())
    logp = torch.empty(b, r, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(b, r, k, dtype=torch.int64, device=logits.device)
    _topk_merge_kernel[(rows,)](pv, pi, pm, ps, targets if targets is not None else ids, logp, ids, nb,
                                TARGETS=targets is not None, K=k, KP2=kp2, NBP2=triton.next_power_of_2(nb),
                                PDL=pdl(), num_warps=4, **launch())
    return logp, ids


@triton.jit
def _expand_kernel(LOGP, TOK, EX_SCORE, EX_POOL, HIDDEN, SCORES, TOKENS, PARENTS, EX_TOKENS, EX_HIDDEN, EX_MASK,
                   NEXT_SCORE, NEXT_POOL, M, N, H, base, s, stride_hb, stride_hr, stride_eh, K: tl.constexpr,
                   KP2: tl.constexpr,
                   LAST: tl.constexpr, SP2: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bb = tl.program_id(0)
    r = tl.arange(0, KP2)                                   # expanded node (parent) r, its child c
    c = tl.arange(0, KP2)
    ok = (r[:, None] < K) & (c[None, :] < K)
    flat = r[:, None] * K + c[None, :]
    logp = tl.load(LOGP + bb * K * K + flat, mask=ok, other=0.0)
    tok = tl.load(TOK + bb * K * K + flat, mask=ok, other=0)
    ex_score = tl.load(EX_SCORE + bb * K + r, mask=r < K, other=0.0)
    ex_pool = tl.load(EX_POOL + bb * K + r, mask=r < K, other=0)
    cu = logp + ex_score[:, None]                           # a child's score: its log-prob + its parent's
    pool = bb * M + base + flat
    tl.store(SCORES + pool, cu, mask=ok)
    tl.store(TOKENS + pool, tok, mask=ok)
    tl.store(PARENTS + pool, ex_pool[:, None] + 0 * flat.to(tl.int64), mask=ok)
    if not LAST:
        # the k best children (ties: the lower flat index first) are the next level's expanded nodes
        j = tl.arange(0, KP2)
        best, top = _top(tl.where(ok & (cu == cu), cu, float("-inf")), tl.where(ok, flat, _BIG), K, KP2)
        parent = top // K
        tl.store(NEXT_SCORE + bb * K + j, best, mask=j < K)
        tl.store(NEXT_POOL + bb * K + j, (base + top).to(tl.int64), mask=j < K)
        tl.store(EX_TOKENS + bb * N + s + j, tl.load(TOK + bb * K * K + top, mask=j < K, other=0), mask=j < K)
        # the new node's ancestor row: its parent's (columns < s, the diagonal preset)
        col = tl.arange(0, SP2)
        prow = tl.load(EX_MASK + bb * N * N + (s - K + parent[:, None]) * N + col[None, :],
                       mask=(j[:, None] < K) & (col[None, :] < s), other=0)
        tl.store(EX_MASK + bb * N * N + (s + j[:, None]) * N + col[None, :], prow,
                 mask=(j[:, None] < K) & (col[None, :] < s))
        for h0 in range(0, H, BLOCK_H):                     # its input hidden: its parent's output
            hc = h0 + tl.arange(0, BLOCK_H)
            hv = tl.load(HIDDEN + bb * stride_hb + parent[:, None] * stride_hr + hc[None, :],
                         mask=(j[:, None] < K) & (hc[None, :] < H), other=0.0)
            tl.store(EX_HIDDEN + (bb * N + s + j[:, None]) * stride_eh + hc[None, :], hv,
                     mask=(j[:, None] < K) & (hc[None, :] < H))


def expand_level(logp: torch.Tensor, tok: torch.Tensor, ex_score: torch.Tensor, ex_pool: torch.Tensor,
                 hidden: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                 ex_tokens: torch.Tensor, ex_hidden: torch.Tensor, ex_mask: torch.Tensor, base: int, s: int,
                 last: bool, out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tree.expand_level in one launch (the same tensors, in place), the next level's expanded
    scores and pool indices written into ``out`` ([B, k] fp32 and int64, not ex_score / ex_pool) and
    returned."""
    b, k, _ = logp.shape
    n, h = ex_tokens.shape[1], hidden.shape[-1]
    assert all(t.is_contiguous() for t in (logp, tok, ex_score, ex_pool, scores, tokens, parents, ex_tokens,
                                           ex_hidden, ex_mask, *out)) and hidden.stride(-1) == 1
    _expand_kernel[(b,)](logp, tok, ex_score, ex_pool, hidden, scores, tokens, parents, ex_tokens, ex_hidden,
                         ex_mask.view(torch.int8), *out, scores.shape[1], n, h, base, s, hidden.stride(0),
                         hidden.stride(1), ex_hidden.stride(1), K=k, KP2=max(2, triton.next_power_of_2(k)), LAST=last,
                         SP2=max(2, triton.next_power_of_2(n)), BLOCK_H=min(1024, triton.next_power_of_2(h)),
                         PDL=pdl(), num_warps=4, **launch())
    return out
