"""The EAGLE3 drafters: the head's chain, and the EAGLE-2 dynamic tree (docs/eagle3.md §3-4); and the MTP
drafters, the same rounds over an MTP module (compile/models/mtp.py), which reads the target's last layer
output as it is where EAGLE3 reads ``fc`` of three taps, and drafts over its draft vocabulary (d2t) or the whole
target vocabulary.

Draft position t pairs the target feature at t with the token at t+1; ``fc`` applies to target taps only, the
head's own pre-norm output is fed back as is; the persistent draft KV holds only entries computed from target
features; tree-expansion entries are temporary, written past the persistent length, and the next round's update
overwrites them.
"""

from __future__ import annotations

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding import kernels
from xcompile.runtime.decoding.draft_tree import expand_level, select_tree, target_table, topk_children
from xcompile.runtime.decoding.drafters.base import Drafter, advance, causal, prompt_pass
from xcompile.runtime.decoding.registry import TreeShape
from xcompile.runtime.decoding.speculative import Block, chain_block
from xcompile.runtime.enginedir.contract import EAGLE3, EAGLE3_FC, MTP
from xcompile.runtime.engines.base import Engine


class _Eagle3(Drafter):
    """What the chain and the tree share: the prompt pass, the per-round update, the d2t map. ``fc`` None: the
    step engine is an MTP module, whose hidden input is the target feature itself. ``columns``: the columns of
    the target's hidden_taps this drafter reads (None: all), when the target taps for both EAGLE3 (its three
    layers first) and MTP (the last layer, last)."""

    needs_taps = True

    def __init__(self, eagle3: Engine, fc: Engine | None, d2t: torch.Tensor | None, max_depth: int, block_size: int,
                 lookahead: int, columns: slice | None = None):
        graphs = (eagle3.spec.graph, fc.spec.graph if fc else None)
        if graphs not in ((EAGLE3, EAGLE3_FC), (MTP, None)):
            raise EngineError(f"{self.name} drafter needs '{EAGLE3}' and '{EAGLE3_FC}' engines, or one '{MTP}' "
                              f"engine, got {', '.join(repr(g) for g in graphs if g)}")
        super().__init__(max_depth, block_size, lookahead, engines=(eagle3, fc) if fc else (eagle3,))
        self.eagle3, self.fc, self.columns = eagle3, fc, columns
        self.prompt_engines = (eagle3,)                       # fc runs once a prompt, at any row count
        self.d2t = None if d2t is None else check_d2t(d2t).to(eagle3.device)
        self.targets = target_table(self.d2t)                 # draft id -> target id, one lookup

    def _features(self, taps: torch.Tensor) -> torch.Tensor:
        """The hidden input [B, S, H] of the step from target taps [B, S, *]: ``fc`` of EAGLE3's columns, or
        the MTP module's column block as it is."""
        if self.columns is not None:
            taps = taps[..., self.columns].contiguous()      # engines bind dense buffers
        return taps if self.fc is None else self.fc.run(hidden_taps=taps)["hidden_states"]

    def _alloc(self, device, batch):
        d = self.max_depth
        self.update_mask = causal(d + 1, device, batch)
        self.update_offsets = torch.arange(d + 1, device=device)
        self.length = torch.zeros(batch, dtype=torch.int64, device=device)
        # made by the first _seed (the engines do not declare the hidden width)
        self.hidden = None          # [B, 1, H] pre-norm draft output at the last persistent position
        self.logits = None          # [B, 1, Vd] its draft logits (the first draft token's scores)

    def _seed(self, out: dict[str, torch.Tensor], row: torch.Tensor) -> None:
        """Keep the draft output at ``row`` [B] (copied: an engine may reuse its output buffers): its hidden,
        and its logits unless ``_early_pick`` used them."""
        h = out["hidden_out"]
        index = row[:, None, None].expand(-1, 1, h.shape[-1])
        if self.hidden is None:
            self.hidden = h.gather(1, index)
        else:
            torch.gather(h, 1, index, out=self.hidden)                          # one launch: no copy after
        if self._early_pick(out["logits"]):
            return
        if self.logits is None:
            self.logits = out["logits"].clone()
        else:
            self.logits.copy_(out["logits"])

    def _early_pick(self, logits: torch.Tensor) -> bool:
        """Whether the next round's first draft was taken from ``logits`` [B, 1, Vd] now (so they need not
        be kept)."""
        return False

    def start(self, prompt, taps, root):
        # pairing: feature t goes with token t+1, so the prompt shifted left with the root appended
        tokens = torch.cat((prompt[:, 1:], root[:, None]), dim=1)
        out, last, _ = prompt_pass(self.eagle3, tokens, {"hidden_states": self._features(taps)},
                                   steps=self.prompt_steps.get(self.eagle3))
        self._seed(out, last)
        self.length.fill_(prompt.shape[1])

    def commit(self, block, acc, taps, length):
        # Persistent update over the accepted path: the feature of path node j (position length+j) pairs
        # with the token at length+j+1, i.e. the next accepted draft or, at j = a, the bonus: acc.tokens.
        # Fixed S = max_depth+1: rows past a come from padding and write KV past the new length, which
        # nothing reads before the next round's update overwrites it.
        # A chain's path is its nodes 0..D in order (speculative.Block): the taps as they are, and the verify's
        # positions (write_index + depth) are the update's too.
        d1 = acc.path.shape[1]
        chain = block.chain and taps.shape[1] == d1
        feats = taps if chain else taps.gather(1, acc.path[:, :, None].expand(-1, -1, taps.shape[-1]))  # [B, D+1, *]
        hidden = self._features(feats)
        pos = block.positions if chain and block.positions is not None else length[:, None] + self.update_offsets
        out = self.eagle3.run(input_ids=acc.tokens, hidden_states=hidden, position_ids=pos, write_index=length,
                              tree_mask=self.update_mask, logit_rows=acc.count[:, None])
        self._seed(out, acc.count)
        if self.track:
            advance(self.length, length, acc)

    def feed(self, tokens: torch.Tensor, taps: torch.Tensor, write_index: torch.Tensor, rows: torch.Tensor) -> None:
        """One causal pass over tokens [B, S] at positions write_index [B] + 0..S-1, token j paired with the
        target's taps [B, S, *] at row j, written at ``write_index``; the next proposal starts from row ``rows``
        [B] of each sequence. The batch loop's step (batch_drafts.py): a sequence's rows are its accepted
        tokens and bonus, or a chunk of its prompt shifted by one."""
        b, s = tokens.shape
        dev = tokens.device
        out = self.eagle3.run(input_ids=tokens, hidden_states=self._features(taps),
                              position_ids=write_index[:, None] + torch.arange(s, device=dev),
                              write_index=write_index, tree_mask=causal(s, dev, b), logit_rows=rows[:, None])
        self._seed(out, rows)

    def caches(self):
        return [(self.eagle3.kv, self.length, 0)]


class Eagle3ChainDrafter(_Eagle3):
    """k tokens per round: the first from the update's output, then k-1 single-token steps."""

    name = "eagle3"

    def __init__(self, eagle3_engine: Engine, fc_engine: Engine | None, d2t: torch.Tensor | None, k: int,
                 columns: slice | None = None):
        if k < 1:
            raise EngineError(f"{self.name} chain drafter: k must be >= 1, got {k}")
        super().__init__(eagle3_engine, fc_engine, d2t, max_depth=k, block_size=k + 1, lookahead=k + 1,
                         columns=columns)
        self.k = k

    def _alloc(self, device, batch):
        super()._alloc(device, batch)
        self.block = chain_block(torch.zeros(batch, self.k + 1, dtype=torch.int64, device=device))
        self.one_mask = causal(1, device, batch)
        self.row0 = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        # length + 0..k: the draft steps' positions (the first k-1), the verify's and the update's
        self.block.positions = torch.zeros(batch, self.k + 1, dtype=torch.int64, device=device)

    def _early_pick(self, logits):
        # greedy: the first draft is the argmax of the update's logits, so it is picked as they are made (no
        # copy of them, no launch in the next round); sampling keeps the draw in the round that uses it. A
        # request's sampler mode is set before its start and holds to its end, so propose sees the same one.
        if self.sampler.greedy:
            self._pick(self.block, 1, logits[:, 0], self.targets)
        return self.sampler.greedy

    def propose(self, root, length):
        t = self.block.tokens
        t[:, 0] = root
        if not self.sampler.greedy:                                             # else _early_pick took it
            self._pick(self.block, 1, self.logits[:, 0], self.targets)
        hidden = self.hidden
        pos = torch.add(length[:, None], self.block.depth, out=self.block.positions)   # [B, k+1], one launch
        for i in range(1, self.k):
            # draft position length+i-1 pairs the previous step's output with draft i, predicting draft i+1;
            # the entry is temporary (past the persistent length)
            out = self.eagle3.run(input_ids=t[:, i:i + 1], hidden_states=hidden, position_ids=pos[:, i - 1:i],
                                  write_index=pos[:, i - 1], tree_mask=self.one_mask, logit_rows=self.row0)
            self._pick(self.block, i + 1, out["logits"][:, 0], self.targets)
            hidden = out["hidden_out"]
        return self.block


class Eagle3TreeDrafter(_Eagle3):
    """EAGLE-2 dynamic tree (docs/eagle3.md §4.1), with our names:

    topk          children kept per expanded node, and nodes expanded per level
    depth         longest drafted path (EAGLE's ``depth`` + 1; sglang's ``num_steps``); depth-1 expansions
    total_tokens  tokens verified per round, the root included (EAGLE's ``total_token``)

    Each expansion is one draft step over the topk nodes of one level, appended to the draft KV
    after the levels before it (temporary entries past the persistent length). Its tree_mask covers
    every expanded node so far (the contract's ``mask_keys``: columns from the persistent length on),
    so a node sees the committed prefix, its ancestors and itself, and neither its siblings nor the
    other branches.
    """

    name = "eagle3-tree"
    chains = False

    def __init__(self, eagle3_engine: Engine, fc_engine: Engine | None, d2t: torch.Tensor | None, topk: int,
                 depth: int, total_tokens: int, fused: bool | None = None, columns: slice | None = None):
        pool = topk + (depth - 1) * topk * topk
        if topk < 1 or depth < 1 or not 2 <= total_tokens <= pool + 1:
            raise EngineError(f"{self.name} tree: need topk >= 1, depth >= 1 and 2 <= total_tokens <= {pool + 1} "
                              f"(1 + topk + (depth-1)*topk^2 candidates), got topk={topk} depth={depth} "
                              f"total_tokens={total_tokens}")
        super().__init__(eagle3_engine, fc_engine, d2t, max_depth=depth, block_size=total_tokens,
                         lookahead=TreeShape(topk, depth, total_tokens).lookahead, columns=columns)
        if self.d2t is not None and topk > self.d2t.numel():
            raise EngineError(f"{self.name}: topk {topk} exceeds the draft vocabulary ({self.d2t.numel()})")
        self.topk, self.depth, self.total_tokens, self.pool = topk, depth, total_tokens, pool
        self.fused = fused          # the tree kernels (None: on a CUDA device with triton; True: also interpreted)

    def _alloc(self, device, batch):
        super()._alloc(device, batch)
        k, n = self.topk, self.topk * (self.depth - 1)      # n: expanded nodes, all levels
        i64 = dict(dtype=torch.int64, device=device)
        self.scores = torch.zeros(batch, self.pool, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(batch, self.pool, **i64)
        self.parents = torch.full((batch, self.pool), -1, **i64)    # the root's children keep -1
        # expanded nodes, level by level (k per level): token, input hidden (made on first use), ancestor mask
        self.ex_tokens = torch.zeros(batch, n, **i64)
        self.ex_hidden = None
        self.ex_mask = torch.eye(n, dtype=torch.bool, device=device).repeat(batch, 1, 1)
        # a level-j node (j = 1..depth-1) sits at target position length+j and is expanded at draft
        # position length+j-1 (pairing §3.1), its K/V written at slot length + k*(j-1) + its index
        self.ex_offsets = torch.arange(n, device=device) // k
        self.ex_slots = k * torch.arange(max(self.depth - 1, 1), device=device)   # level's first KV slot past length
        self.ex_rows = torch.arange(k, device=device).expand(batch, k)
        self.expand_index = torch.arange(k, device=device).repeat(batch, 1)   # pool index of the expanded level 1
        # With the tree kernels (kernels/topk.py, tree.py: by default on a CUDA device with triton), each
        # level's top-k and pool update and the selection are a few launches, not torch's small ops; the next
        # level's scores and pool indices alternate between two buffers
        self.tree, self.children, self.expand = None, topk_children, expand_level
        fits = k <= 32 and self.pool <= 2048 and self.total_tokens <= 64     # the kernels' tiles in registers
        if fits and kernels.use_fused(self.fused, device):
            from xcompile.runtime.decoding.kernels import topk
            from xcompile.runtime.decoding.kernels.tree import TreeBuffers
            self.tree, self.children, self.expand = TreeBuffers(batch, self.total_tokens - 1, device), \
                topk.topk_children, topk.expand_level
            self.ex_state = [(torch.zeros(batch, k, device=device), torch.zeros(batch, k, **i64)) for _ in range(2)]

    def propose(self, root, length):
        k = self.topk
        fused = self.tree is not None
        logp, tok = self.children(self.logits, self.targets, k)                # [B, 1, k]: the root's children
        self.scores[:, :k], self.tokens[:, :k] = logp[:, 0], tok[:, 0]
        if self.depth > 1:
            if self.ex_hidden is None:
                self.ex_hidden = self.hidden.new_zeros(self.hidden.shape[0], self.ex_tokens.shape[1],
                                                       self.hidden.shape[-1])
            self.ex_tokens[:, :k] = tok[:, 0]
            self.ex_hidden[:, :k] = self.hidden
        ex_score, ex_pool = logp[:, 0], self.expand_index
        base = k
        # every level's positions and first KV slot at once (each level takes its slice: no kernel per level)
        pos, slots = length[:, None] + self.ex_offsets, length[:, None] + self.ex_slots
        for level in range(1, self.depth):
            s = k * level                                                        # nodes expanded after this step
            new = slice(s - k, s)                                                # this level's nodes
            out = self.eagle3.run(input_ids=self.ex_tokens[:, new], hidden_states=self.ex_hidden[:, new],
                                  position_ids=pos[:, new], write_index=slots[:, level - 1],
                                  tree_mask=self.ex_mask[:, new, :s], logit_rows=self.ex_rows)
            logp, tok = self.children(out["logits"], self.targets, k)           # [B, k, k]
            # the children into the pool; the k best of them (but after the last level) are expanded next
            into = {"out": self.ex_state[level % 2]} if fused else {}       # the kernel's next-level buffers
            ex_score, ex_pool = self.expand(logp, tok, ex_score, ex_pool, out["hidden_out"], self.scores,
                                            self.tokens, self.parents, self.ex_tokens, self.ex_hidden, self.ex_mask,
                                            base, s, last=level == self.depth - 1, **into)
            base += k * k
        if not fused:
            return select_tree(root, self.scores, self.tokens, self.parents, self.total_tokens - 1, self.depth)
        from xcompile.runtime.decoding.kernels.tree import select_tree_into
        t = self.tree
        select_tree_into(t, root, self.scores, self.tokens, self.parents, self.depth)
        return Block(t.tokens, t.parents, t.mask, t.depth, self.depth, chain=False)


class MTPChainDrafter(Eagle3ChainDrafter):
    """An MTP module's chain of k tokens: EAGLE3's chain over the target's last layer output (``d2t``: the
    module's draft vocabulary; None: the whole vocabulary)."""

    name = "mtp"

    def __init__(self, mtp_engine: Engine, k: int, columns: slice | None = None, d2t: torch.Tensor | None = None):
        super().__init__(mtp_engine, None, d2t, k, columns)


class MTPTreeDrafter(Eagle3TreeDrafter):
    """An MTP module's EAGLE-2 dynamic tree (the EAGLE3 tree's rounds, over its draft vocabulary or the whole)."""

    name = "mtp-tree"

    def __init__(self, mtp_engine: Engine, topk: int, depth: int, total_tokens: int, fused: bool | None = None,
                 columns: slice | None = None, d2t: torch.Tensor | None = None):
        super().__init__(mtp_engine, None, d2t, topk, depth, total_tokens, fused, columns)


def check_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """d2t [draft_vocab] int64 offsets: target = draft + d2t[draft] must be injective and >= 0."""
    if d2t.dim() != 1 or d2t.dtype != torch.int64:
        raise EngineError(f"d2t must be a 1-D int64 tensor of offsets, got {tuple(d2t.shape)} {d2t.dtype}")
    target = target_table(d2t)
    if bool((target < 0).any()) or target.unique().numel() != target.numel():
        raise EngineError("a draft vocabulary's d2t maps draft ids to negative or repeated target ids (the engine "
                          "dir's d2t.safetensors or mtp_d2t.safetensors is damaged); re-export the dir")
    return d2t
