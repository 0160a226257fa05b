"""Greedy verification of a chain in one launch, the round's state update in another, a drafter's greedy
pick in one.

    accept   logits [1, S, V] at the block's nodes, tokens [1, S] (root, then the drafts)
             -> speculative.accept_chain's Accepted (count [1], path [1, S], tokens [1, S]) and its
                for_host row [1, S+1], in preallocated buffers
    advance  after the drafter's commit: root <- tokens[count] (speculative.bonus), length += count + 1
    pick     draft logits [1, V] -> to_target(argmax, targets), written into a column of the block

The accept kernel runs one program per (node, column block of BLOCK_V logits): each finds its block's
maximum and that maximum's first column. The last program to arrive (an arrival counter, which it resets
for the next launch) reduces the blocks of every node (ties: the lower column, as torch.argmax), counts
the leading drafts equal to the target's greedy token after their predecessor and writes the outputs:
one launch where torch takes ten small ones (argmax, the comparison, cumprod, sum, gather, cat, ...).
A NaN logit counts as +inf (torch.argmax picks a NaN; here a +inf before it would win instead). The pick
kernel is the same for one row, its last program mapping the id and writing it into the block (in torch:
the argmax, the lookup and the copy).

The kernels let their successor launch at once (PDL): whatever follows them must wait (gdc_wait, or be
no PDL launch: the advance kernel, torch ops, the copy of the host row) before it reads their outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xcompile.runtime.decoding.kernels import launch, pdl
from xcompile.runtime.decoding.speculative import Accepted

BLOCK_V = 4096      # logits per program


@triton.jit
def _block_max(LOGITS, stride_s, r, b, V, PART_V, PART_I, NB, BLOCK_V: tl.constexpr):
    """Row r's column block b: its maximum and that maximum's first column, into the partials."""
    cols = b * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < V
    x = tl.load(LOGITS + r * stride_s + cols, mask=inside, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    m = tl.max(x, axis=0)
    tl.store(PART_V + r * NB + b, m)
    tl.store(PART_I + r * NB + b, tl.min(tl.where((x == m) & inside, cols, V), axis=0))


@triton.jit
def _argmax(PART_V, PART_I, rows, S, NB, V, NBP2: tl.constexpr):
    """Each row's argmax [len(rows)] int32 from its blocks' partials (ties: the lower column)."""
    blocks = tl.arange(0, NBP2)
    ok = (rows[:, None] < S) & (blocks[None, :] < NB)
    part = rows[:, None] * NB + blocks[None, :]
    v = tl.load(PART_V + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
    i = tl.load(PART_I + part, mask=ok, other=V, cache_modifier=".cg")
    best = tl.max(v, axis=1)
    return tl.min(tl.where(ok & (v == best[:, None]), i, V), axis=1)


@triton.jit
def _accept_kernel(LOGITS, stride_s, TOKENS, PART_V, PART_I, CNT, COUNT, PRED, HOST, S, V, NB,
                   SP2: tl.constexpr, NBP2: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _block_max(LOGITS, stride_s, tl.program_id(0), tl.program_id(1), V, PART_V, PART_I, NB, BLOCK_V)
    tl.debug_barrier()
    if tl.atomic_add(CNT, 1, sem="acq_rel") == S * NB - 1:         # the last program: every block is in
        tl.debug_barrier()
        rows = tl.arange(0, SP2)
        pred = _argmax(PART_V, PART_I, rows, S, NB, V, NBP2)                   # [SP2]: argmax per node
        # draft j+1 is kept iff it equals pred[j] and every earlier draft was kept: the count is the first
        # node whose successor is no match (the last node has none)
        nxt = tl.load(TOKENS + rows + 1, mask=rows + 1 < S, other=-1)
        miss = (nxt != pred.to(tl.int64)) | (rows + 1 >= S)
        count = tl.min(tl.where(miss, rows, SP2), axis=0).to(tl.int64)
        tl.store(COUNT, count)
        tl.store(PRED + rows, pred.to(tl.int64), mask=rows < S)
        tl.store(HOST, count)
        tl.store(HOST + 1 + rows, pred.to(tl.int64), mask=rows < S)
        tl.store(CNT, 0)


@triton.jit
def _pick_kernel(LOGITS, TARGETS, OUT, PART_V, PART_I, CNT, V, NB, MAPPED: tl.constexpr, NBP2: tl.constexpr,
                 BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _block_max(LOGITS, 0, 0, tl.program_id(0), V, PART_V, PART_I, NB, BLOCK_V)
    tl.debug_barrier()
    if tl.atomic_add(CNT, 1, sem="acq_rel") == NB - 1:
        tl.debug_barrier()
        rows = tl.arange(0, 2)
        pred = _argmax(PART_V, PART_I, rows, 1, NB, V, NBP2).to(tl.int64)
        if MAPPED:
            pred = tl.load(TARGETS + pred, mask=rows < 1, other=0)
        tl.store(OUT + rows, pred, mask=rows < 1)
        tl.store(CNT, 0)


@triton.jit
def _advance_kernel(COUNT, PRED, ROOT, LENGTH, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    c = tl.load(COUNT)
    tl.store(ROOT, tl.load(PRED + c))
    tl.store(LENGTH, tl.load(LENGTH) + c + 1)


class ChainAccept:
    """The fused greedy verification of chains of ``s`` nodes (batch 1), its outputs in buffers of its
    own that every call rewrites: ``acc`` (the Accepted, its ``path`` the constant 0..s-1) and ``host``."""

    def __init__(self, s: int, vocab: int, device: torch.device):
        i64 = dict(dtype=torch.int64, device=device)
        self.s, self.vocab = s, vocab
        self.blocks = triton.cdiv(vocab, BLOCK_V)
        self.acc = Accepted(torch.zeros(1, **i64), torch.arange(s, **i64)[None], torch.zeros(1, s, **i64))
        self.host = torch.zeros(1, s + 1, **i64)
        self.part_v = torch.empty(s * self.blocks, dtype=torch.float32, device=device)
        self.part_i = torch.empty(s * self.blocks, dtype=torch.int32, device=device)
        self.arrived = torch.zeros(1, dtype=torch.int32, device=device)    # zero between launches

    def __call__(self, tokens: torch.Tensor, logits: torch.Tensor) -> Accepted:
        """speculative.accept_chain(block, logits) for greedy verification (block.tokens = ``tokens``)."""
        assert tokens.shape == (1, self.s) and logits.shape == (1, self.s, self.vocab) and logits.stride(-1) == 1
        assert tokens.is_contiguous()
        _accept_kernel[(self.s, self.blocks)](
            logits, logits.stride(1), tokens, self.part_v, self.part_i, self.arrived, self.acc.count,
            self.acc.tokens, self.host, self.s, self.vocab, self.blocks, SP2=max(2, triton.next_power_of_2(self.s)),
            NBP2=max(2, triton.next_power_of_2(self.blocks)), BLOCK_V=BLOCK_V, PDL=pdl(), num_warps=4, **launch())
        return self.acc

    def advance(self, root: torch.Tensor, length: torch.Tensor) -> None:
        """root [1] <- the bonus token of the last call, length [1] += its count + 1."""
        _advance_kernel[(1,)](self.acc.count, self.acc.tokens, root, length, PDL=pdl(), num_warps=1, **launch())


class GreedyPick:
    """A drafter's greedy pick in one launch: the argmax of one row of draft logits, mapped through the
    draft -> target table when given (draft_tree.to_target), written into the block (its buffers of
    their own, rewritten by every call)."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.blocks = vocab, triton.cdiv(vocab, BLOCK_V)
        self.part_v = torch.empty(self.blocks, dtype=torch.float32, device=device)
        self.part_i = torch.empty(self.blocks, dtype=torch.int32, device=device)
        self.arrived = torch.zeros(1, dtype=torch.int32, device=device)    # zero between launches

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor | None, out: torch.Tensor) -> None:
        """out [1] (int64, e.g. a column of the block's tokens) <- to_target(logits.argmax(-1), targets),
        logits [1, V]."""
        assert logits.shape == (1, self.vocab) and logits.stride(-1) == 1 and out.dtype == torch.int64
        assert targets is None or (targets.is_contiguous() and targets.dtype == torch.int64)
        _pick_kernel[(self.blocks,)](logits, targets if targets is not None else out, out, self.part_v, self.part_i,
                                     self.arrived, self.vocab, self.blocks, MAPPED=targets is not None,
                                     NBP2=max(2, triton.next_power_of_2(self.blocks)), BLOCK_V=BLOCK_V, PDL=pdl(),
                                     num_warps=4, **launch())
