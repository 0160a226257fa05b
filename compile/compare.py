"""How ``xcompile diff`` judges one output of one step against the PyTorch reference, scale-aware:

    logits          max abs error <= atol, and a flipped argmax only on a near-tie (the reference ranks
                    the engine's choice within atol of its best); top-1 agreement and top-5 overlap reported
    hidden states   max abs error / max |reference| <= rtol, and the least cosine similarity over rows
                    (tokens) >= MIN_COSINE: taps reach ~100, where per-element tolerances fail a correct
                    export on elements near zero, and one token gone wrong shows in its row's cosine
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Default tolerances by dtype. Logits: max abs error (TensorRT-LLM compares fp16 logits at 0.12);
# fp32 engines match the reference to ~1e-5. Hidden states (taps, EAGLE3 hidden) are compared to
# their own scale, since their values reach ~100 where per-element tolerances fail on elements near
# zero: max error / max |reference| and, per row (token), cosine similarity (as TensorRT-Edge-LLM
# checks layers). bf16 keeps 8 mantissa bits: ~0.4% relative per rounding.
DEFAULT_ATOL = {"fp32": 1e-3, "fp16": 0.12, "bf16": 0.25}           # logits, absolute
DEFAULT_RTOL = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 3e-2}           # hidden states, relative to max |ref|
MIN_COSINE = {"fp32": 0.99999, "fp16": 0.999, "bf16": 0.995}        # hidden states, least row cosine


@dataclass
class StepResult:
    """One output of one graph at one step: errors against the reference and whether it passed."""

    graph: str
    step: str
    output: str
    max_abs: float
    mean_abs: float
    max_rel: float                              # max_abs / max |reference|
    cosine: float                               # least cosine similarity over rows (last axis)
    passed: bool
    top1: float | None = None                   # logits: fraction of rows whose argmax agrees
    top5: float | None = None                   # logits: mean overlap of the top-5 sets
    why: str = ""                               # the failed criteria


def _agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Top-1 agreement and mean top-5 overlap over the rows of logits [..., V]."""
    ref, got = ref.float().reshape(-1, ref.shape[-1]), got.float().reshape(-1, got.shape[-1])
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    k = min(5, ref.shape[-1])
    a, b = ref.topk(k, -1).indices, got.topk(k, -1).indices
    return top1, ((a[:, :, None] == b[:, None, :]).any(-1).float().sum(-1) / k).mean().item()


def tolerances(output: str, dtype: str, atol: dict, rtol: dict) -> dict[str, float]:
    """The criteria one output is held to: logits max abs error, hidden states relative error and
    cosine; ``atol`` / ``rtol`` (output or "" -> value) add to or override the defaults."""
    c = {"atol": DEFAULT_ATOL[dtype]} if output == "logits" else {"rtol": DEFAULT_RTOL[dtype],
                                                                   "cosine": MIN_COSINE[dtype]}
    for key in ("", output):
        if key in atol:
            c["atol"] = atol[key]
        if key in rtol:
            c["rtol"] = rtol[key]
    return c


def compare(graph: str, step: str, output: str, ref: torch.Tensor, got: torch.Tensor, criteria: dict) -> StepResult:
    """One output at one step against the reference (see the module docstring)."""
    ref, got = ref.double(), got.double()
    err = (got - ref).abs()
    max_abs, scale = err.max().item(), ref.abs().max().item()
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    rows_ref, rows_got = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    cosine = torch.nn.functional.cosine_similarity(rows_ref, rows_got, dim=-1, eps=1e-30).min().item() \
        if ref.numel() else 1.0
    why = []
    if "atol" in criteria and not max_abs <= criteria["atol"]:
        why.append(f"max_abs > {criteria['atol']:g}")
    if "rtol" in criteria and not max_rel <= criteria["rtol"]:
        why.append(f"max_rel > {criteria['rtol']:g}")
    if "cosine" in criteria and not cosine >= criteria["cosine"]:
        why.append(f"cosine < {criteria['cosine']:g}")
    top1 = top5 = None
    if output == "logits":
        top1, top5 = _agreement(ref, got)
        # a flipped argmax passes only on a near-tie: the reference ranks the engine's choice within tolerance
        picked = rows_ref.gather(-1, rows_got.argmax(-1, keepdim=True)).squeeze(-1)
        if bool((rows_ref.max(-1).values - picked > criteria.get("atol", 0.0)).any()):
            why.append("top-1 differs beyond a near-tie")
    return StepResult(graph, step, output, max_abs, err.mean().item(), max_rel, cosine, not why, top1, top5,
                      ", ".join(why))
