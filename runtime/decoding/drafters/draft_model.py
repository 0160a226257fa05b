"""The draft-model drafter: a small Qwen3 on the target's tokenizer drafts a chain, one forward a token."""

from __future__ import annotations

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.drafters.base import Drafter, advance, causal, prompt_pass
from xcompile.runtime.decoding.speculative import chain_block
from xcompile.runtime.enginedir.contract import DRAFT, TARGET
from xcompile.runtime.engines.base import Engine


class DraftModelDrafter(Drafter):
    """A small Qwen3 with the target's tokenizer drafts k tokens, one forward each.

    Its KV tracks the target's: after a round it holds the committed tokens, except that when every
    draft was accepted the last one was never run. So each round's first step runs [token before the
    root, root] at length-1 (S=2, fixed): it rewrites a row that may be stale and resyncs for free.
    """

    name = "draft-model"

    def __init__(self, engine: Engine, k: int):
        if engine.spec.graph not in (DRAFT, TARGET):
            raise EngineError(f"draft-model drafter needs a '{DRAFT}' graph engine, got '{engine.spec.graph}'")
        if k < 1:
            raise EngineError(f"draft-model drafter: k must be >= 1, got {k}")
        super().__init__(max_depth=k, block_size=k + 1, lookahead=k + 1, engines=(engine,))
        self.engine, self.k = engine, k

    def _alloc(self, device, batch):
        self.block = chain_block(torch.zeros(batch, self.k + 1, dtype=torch.int64, device=device))
        self.pair = torch.zeros(batch, 2, dtype=torch.int64, device=device)     # [token before the root, root]
        self.pair_mask = causal(2, device, batch)
        self.one_mask = causal(1, device, batch)
        self.offsets = torch.arange(-1, self.k, device=device)                 # positions of the steps - length
        self.row0 = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        self.row1 = self.row0 + 1
        self.length = torch.zeros(batch, dtype=torch.int64, device=device)

    def start(self, prompt, taps, root):
        prompt_pass(self.engine, prompt, steps=self.prompt_steps.get(self.engine))
        self.pair[:, 0] = prompt[:, -1]
        self.length.fill_(prompt.shape[1])

    def propose(self, root, length):
        t = self.block.tokens
        t[:, 0] = root
        self.pair[:, 1] = root
        pos = length[:, None] + self.offsets                                    # [B, k+1]
        out = self.engine.run(input_ids=self.pair, position_ids=pos[:, :2], write_index=pos[:, 0],
                              tree_mask=self.pair_mask, logit_rows=self.row1)
        self._pick(self.block, 1, out["logits"][:, 0])
        for i in range(1, self.k):
            # draft token i at position length+i predicts draft token i+1
            out = self.engine.run(input_ids=t[:, i:i + 1], position_ids=pos[:, i + 1:i + 2],
                                  write_index=pos[:, i + 1], tree_mask=self.one_mask, logit_rows=self.row0)
            self._pick(self.block, i + 1, out["logits"][:, 0])
        return self.block

    def commit(self, block, acc, taps, length):
        # the last accepted node (the root when nothing was accepted) precedes the next root
        self.pair[:, 0] = block.tokens.gather(1, acc.count[:, None])[:, 0]
        if self.track:
            advance(self.length, length, acc)

    def caches(self):
        # the row before the next root is rewritten by the next propose (it is stale after a full accept)
        return [(self.engine.kv, self.length, 1)]
