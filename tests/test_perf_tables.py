"""scripts/perf_tables.py: the figure tables of docs/performance.md and README.md are what the raw results in
docs/perf/ give (CPU only, a second). The other tests work on a copy of the pages and results in a tmp dir."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "perf_tables.py"


def load_script():
    spec = importlib.util.spec_from_file_location("perf_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def copy(tmp_path, monkeypatch):
    """The script pointed at a copy of docs/perf, docs/performance.md and README.md under tmp_path."""
    pt = load_script()
    shutil.copytree(ROOT / "docs" / "perf", tmp_path / "docs" / "perf")
    pages = []
    for rel in ("docs/performance.md", "README.md"):
        shutil.copy(ROOT / rel, tmp_path / rel)
        pages.append(tmp_path / rel)
    monkeypatch.setattr(pt, "ROOT", tmp_path)
    monkeypatch.setattr(pt, "PERF", tmp_path / "docs" / "perf")
    monkeypatch.setattr(pt, "PAGES", tuple(pages))
    return pt


def test_the_repository_pages_match_their_results():
    run = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def plain_figure(text: str) -> str:
    """The first plain-decode figure of a page's tables, e.g. '4.066 ms/token'."""
    return re.search(r"plain decode, context 128 \| (\d+\.\d{3} ms/token)", text)[1]


def bench_files(perf: Path) -> list[str]:
    return [f for f, m in json.loads((perf / "sources.json").read_text())["files"].items() if "bench-8b" in m["tables"]]


def test_an_edited_figure_is_stale_and_a_rewrite_restores_it(copy):
    page = copy.PAGES[0]
    text = page.read_text()
    page.write_text(text.replace(plain_figure(text), "0.001 ms/token", 1))
    assert copy.main(["--check"]) == 1
    assert copy.main([]) == 0
    assert page.read_text() == text
    assert copy.main(["--check"]) == 0


def test_a_newer_bench_json_replaces_the_main_table(copy, capsys):
    perf = copy.PERF
    old = bench_files(perf)
    before = plain_figure(copy.PAGES[0].read_text())
    report = copy.read_result(perf / old[-1], "bench")[0]
    plain = next(g for g in report["generation"] if g["drafter"] == "plain" and g["context"] == 128)
    plain["ms_per_token"], plain["tokens_per_s"] = 3.9, 256.4
    (perf / "2026-12-05-h200-bench-8b-greedy.json").write_text(json.dumps(report))
    sources = json.loads((perf / "sources.json").read_text())
    sources["files"]["2026-12-05-h200-bench-8b-greedy.json"] = {
        "tables": ["bench-8b"], "date": "2026-12-05", "machine": "one NVIDIA H200", "command": "xrun bench ..."}
    (perf / "sources.json").write_text(json.dumps(sources))
    # the logs it replaces feed nothing now: refused until removed
    assert copy.main([]) == 2
    assert "feed no current table" in capsys.readouterr().err
    for f in old:
        (perf / f).unlink()
        del sources["files"][f]
    (perf / "sources.json").write_text(json.dumps(sources))
    assert copy.main([]) == 0
    text = copy.PAGES[0].read_text()
    assert "3.900 ms/token, 256.4 tok/s" in text and "2026-12-05-h200-bench-8b-greedy.json" in text
    assert before not in text
    assert "3.900 ms/token" in copy.PAGES[1].read_text()         # README's summary reads the same files


def test_a_result_without_its_date_machine_and_command_is_refused(copy, capsys):
    (copy.PERF / "2026-12-05-stray.log").write_text("x\n")
    assert copy.main(["--check"]) == 2
    assert "2026-12-05-stray.log not described" in capsys.readouterr().err


def test_a_table_no_page_shows_is_refused(copy, monkeypatch, capsys):
    monkeypatch.setitem(copy.TABLES, "gone", copy.Table("gone", "bench"))
    assert copy.main(["--check"]) == 2
    assert "TABLES: gone on no page" in capsys.readouterr().err


def test_the_log_parser_reads_what_format_report_writes():
    bench_report = pytest.importorskip("xcompile.runtime.bench.report")
    pt = load_script()
    name = bench_files(ROOT / "docs" / "perf")[-1]
    report = pt.read_result(ROOT / "docs" / "perf" / name, "bench")[0]
    report["peak_memory_gb"] = 41.25                                   # a CUDA run's (the GPU runs print it)
    again = pt.parse_bench_log(bench_report.format_report(report), "format_report")[0]
    assert pt.bench_rows(again) == pt.bench_rows(report)
    assert pt.bench_rows(again)["peak GPU memory (torch's allocator)"] == "41.2 GB"
