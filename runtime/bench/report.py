"""``xrun bench``'s report as text (runtime/bench/measure.py ``run_bench`` makes the dict; scripts/perf_tables.py
parses this text back from logs)."""

from __future__ import annotations

from xcompile.runtime.bench.paradigms import format_paradigms


def _scheme(q: dict) -> str:
    """One line of a manifest's quantization record (a checkpoint's, or the synthetic bench's)."""
    if "kind" in q:
        return f"{q['kind']} blocks {q['block']} ({q['method']})"
    return f"{q['method']}, " + ", ".join(f"{w['bits']}-bit {w['layout']} blocks {w['block']}" for w in q["weights"])


def format_report(report: dict) -> str:
    """The report as text (a report saved before 2026-12-04 has no ``prompts`` line)."""
    lines = [f"device {report['device']}  backend {report['backend']}  dtype {report['dtype']}  "
             f"model {report['model']}  max_seq_len {report['max_seq_len']}  sampling: {report['sampling']}",
             *([f"prompts: {report['prompts']}"] if "prompts" in report else []),
             *([f"quantized: {_scheme(report['quantization'])}"] if report.get("quantization") else []),
             f"copy bandwidth {report['copy_bandwidth_gbs']:.0f} GB/s",
             *([f"peak GPU memory {report['peak_memory_gb']:.1f} GB (torch's allocator)"] if "peak_memory_gb" in report
               else [])]
    if "floor_ms_per_token" in report:
        lines.append(f"weights/token {report['weight_bytes_per_token'] / 1e9:.2f} GB -> floor "
                     f"{report['floor_ms_per_token']:.3f} ms/token ({1e3 / report['floor_ms_per_token']:.0f} tok/s)")
    if report.get("floor_ms_by_context"):
        lines.append("floor counting the KV bytes read (the plain rows' % of floor): " + ", ".join(
            f"context {c} +{report['kv_bytes_per_token'][c] / 1e9:.2f} GB -> {ms:.3f} ms/token"
            for c, ms in report["floor_ms_by_context"].items()))
    if report.get("prefill"):
        p = report["prefill"]
        lines.append(f"prefill {p['tokens']} tokens: TTFT {p['ttft_ms']:.1f} ms, {p['tflops']:.1f} TFLOP/s = "
                     f"{100 * p['fraction_of_matmul']:.0f} % of the {p['matmul_tflops']:.1f} TFLOP/s matmul rate measured here")
    if report.get("peer_ms_per_token"):
        lines.append(f"peer: transformers generate (static cache) {report['peer_ms_per_token']:.3f} ms/token "
                     f"({1e3 / report['peer_ms_per_token']:.0f} tok/s)")
    if report["steps"]:
        lines += ["", f"{'step':<14}{'tokens':>7}{'eager ms':>10}{'graph ms':>10}"]
        for r in report["steps"]:
            lines.append(f"{r['graph']:<14}{r['tokens']:>7}{r['eager_ms']:>10.3f}{r.get('graph_ms', float('nan')):>10.3f}"
                         + (f"  ({r['graph_error']})" if "graph_error" in r else ""))
    taus = sorted({t for r in report["generation"] for t in r.get("speedup_at_tau", {})}, key=float)
    head = f"{'ctx':>6} {'graphs':>6} {'drafter':<26}{'ms/round':>9}{'ms/tok':>8}{'tok/s':>8}{'tau':>6}{'speedup_e2e':>12}"
    lines += ["", head + "".join(f"{'x@tau=' + t:>12}" for t in taus)]
    for r in report["generation"]:
        extra = "".join(f"{r.get('speedup_at_tau', {}).get(t, float('nan')):>12.2f}" for t in taus)
        note = f"  ({100 * r['fraction_of_floor']:.1f}% of floor)" if "fraction_of_floor" in r else ""
        lines.append(f"{r['context']:>6} {('yes' if r['cuda_graphs'] else 'no'):>6} {r['drafter']:<26}"
                     f"{r['ms_per_round']:>9.3f}{r['ms_per_token']:>8.3f}{r['tokens_per_s']:>8.1f}{r['tau']:>6.2f}"
                     f"{r.get('speedup_e2e', float('nan')):>12.2f}{extra}{note}")
    lines += format_paradigms(report.get("paradigms", []))
    lines += [f"note: {n}" for n in report.get("notes", [])]
    by_pos = [r for r in report["generation"] if r.get("acceptance_by_position")]
    if by_pos:
        lines += ["", "acceptance by position (rounds whose draft at depth i was accepted / rounds)"]
        for r in by_pos:
            lines.append(f"{r['context']:>6} {('yes' if r['cuda_graphs'] else 'no'):>6} {r['drafter']:<26}"
                         + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]))
    return "\n".join(lines)
