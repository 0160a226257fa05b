"""The generation loop's kernels: greedy chain verification and the round's state update, a drafter's greedy
pick (accept.py), the EAGLE-2 tree's per-level top-k and candidate pool (topk.py) and its selection (tree.py),
the warped draw of a sampled token (sample.py) and speculative sampling of a chain or a tree of deterministic
drafts (accept_sampled.py, accept_sampled_tree.py).

Each replaces a handful of torch's small launches with one or two; each is tested against the torch ops it
replaces (runtime/decoding/speculative.py), in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import torch

from xcompile.runtime.common.gpu import available, interpreted, launch_options, pdl_capable

SAMPLE_MAX_K = 32       # the largest top-k sample.py draws (larger: the torch ops)


def use_fused(fused: bool | None, device: torch.device) -> bool:
    """Whether the loop's and drafters' kernels run, from their ``fused`` option: None on a CUDA device with
    triton, True also in Triton's interpreter, False never."""
    runs = available() and (device.type == "cuda" or interpreted())
    return fused is not False and runs and (bool(fused) or device.type == "cuda")


def pdl() -> bool:
    """The kernels' PDL constexpr: programmatic dependent launch where the GPU has it."""
    return pdl_capable()


def launch() -> dict:
    """Launch options of every loop kernel."""
    return launch_options(pdl_capable())
