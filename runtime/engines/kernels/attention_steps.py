"""attention.py's inner steps: the online-softmax update of one tile of query rows over a block of keys, visible
as the tree mask says (``_attend_block``) or as each token's visible columns packed onto consecutive positions
(``_attend_packed``, KernelConfig.row_invariant; attention.py's docstring says why).
"""

from __future__ import annotations

import triton
import triton.language as tl

from xcompile.runtime.engines.kernels.qcodes import _e4m3


@triton.jit
def _online(q, k, v, visible, sm_scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """Online-softmax update of one query tile's state (m_i, l_i, acc) with the keys k, v where ``visible``
    [rows, keys]. A row that sees none of them keeps its state bit for bit (alpha 1, p 0, v finite)."""
    if IEEE:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(visible, scores * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                   # rows with nothing visible yet
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_block(q, k, v, keys, end, tok, live, TM, stride_tm, wi, M, W, sm_scale, m_i, l_i, acc,
                  IEEE: tl.constexpr):
    """_online with the keys ``keys`` (k, v) at their slots, visible as the mask says."""
    inside = keys < end
    col = keys - (wi + M - W)                                               # >= 0: a column of the mask
    in_mask = (col >= 0) & inside
    seen = tl.load(TM + tok[:, None] * stride_tm + col[None, :], mask=live[:, None] & in_mask[None, :], other=0)
    visible = ((col < 0)[None, :] | (seen != 0)) & inside[None, :]
    return _online(q, k, v, visible, sm_scale, m_i, l_i, acc, IEEE)


@triton.jit
def _attend_packed(q, KC, VC, base, keys, end, tok, live, TM, stride_tm, origin, W, sm_scale, m_i, l_i, acc,
                   WP2: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr, KV8: tl.constexpr, NATIVE: tl.constexpr):
    """_online over the keys ``keys`` as each token's visible mask columns packed in column order onto
    origin, origin + 1, ... (row_invariant): a tree node's ancestors then sit where plain decoding holds them
    (its depth-i ancestor at origin + i) in the same key steps and splits, so it sums them in the same grouping
    and a node's row is the bits of its token decoded alone. One pass per token of the tile, each reading its
    own keys (those below origin as they are; a second tile kept live across the passes spilled registers).
    Every row_invariant call takes it for its tiles from origin on, one row and chains included: on an H100 the
    shared tiles (_attend_block) and these passes rounded 2 of 24 tree rows an ulp apart over the same keys."""
    c = tl.arange(0, WP2)
    d = tl.arange(0, D)
    i = keys - origin                                                       # a lane's packed index (< 0: cached)
    for tk in range(tl.min(tok, axis=0), tl.max(tl.where(live, tok, -1), axis=0) + 1):    # the tile's tokens
        seen = tl.cumsum((tl.load(TM + tk * stride_tm + c, mask=c < W, other=0) != 0).to(tl.int32), axis=0)
        # the i-th visible column: how many columns have at most i visible ones up to and including them
        col = tl.sum((seen[None, :] <= i[:, None]).to(tl.int32), axis=1)
        ok = (keys < end) & (i < tl.max(seen, axis=0))
        offs = base + tl.where(i < 0, keys, origin + col)[:, None] * D + d[None, :]
        k = tl.load(KC + offs, mask=ok[:, None], other=0)
        v = tl.load(VC + offs, mask=ok[:, None], other=0)
        if KV8:
            k, v = _e4m3(k, NATIVE).to(q.dtype), _e4m3(v, NATIVE).to(q.dtype)
        m_i, l_i, acc = _online(q, k, v, (tok == tk)[:, None] & ok[None, :], sm_scale, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc
