#!/usr/bin/env python3
"""Rewrite the figure tables of docs/performance.md and README.md from the raw results kept in docs/perf/.

    python3 scripts/perf_tables.py            # rewrite every table in place
    python3 scripts/perf_tables.py --check    # exit 1, naming the tables, when a page differs from its results

A page holds generated text only between ``<!-- table:NAME -->`` and ``<!-- /table -->``; NAME is a key of
TABLES. docs/perf/sources.json describes every result file: the tables it feeds (``tables``), when, where and
how it was measured (``date``, ``machine``, ``command``, required) and optionally its column ``label`` (a list for
a log holding several reports) and a ``note``. A table is built from the files tagged with its source tag that
share the newest date among them, one column per report, so a newer result tagged the same way replaces the
older ones. A file no table reads, or a table no page shows, is an error (docs/perf keeps what the current tables
stand on, nothing else).

Result files: ``xrun bench --json FILE`` reports (*.json, runtime/bench/measure.py ``run_bench``) or logs
(*.log) of xrun bench's text report (runtime/bench/report.py ``format_report``; a log may hold several), of
benchmarks/fast_agreement.py, of scripts/demo.sh, or of a benchmarks/ script that ends with a JSON report
(export_8b.py, verify_speed.py), or benchmarks/serve_load.py's ``--json`` report. Standard library only: the check runs in CI in a second.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "docs" / "perf"
PAGES = (ROOT / "docs" / "performance.md", ROOT / "README.md")
SOURCES = "sources.json"
REQUIRED = ("tables", "date", "machine", "command")


@dataclass(frozen=True)
class Table:
    source: str                     # the tag in sources.json
    kind: str                       # bench | tau | paradigms | agreement | demo | json | load | batch
    rows: tuple[str, ...] = ()      # bench: keep only rows whose label starts with one of these (empty: all)
    # json: (label, key, format, scale) of the rows, read from the last JSON object a script printed
    fields: tuple[tuple[str, str, str, float], ...] = ()


def _quality(base: str) -> tuple[tuple[str, str, str, float], ...]:
    """The rows of a quality report against ``base`` (benchmarks/quant_quality.py, kv_cache_quality.py)."""
    return (("top-1 agreement with " + base + ", teacher-forced", "agreement", "{:.2f} %", 100),
            ("held-out perplexity", "perplexity", "{:.3f}", 1),
            ("perplexity against " + base, "perplexity_delta", "{:+.2f} %", 100),
            ("EAGLE3 τ, chain of 4, greedy", "tau", "{:.3f}", 1),
            ("τ against " + base, "tau_delta", "{:+.2f} %", 100))


def _json_cell(rep: dict, key, fmt: str, scale: float) -> str:
    """A json table's cell: rep[key] (key a name, or a function of the report for a figure derived from its
    fields), "—" where the run did not measure it."""
    value = key(rep) if callable(key) else rep.get(key)
    return "—" if value is None else fmt.format(value * scale)


def _spread(field: str):
    """A report's {length: ms} ``field`` -> "median ms, slowest = Nx the median" (None without it)."""
    def cell(rep: dict) -> str | None:
        times = list(rep.get(field, {}).values())
        if not times:
            return None
        median = statistics.median(times)
        return f"median {median:.1f} ms, slowest {max(times):.1f} ms = {max(times) / median:.2f}x"
    return cell


TABLES = {
    "bench-8b": Table("bench-8b", "bench"),
    "bench-8b-quantized": Table("bench-8b-quantized", "bench"),
    "bench-8b-int4-qgemv": Table("bench-8b-int4-qgemv", "bench", ("decode floor", "plain decode, context",
                                                                  "decode step", "verify", "EAGLE3 chain round")),
    "bench-8b-qgemv8": Table("bench-8b-qgemv8", "bench", ("decode floor", "plain decode, context", "decode step",
                                                          "verify", "EAGLE3 draft step", "EAGLE3 chain round",
                                                          "EAGLE3 tree round")),
    "bench-8b-qgemv-h200": Table("bench-8b-qgemv-h200", "bench", ("decode floor", "plain decode, context",
                                                                  "decode step", "verify", "EAGLE3 draft step",
                                                                  "EAGLE3 chain round", "EAGLE3 tree round")),
    "bench-8b-sampling-h100": Table("bench-8b-sampling-h100", "bench"),
    "bench-8b-row-invariant-h200": Table("bench-8b-row-invariant-h200", "bench"),
    "bench-8b-row-invariant-h100": Table("bench-8b-row-invariant-h100", "bench"),
    "long-8b-h100": Table("long-8b-h100", "bench", ("decode floor", "plain decode, context", "decode step",
                                                    "verify", "EAGLE3 chain round", "prefill")),
    "long-even-8b-h100": Table("long-even-8b-h100", "bench", ("decode floor", "plain decode, context", "decode step",
                                                              "verify", "EAGLE3 chain round", "EAGLE3 tree round",
                                                              "prefill")),
    "long-128k-8b-h100": Table("long-128k-8b-h100", "bench", ("decode floor", "plain decode, context", "decode step",
                                                              "verify", "EAGLE3 chain round", "prefill", "peak GPU")),
    "summary": Table("bench-8b", "bench", ("decode floor", "plain decode, context", "verify", "EAGLE3 draft step",
                                           "EAGLE3 chain round", "EAGLE3 tree round", "prefill")),
    "peer": Table("peer", "bench", ("transformers",)),
    "demo-agreement": Table("demo-agreement", "agreement"),
    "demo-agreement-row-invariant-h100": Table("demo-agreement-row-invariant-h100", "agreement"),
    "agreement-8b-row-invariant-h100": Table("agreement-8b-row-invariant-h100", "agreement"),
    "agreement-8b-mtp-rest-h100": Table("agreement-8b-mtp-rest-h100", "agreement"),
    "demo-cpu": Table("demo-cpu", "demo"),
    "drafters-cpu": Table("drafters-cpu", "tau"),
    "sampling-cpu": Table("sampling-cpu", "tau"),
    "paradigms-cpu": Table("paradigms-cpu", "paradigms"),
    "paradigms-8b": Table("paradigms-8b", "bench", ("decode floor", "plain decode, context", "verify", "EAGLE3 draft step",
                                                    "mtp (1", "draft-model step", "EAGLE3 chain round", "mtp chain round",
                                                    "draft-model round", "EAGLE3 tree round", "mtp tree round")),
    "export-cpu": Table("export-cpu", "json", fields=(
        ("wall time, `xcompile export` as a child process", "wall_s", "{:.0f} s", 1),
        ("its peak resident memory", "peak_rss_gb_child", "{:.2f} GiB", 1))),
    "quant-quality": Table("quant-quality", "json", fields=_quality("bf16")),
    "kv-cache-quality": Table("kv-cache-quality", "json", fields=(
        *_quality("the bf16 cache"),
        ("speculative = plain greedy (of 32 prompts)", "match_plain", "{:.0f} %", 100))),
    "verify-cpu": Table("verify-cpu", "json", fields=(
        ("engine dir", "bytes", "{:.2f} GB", 1e-9),
        ("default check (every load), files in the page cache", "fast_warm_s", "{:.3f} s", 1),
        ("default check, files evicted from the page cache", "fast_cold_s", "{:.3f} s", 1),
        ("full check (`--verify`, `xcompile verify`), files in the page cache", "full_warm_s", "{:.2f} s", 1))),
    "serve-load-cpu": Table("serve-load-cpu", "load"),
    "batch-8b": Table("batch-8b", "batch"),
    "open-dir-8b": Table("open-dir-8b", "json", fields=(
        ("open, weights drawn on the GPU (`--synthetic`)", "open_synthetic_s", "{:.2f} s", 1),
        ("open, weights read from a 16.4 GB safetensors checkpoint", "open_checkpoint_s", "{:.2f} s", 1),
        ("warm-up (notes: the kernel cache empty or warm)", "warm_up_s", "{:.1f} s", 1),
        ("8-token prefill, warm (median of 5)", "prefill_8_ms", "{:.1f} ms", 1),
        ("prefills of 16-79 tokens, graphed short steps", _spread("prefill_by_length_ms_graphed"), "{}", 1),
        ("prefills of 16-79 tokens, eager short steps", _spread("prefill_by_length_ms_eager"), "{}", 1),
        ("a round of the EAGLE3 chain of 6, batch-1 Generator", "round_ms", "{:.3f} ms", 1))),
    "serve-load-cpu-solo": Table("serve-load-cpu-solo", "load"),
    "serve-load-8b": Table("serve-load-8b", "load"),
}


class PerfError(Exception):
    """A result file, sources.json or a page that the tables cannot be built from (the message says which)."""


# ---------------------------------------------------------------------------------------------------------------
# reading results


_NUM = r"(?:[\d.]+|nan)"
_HEADER = re.compile(r"^device (?P<device>.+?)  backend (?P<backend>\S+)  dtype (?P<dtype>\S+)  model (?P<model>\S+)"
                     r"  max_seq_len (?P<max_seq_len>\d+)(?:  sampling: (?P<sampling>.+))?$")
_BANDWIDTH = re.compile(r"^copy bandwidth (?P<gbs>[\d.]+) GB/s$")
_PEAK = re.compile(r"^peak GPU memory (?P<gb>[\d.]+) GB \(torch's allocator\)$")
_FLOOR = re.compile(r"^weights/token (?P<gb>[\d.]+) GB -> floor (?P<ms>[\d.]+) ms/token")
_PREFILL = re.compile(r"^prefill (?P<tokens>\d+) tokens: TTFT (?P<ms>[\d.]+) ms, (?P<tflops>[\d.]+) TFLOP/s = "
                      r"(?P<pct>\d+) % of the (?P<rate>[\d.]+) TFLOP/s matmul rate")
_PEER = re.compile(r"^peer: transformers generate \(static cache\) (?P<ms>[\d.]+) ms/token")
_STEP = re.compile(rf"^(?P<graph>\S.*?)\s+(?P<tokens>\d+)\s+(?P<eager>{_NUM})\s+(?P<graphed>{_NUM})(?:\s+\(.*\))?$")
_GEN = re.compile(rf"^\s*(?P<ctx>\d+)\s+(?P<graphs>yes|no)\s+(?P<drafter>\S.*?)\s+(?P<round>[\d.]+)\s+(?P<tok>[\d.]+)"
                  rf"\s+(?P<tps>[\d.]+)\s+(?P<tau>[\d.]+)\s+(?P<e2e>{_NUM})(?P<taus>(?:\s+{_NUM})*)"
                  r"(?:\s+\((?P<floor>[\d.]+)% of floor\))?\s*$")
_POSITION = re.compile(r"^\s*\d+\s+(yes|no)\s+\S.*?(\s+[\d.]+)+\s*$")


def _f(text: str) -> float:
    return float(text)


def parse_bench_log(text: str, where: str) -> list[dict]:
    """Every ``format_report`` in a log, as run_bench's dict (the keys its JSON has). Progress (#), command ($)
    and blank lines are skipped; any other line after a report's header must be one of the report's."""
    reports: list[dict] = []
    r, section, taus = None, None, []
    for n, line in enumerate(text.splitlines(), 1):
        if m := _HEADER.match(line):
            r = {k: m[k] for k in ("device", "backend", "dtype", "model")}
            r.update(max_seq_len=int(m["max_seq_len"]), sampling=m["sampling"] or "greedy", steps=[], generation=[])
            reports.append(r)
            section = None
            continue
        if r is None or not line.strip() or line.startswith(("#", "$")):
            continue
        if m := _BANDWIDTH.match(line):
            r["copy_bandwidth_gbs"] = _f(m["gbs"])
        elif m := _PEAK.match(line):
            r["peak_memory_gb"] = _f(m["gb"])
        elif m := _FLOOR.match(line):
            r["weight_bytes_per_token"], r["floor_ms_per_token"] = _f(m["gb"]) * 1e9, _f(m["ms"])
        elif m := _PREFILL.match(line):
            r["prefill"] = {"tokens": int(m["tokens"]), "ttft_ms": _f(m["ms"]), "tflops": _f(m["tflops"]),
                            "matmul_tflops": _f(m["rate"]), "fraction_of_matmul": int(m["pct"]) / 100}
        elif m := _PEER.match(line):
            r["peer_ms_per_token"] = _f(m["ms"])
        elif line.startswith("step "):
            section = "steps"
        elif line.lstrip().startswith("ctx "):
            section, taus = "generation", re.findall(r"x@tau=(\S+)", line)
        elif line.startswith("acceptance by position"):
            section = "position"
        elif section == "steps" and (m := _STEP.match(line)):
            row = {"graph": m["graph"], "tokens": int(m["tokens"]), "eager_ms": _f(m["eager"])}
            if m["graphed"] != "nan":
                row["graph_ms"] = _f(m["graphed"])
            r["steps"].append(row)
        elif section == "generation" and (m := _GEN.match(line)):
            row = {"context": int(m["ctx"]), "cuda_graphs": m["graphs"] == "yes", "drafter": m["drafter"],
                   "ms_per_round": _f(m["round"]), "ms_per_token": _f(m["tok"]), "tokens_per_s": _f(m["tps"]),
                   "tau": _f(m["tau"]), "speedup_e2e": _f(m["e2e"])}
            values = m["taus"].split()
            row["speedup_at_tau"] = {t: _f(v) for t, v in zip(taus, values) if v != "nan"}
            if m["floor"]:
                row["fraction_of_floor"] = _f(m["floor"]) / 100
            r["generation"].append(row)
        elif section == "position" and _POSITION.match(line):
            continue
        else:
            raise PerfError(f"{where}:{n}: not a line of xrun bench's report: {line!r}")
    if not reports:
        raise PerfError(f"{where}: no xrun bench report in it (its first line is 'device ...  backend ...')")
    return reports


_TEACHER = re.compile(r"^teacher-forced: (?P<same>\d+)/(?P<n>\d+) positions agree \((?P<pct>[\d.]+) %\); "
                      r"(?P<diff>\d+) disagreements, reference top-2 gaps there: \[(?P<gaps>.*)\]")
_AGREE = re.compile(r"^(?P<drafter>\S.*?): tau (?:(?P<torch>[\d.]+) on the torch backend, )?(?P<fast>[\d.]+) on the "
                    r"(?P<backend>\w+) backend; (?P=backend): (?P<same>\d+)/(?P<n>\d+) outputs identical to plain greedy")
_NEAR = re.compile(r"^near ties \(top-2 gap <= (?P<gap>[\d.]+)\): (?P<near>\d+) of (?P<all>\d+) partings")


def parse_agreement_log(text: str, where: str) -> dict:
    """benchmarks/fast_agreement.py's summary: teacher-forced agreement (not with --fast-only), τ and identical
    outputs per drafter."""
    out: dict = {"drafters": []}
    for line in text.splitlines():
        if m := _TEACHER.match(line):
            gaps = [float(g) for g in m["gaps"].split(",") if g.strip()]
            out["teacher"] = {"same": int(m["same"]), "n": int(m["n"]), "pct": m["pct"],
                              "max_gap": max(gaps, default=0)}
        elif m := _AGREE.match(line):
            out["drafters"].append(m.groupdict())
        elif m := _NEAR.match(line):
            out["near"] = m.groupdict()
    if not out["drafters"]:
        raise PerfError(f"{where}: not a benchmarks/fast_agreement.py log (no drafter lines)")
    return out


_SECTION = re.compile(r"^==== (?P<what>.*)$")
_STATS = re.compile(r"^\[(?P<drafter>\S+) on (?P<backend>\S+)\] (?P<n>\d+) tokens, (?P<tps>[\d.]+) tok/s, tau "
                    r"(?P<tau>[\d.]+) tokens per verify round \((?P<acc>\d+)/(?P<drafted>\d+) drafts accepted, "
                    r"(?P<fw>\d+) target forwards\)")
_DONE = re.compile(r"^==== done in (?P<s>\d+) s")


def parse_demo_log(text: str, where: str) -> dict:
    """scripts/demo.sh's output: each generate section's stats line, diff's verdict, the total time."""
    out: dict = {"runs": [], "diff": None, "seconds": None}
    section = ""
    for line in text.splitlines():
        if m := _DONE.match(line):
            out["seconds"] = int(m["s"])
        elif m := _SECTION.match(line):
            section = m["what"]
        elif m := _STATS.match(line):
            label = section.removeprefix("generate: ").split(" (")[0]
            out["runs"].append({"label": label, **m.groupdict()})
        elif section.startswith("diff") and line.strip() in ("PASSED", "FAILED"):
            out["diff"] = line.strip()
    if not out["runs"]:
        raise PerfError(f"{where}: not a scripts/demo.sh log (no '[drafter on backend] ... tau' stats lines)")
    return out


def parse_json_log(text: str, where: str) -> dict:
    """The last JSON object a script printed (benchmarks/export_8b.py, verify_speed.py end with one)."""
    start = text.rfind("\n{")
    try:
        return json.JSONDecoder().raw_decode(text[start + 1:])[0] if start >= 0 else json.loads(text)
    except ValueError:
        raise PerfError(f"{where}: no JSON object at its end (the report of a benchmarks/ script)") from None


def read_result(path: Path, kind: str) -> list:
    """The reports in ``path`` for a table of ``kind``: a list (one column each)."""
    where = str(path.relative_to(ROOT))
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        return data if isinstance(data, list) else [data]
    text = path.read_text()
    if kind in ("bench", "tau"):
        return parse_bench_log(text, where)
    if kind == "json":
        return [parse_json_log(text, where)]
    return [parse_agreement_log(text, where) if kind == "agreement" else parse_demo_log(text, where)]


# ---------------------------------------------------------------------------------------------------------------
# rendering


def _graph_mode(report: dict) -> bool:
    """The generation rows a table shows: with CUDA graphs where the report has them (a GPU), else eager."""
    return any(g["cuda_graphs"] for g in report["generation"])


def _ms(step: dict) -> float:
    return step.get("graph_ms", step["eager_ms"])


def bench_rows(r: dict) -> dict[str, str]:
    """Row label -> cell of one bench report: the floor, plain decode per context, step costs against a decode
    step, round costs against plain decoding (and what a head of the published τ would give), prefill, peer."""
    rows: dict[str, str] = {}
    graphs = _graph_mode(r)
    floor = r.get("floor_ms_per_token")
    if floor:
        rows["decode floor (weights / copy bandwidth)"] = (f"{r['weight_bytes_per_token'] / 1e9:.2f} GB / "
                                                           f"{r['copy_bandwidth_gbs']:.0f} GB/s = {floor:.3f} ms/token")
    gen = [g for g in r["generation"] if g["cuda_graphs"] == graphs]
    plain = {g["context"]: g for g in gen if g["drafter"] == "plain"}
    for ctx, g in plain.items():
        frac = g.get("fraction_of_floor") or (floor / g["ms_per_token"] if floor else None)
        rows[f"plain decode, context {ctx}"] = (f"{g['ms_per_token']:.3f} ms/token, {g['tokens_per_s']:.1f} tok/s"
                                                + (f", {100 * frac:.1f} % of the floor" if frac else ""))
    if graphs:
        for g in r["generation"]:
            if not g["cuda_graphs"] and g["drafter"] == "plain":
                rows[f"plain decode without CUDA graphs, context {g['context']}"] = f"{g['ms_per_token']:.3f} ms/token"
    steps = [s for s in r["steps"]
             if not s["graph"].startswith(("sample", "accept", "draft pick")) or r["sampling"] != "greedy"]
    decode = next((_ms(s) for s in steps if s["graph"] == "target" and s["tokens"] == 1), None)
    mode = "graphed" if graphs else "eager"
    names = {"target": "verify {n} tokens", "eagle3": "EAGLE3 step over {n} tokens (a tree level)",
             "draft": "draft-model step over {n} tokens", "eagle3_fc": "EAGLE3 fc over {n} tokens"}
    for s in steps:
        ms, n, graph = _ms(s), s["tokens"], s["graph"]
        if graph == "target" and n == 1:
            rows[f"decode step ({mode})"] = f"{ms:.3f} ms"
            continue
        singles = {("eagle3", 1): "EAGLE3 draft step", ("draft", 1): "draft-model step", ("eagle3_fc", 1): "EAGLE3 fc"}
        label = singles.get((graph, n), names.get(graph, graph + " ({n} tokens)").format(n=n))
        if graph == "target" and decode:
            rows[label] = f"{ms:.3f} ms = {ms / decode:.3f}× a decode step"
        elif decode:
            rows[label] = f"{ms:.3f} ms = {100 * ms / decode:.1f} % of a decode step"
        else:
            rows[label] = f"{ms:.3f} ms"
    first = min(plain) if plain else None
    base = plain.get(first)
    for g in gen:
        if g["drafter"] == "plain" or g["context"] != first or base is None:
            continue
        ratio = g.get("round_over_decode") or g["ms_per_round"] / base["ms_per_token"]
        name = g["drafter"].replace("eagle3 ", "EAGLE3 ").replace("tree", "tree round").replace(" g=", " round γ = ")
        cell = f"{g['ms_per_round']:.3f} ms = {ratio:.3f}× plain"
        if g["tau"] > 1:
            cell += f"; τ {g['tau']:.2f}, {g['speedup_e2e']:.2f}× plain's tokens/s"
        rows[name] = cell
        if g["tau"] == 1 and g.get("speedup_at_tau"):
            t = max(g["speedup_at_tau"], key=float)
            rows[f"{name} at τ {t}"] = (
                f"{g['speedup_at_tau'][t]:.2f}× plain, {float(t) / g['ms_per_round'] * 1e3:.0f} tok/s")
    if p := r.get("prefill"):
        rows[f"prefill of {p['tokens']} tokens"] = (f"{p['ttft_ms']:.1f} ms TTFT, {p['tflops']:.1f} TFLOP/s = "
                                                    f"{100 * p['fraction_of_matmul']:.0f} % of the "
                                                    f"{p['matmul_tflops']:.1f} TFLOP/s matmul rate of the run")
    if r.get("peak_memory_gb"):
        rows["peak GPU memory (torch's allocator)"] = f"{r['peak_memory_gb']:.1f} GB"
    if r.get("peer_ms_per_token"):
        ms = r["peer_ms_per_token"]
        rows["transformers generate() (static cache), same weights"] = f"{ms:.3f} ms/token, {1e3 / ms:.0f} tok/s"
    return rows


def _grid(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def render_bench(table: Table, columns: list[tuple[str, dict]]) -> list[str]:
    cells = [bench_rows(r) for _, r in columns]
    labels = [k for c in cells for k in c]
    labels = [k for i, k in enumerate(labels) if k not in labels[:i]
              and (not table.rows or k.startswith(table.rows))]
    return _grid(["quantity", *(label for label, _ in columns)],
                 [[k, *(c.get(k, "—") for c in cells)] for k in labels])


def render_tau(columns: list[tuple[str, dict]]) -> list[str]:
    taus = [{g["drafter"]: g["tau"] for g in r["generation"] if g["cuda_graphs"] == _graph_mode(r)} for _, r in columns]
    names = [d for t in taus for d in t]
    names = [d for i, d in enumerate(names) if d not in names[:i]]
    return _grid(["drafter", *(label for label, _ in columns)],
                 [[d, *(f"{t[d]:.2f}" if d in t else "—" for t in taus)] for d in names])


def render_paradigms(columns: list[tuple[str, dict]]) -> list[str]:
    """xrun bench JSON reports' ``paradigms`` rows (runtime/bench/paradigms.py), one block of rows per report."""
    rows = []
    for label, r in columns:
        if "paradigms" not in r:
            raise PerfError(f"{label}: a bench report without 'paradigms' (written before 2026-12-04's MTP work)")
        for p in r["paradigms"]:
            c = "—" if p["draft_over_verify"] is None else f"{p['draft_over_verify']:.2f}"
            rows.append([p["paradigm"], p["drafter"], str(p["gamma"]), " ".join(f"{a:.2f}" for a in p["alpha"]),
                         f"{p['tau']:.2f}", c, f"{p['speedup']:.2f}" if p.get("speedup") is not None else "—"])
    return _grid(["paradigm", "drafter", "γ", "α by position", "τ", "c = draft / verify", "speedup"], rows)


def render_agreement(a: dict) -> list[str]:
    t = a.get("teacher")
    lines = [f"Teacher-forced, the fast backend's greedy token equals the reference modules' at {t['same']} of "
             f"{t['n']} positions ({t['pct']} %); at each of the {t['n'] - t['same']} others the reference's top-2 "
             f"logits are within {t['max_gap']:g}." if t else
             "Counted on the fast backend alone (`--fast-only`): no teacher-forced pass, no torch τ.", ""]
    other, torch = a["drafters"][0]["backend"], any(d["torch"] for d in a["drafters"])
    lines += _grid(["drafter", *(["τ, torch backend"] if torch else []), f"τ, {other} backend",
                    f"outputs identical to plain greedy ({other})"],
                   [[d["drafter"], *([d["torch"] or "—"] if torch else []), d["fast"], f"{d['same']} / {d['n']}"]
                    for d in a["drafters"]])
    if n := a.get("near"):
        lines += ["", f"Where speculative and plain greedy part on the fast backend, {n['near']} of {n['all']} "
                      f"partings are at a near tie (top-2 gap ≤ {n['gap']})."]
    return lines


def render_demo(d: dict) -> list[str]:
    lines = _grid(["`xrun generate`", "τ", "drafts accepted", "target forwards", "tokens/s"],
                  [[r["label"], r["tau"], f"{r['acc']} / {r['drafted']}", r["fw"], r["tps"]] for r in d["runs"]])
    tail = []
    if d["diff"]:
        tail.append(f"`xcompile diff`: {d['diff']}.")
    if d["seconds"] is not None:
        tail.append(f"The whole script took {d['seconds']} s, setup included.")
    return lines + ([""] + [" ".join(tail)] if tail else [])


def _need_levels(columns: list[tuple[str, dict]], script: str) -> None:
    if bad := [label for label, rep in columns if not isinstance(rep.get("levels"), list)]:
        raise PerfError(f"{', '.join(bad)}: not a benchmarks/{script} report (no 'levels' list)")


def render_load(columns: list[tuple[str, dict]]) -> list[str]:
    """benchmarks/serve_load.py reports: a row per concurrency, a column per report; each cell the aggregate tok/s,
    TTFT p50 / p99 (and the server's own mean where the report has it) and inter-token latency p50 / p99, and the
    failed requests if any."""
    def cell(lv: dict | None) -> str:
        if lv is None:
            return "—"
        text = f"{lv['tokens_per_s']:.1f} tok/s; TTFT {lv['ttft_ms']['p50']:.0f} / {lv['ttft_ms']['p99']:.0f} ms"
        if lv.get("server_ttft_ms_mean") is not None:      # the server's own share (/metrics: arrival to token)
            text += f" (the server's mean {lv['server_ttft_ms_mean']:.0f} ms)"
        if lv.get("refused_ms"):                            # as many requests refused (404): the HTTP side alone
            text += f"; {lv['streams']} requests refused before generating {lv['refused_ms']['p50']:.0f} ms p50"
        text += f"; ITL {lv['itl_ms']['p50']:.0f} / {lv['itl_ms']['p99']:.0f} ms"
        if lv["errors"] or lv["rate_limited"]:
            text += f"; {lv['errors']} errors, {lv['rate_limited']} refused (429) of {lv['requests']}"
        steps = lv.get("server_steps") or {}         # the server's engine steps (serve_load.py, /metrics)
        kinds = (("lone prefills", "prompt"), ("lone rounds", "round"), ("batch steps with prompt chunks",
                                                                           "batch_prompt"), ("batch", "batch"))
        shown = [(what, steps[k]) for what, k in kinds if steps.get(k)]
        if shown:
            text += "; server steps: " + ", ".join(f"{what} {s['count']} × {s['mean_ms']:.3f} ms" for what, s in shown)
        return text + full_collections(lv)

    def full_collections(part: dict) -> str:
        """The server's full garbage collections (generation 2) during a part, where the report counts them."""
        full = (part.get("server_gc") or {}).get("2")
        return f"; server full collections {full['count']} × ({full['total_ms']:.1f} ms in all)" if full else ""

    def first(rep: dict) -> str:
        f = rep.get("first_request")
        if not f or f["ttft_ms"] is None:
            return "—"
        own = f.get("server_ttft_ms")
        one = next((lv for lv in rep["levels"] if lv["streams"] == 1), None)
        warm = one.get("server_ttft_ms_mean") if one else None
        inner = f"the server's own {own:.0f} ms" if own is not None else ""
        if inner and warm:
            inner += f" = {own / warm:.2f}× its mean at 1 stream, {warm:.0f} ms"
        return f"TTFT {f['ttft_ms']:.0f} ms" + (f" ({inner})" if inner else "") + full_collections(f)

    def lengths(rep: dict) -> str:
        ln = rep.get("prompt_lengths")
        if not ln or not ln["slowest"]:
            return "—"
        return (f"{ln['ok']} / {ln['requests']} ok; TTFT p50 {ln['ttft_ms']['p50']:.0f} ms, p90 "
                f"{ln['ttft_ms']['p90']:.0f} ms, slowest {ln['slowest']['ttft_ms']:.0f} ms = "
                f"{ln['slowest']['over_median']:.2f}x the median (length {ln['slowest']['length']})"
                + full_collections(ln))

    _need_levels(columns, "serve_load.py")
    levels = [{lv["streams"]: lv for lv in rep["levels"]} for _, rep in columns]
    streams = sorted({n for lv in levels for n in lv})
    rows = [[str(n), *(cell(lv.get(n)) for lv in levels)] for n in streams]
    if any(rep.get("first_request") for _, rep in columns):
        rows.append(["first request after ready", *(first(rep) for _, rep in columns)])
    if any(rep.get("prompt_lengths") for _, rep in columns):
        spans = {f"{r['prompt_lengths']['lengths'][0]}-{r['prompt_lengths']['lengths'][1]}"
                 for _, r in columns if r.get("prompt_lengths")}
        rows.append([f"prompt lengths {', '.join(sorted(spans))}, one at a time",
                     *(lengths(rep) for _, rep in columns)])
    return _grid(["concurrent streams", *(label for label, _ in columns)], rows)


def render_batch(columns: list[tuple[str, dict]]) -> list[str]:
    """benchmarks/batch_decode.py reports: a row per (run, B, gamma): one stream's and B streams' tok/s, the step,
    TTFT, and the aggregate projected at the report's tau; the batch-1 loop's tok/s under each run's rows."""
    _need_levels(columns, "batch_decode.py")
    rows = []
    for label, rep in columns:
        for lv in rep["levels"]:
            a = lv["all"]
            rows.append([label, str(lv["batch"]), str(lv["gamma"]) if lv["gamma"] else "plain",
                         f"{lv['one']['tok_s']:.1f}", f"{a['tok_s']:.1f}", f"{lv['all_over_one']:.2f}",
                         f"{a['step_ms']:.3f}", f"{a['ttft_ms']:.1f}", f"{a['projected_tok_s']:.0f}"])
        rows.append([label, "batch-1 loop", "plain", f"{rep['batch1']['tok_s']:.1f}", "", "", "", "", ""])
    tau = columns[0][1]["tau"]
    return _grid(["run", "B (slots)", "chain", "one stream tok/s", "B streams tok/s", "B / one", "step ms",
                  "TTFT ms", f"B streams at τ {tau}, tok/s"], rows)


def render(name: str, table: Table, files: list[tuple[str, dict]], page: Path) -> list[str]:
    """The generated lines of table ``name`` from files [(file name, its sources.json entry)] on ``page``."""
    columns: list[tuple[str, dict]] = []
    for fname, meta in files:
        reports = read_result(PERF / fname, table.kind)
        labels = meta.get("label", [])
        labels = [labels] if isinstance(labels, str) else labels
        if labels and len(labels) != len(reports):
            raise PerfError(f"docs/perf/{SOURCES}: {fname}: 'label' names {len(labels)} reports, the file holds "
                            f"{len(reports)}")
        columns += [(labels[i] if labels else Path(fname).stem, rep) for i, rep in enumerate(reports)]
    if table.kind == "bench":
        lines = render_bench(table, columns)
    elif table.kind == "tau":
        lines = render_tau(columns)
    elif table.kind == "paradigms":
        lines = render_paradigms(columns)
    elif table.kind == "json":
        lines = _grid(["quantity", *(label for label, _ in columns)],
                      [[label, *(_json_cell(rep, key, fmt, scale) for _, rep in columns)]
                       for label, key, fmt, scale in table.fields])
    elif table.kind == "load":
        lines = render_load(columns)
    elif table.kind == "batch":
        lines = render_batch(columns)
    elif table.kind == "agreement":         # one block a run, each under its label when there are several
        lines = [x for label, rep in columns
                 for x in ([f"**{label}**", ""] if len(columns) > 1 else []) + render_agreement(rep) + [""]][:-1]
    else:
        lines = [x for _, rep in columns for x in render_demo(rep)]
    link = os.path.relpath(PERF, page.parent)
    lines.append("")
    for fname, meta in files:
        lines.append(f"- [{fname}]({link}/{fname}): {meta['date']}, {meta['machine']}; `{meta['command']}`"
                     + (f"; {meta['note']}" if meta.get("note") else ""))
    return lines


# ---------------------------------------------------------------------------------------------------------------
# pages


_BLOCK = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def load_sources() -> dict[str, dict]:
    path = PERF / SOURCES
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PerfError(f"docs/perf/{SOURCES}: cannot read its 'files' object ({e})") from None
    for fname, meta in files.items():
        missing = [k for k in REQUIRED if not meta.get(k)]
        if missing:
            raise PerfError(f"docs/perf/{SOURCES}: {fname} lacks {', '.join(missing)} (every figure names its date, "
                            "machine and command)")
        if not (PERF / fname).is_file():
            raise PerfError(f"docs/perf/{SOURCES}: {fname} is described but not in docs/perf")
    kept = {p.name for p in PERF.iterdir() if p.suffix in (".log", ".json") and p.name != SOURCES}
    if undescribed := sorted(kept - set(files)):
        raise PerfError(f"docs/perf: {', '.join(undescribed)} not described in {SOURCES} (add its date, machine, "
                        "command and tables)")
    return files


def newest(tag: str, sources: dict[str, dict]) -> list[tuple[str, dict]]:
    """The files tagged ``tag`` that share the newest date among them, in sources.json order."""
    tagged = [(f, m) for f, m in sources.items() if tag in m["tables"]]
    if not tagged:
        raise PerfError(f"docs/perf/{SOURCES}: no file is tagged {tag!r}")
    date = max(m["date"] for _, m in tagged)
    return [(f, m) for f, m in tagged if m["date"] == date]


def build(page: Path, sources: dict[str, dict], used: set[str], shown: set[str]) -> str:
    """``page``'s text with its tables regenerated; the file names read go into ``used``, the tables into
    ``shown``."""
    text = page.read_text()

    def block(m: re.Match) -> str:
        name = m["name"]
        if name not in TABLES:
            raise PerfError(f"{page.relative_to(ROOT)}: unknown table {name!r} (scripts/perf_tables.py TABLES: "
                            f"{', '.join(TABLES)})")
        files = newest(TABLES[name].source, sources)
        used.update(f for f, _ in files)
        shown.add(name)
        return m[1] + "\n".join(render(name, TABLES[name], files, page)) + "\n" + m[4]

    return _BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page is stale")
    args = parser.parse_args(argv)
    try:
        sources = load_sources()
        used: set[str] = set()
        shown: set[str] = set()
        stale = []
        for page in PAGES:
            new = build(page, sources, used, shown)
            if new != page.read_text():
                stale.append(page)
                if not args.check:
                    page.write_text(new)
        if idle := sorted(set(TABLES) - shown):
            raise PerfError(f"scripts/perf_tables.py TABLES: {', '.join(idle)} on no page: remove them, history is in git")
        if unused := sorted(set(sources) - used):
            raise PerfError(f"docs/perf: {', '.join(unused)} feed no current table (a newer result replaced them, or "
                            "no page shows their tag): remove them, history is in git")
    except PerfError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for page in stale:
        print(f"{page.relative_to(ROOT)}: {'stale; run python3 scripts/perf_tables.py' if args.check else 'rewritten'}",
              file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
