"""The three drafting paradigms side by side (a draft model, EAGLE3, MTP): the design's columns, derived from one
``xrun bench`` report (measure.py) at its speculation context, in its graph mode (CUDA graphs where it has them).

    alpha   per position i, the rounds whose draft i was accepted over those whose draft i-1 was (the
            acceptance rate of a token given its parent's; position 1 over all rounds)
    gamma   drafts per round (a chain's gamma, a tree's total_tokens - 1)
    c       draft cost / verify cost: (ms per round - one verify of the round's block) / that verify, so the
            drafter's steps and the round's bookkeeping against the target pass they feed
    tau     tokens per round (bonus included), measured
    speedup plain ms/token over the drafter's, measured in the same run
and, for comparison with the design's formula, the speedup a chain would give at tau (tau / (1 + c) times the
verify's cost over a decode step's).
"""

from __future__ import annotations

PARADIGMS = {"draft-model": "draft model", "eagle3": "EAGLE3", "eagle3-tree": "EAGLE3", "mtp": "MTP",
             "mtp-tree": "MTP"}


def paradigm_rows(report: dict) -> list[dict]:
    """One row per speculative generation row at the speculation context (graphed where measured so)."""
    ctx = report.get("speculation_context")
    rows = [r for r in report["generation"] if r["context"] == ctx]
    graphs = any(r["cuda_graphs"] for r in rows)
    verify = {s["tokens"]: s.get("graph_ms", s["eager_ms"]) if graphs else s["eager_ms"]
              for s in report["steps"] if s["graph"] == "target" and s["context"] == ctx}
    out = []
    for r in rows:
        if r["cuda_graphs"] != graphs or r["drafter"] == "plain" or "block_size" not in r:
            continue
        v = verify.get(r["block_size"])
        cumulative = [1.0, *r["acceptance_by_position"]]
        alpha = [b / a if a else 0.0 for a, b in zip(cumulative, cumulative[1:])]
        out.append({"paradigm": PARADIGMS.get(r["paradigm"], r["paradigm"]), "drafter": r["drafter"],
                    "gamma": r["block_size"] - 1, "alpha": alpha, "tau": r["tau"],
                    "draft_over_verify": (r["ms_per_round"] - v) / v if v else None,
                    "verify_ms": v, "ms_per_round": r["ms_per_round"], "speedup": r.get("speedup_e2e")})
    return out


def format_paradigms(rows: list[dict]) -> list[str]:
    """The table as text lines (empty without speculative rows)."""
    if not rows:
        return []
    lines = ["", "three paradigms (c = draft cost / verify cost; alpha per position: accepted given the one "
             "before accepted)",
             f"{'paradigm':<12}{'drafter':<26}{'gamma':>6}{'verify ms':>10}{'c':>7}{'tau':>6}{'speedup':>8}  alpha"]
    for r in rows:
        c = "-" if r["draft_over_verify"] is None else f"{r['draft_over_verify']:.2f}"
        v = "-" if r["verify_ms"] is None else f"{r['verify_ms']:.3f}"
        s = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        lines.append(f"{r['paradigm']:<12}{r['drafter']:<26}{r['gamma']:>6}{v:>10}{c:>7}{r['tau']:>6.2f}{s:>8}  "
                     + " ".join(f"{a:.2f}" for a in r["alpha"]))
    return lines
