"""Drafters: what proposes the block the target verifies each round (base.py has the interface)."""

from xcompile.runtime.decoding.drafters.base import (
    Drafter,
    NoDrafter,
    advance,
    causal,
    prompt_inputs,
    prompt_pass,
    step_rows,
)
from xcompile.runtime.decoding.drafters.draft_model import DraftModelDrafter
from xcompile.runtime.decoding.drafters.eagle3 import (
    Eagle3ChainDrafter,
    Eagle3TreeDrafter,
    MTPChainDrafter,
    MTPTreeDrafter,
    check_d2t,
)

__all__ = ["Drafter", "NoDrafter", "DraftModelDrafter", "Eagle3ChainDrafter", "Eagle3TreeDrafter", "MTPChainDrafter",
           "MTPTreeDrafter", "advance", "causal", "check_d2t", "prompt_inputs", "prompt_pass", "step_rows"]
