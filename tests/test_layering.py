"""One-way layering (plugins <- runtime <- compile): the runtime ships without the exporter, onnx,
onnxscript or transformers. Checked statically (every import statement, lazy ones included) and
dynamically (importing every runtime/plugins module in a fresh interpreter). Inside the runtime, each
subpackage imports only the ones below it (``RUNTIME_LAYERS``)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("runtime", "plugins")
FORBIDDEN = ("onnx", "onnxscript", "transformers", "compile", "xcompile.compile")
OPTIONAL = ("tensorrt", "tensorrt_rtx", "cuda", "onnxruntime",      # may be absent on this machine
            "fastapi", "uvicorn", "pydantic", "prometheus_client", "ray")  # the serve extras


# runtime subpackages, lowest first: each may import its own layer and the ones before it. Modules at the top
# of runtime/ (the public API) sit above decoding; bench and serve are side by side; the CLI is on top.
RUNTIME_LAYERS = [{"common"}, {"enginedir"}, {"engines"}, {"decoding"}, {"api", "__init__"}, {"bench", "serve"},
                  {"cli"}]


def imports(source: str, package: tuple[str, ...], filename: str = "<src>") -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``source``, lazy ones included. Relative imports
    resolve against the folder ``package``; the folders install under ``xcompile``, so from
    ``runtime/`` both ``from ..compile import y`` and ``from .. import compile`` reach ``compile``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = list(package[: len(package) - node.level + 1]) if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            found += [(node.lineno, ".".join(filter(None, (base, a.name)))) for a in node.names]
            if base:
                found.append((node.lineno, base))
    return found


def forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def shipped_files() -> list[Path]:
    return sorted(p for folder in SHIPPED for p in (ROOT / folder).rglob("*.py"))


def file_imports(path: Path) -> list[tuple[int, str]]:
    return imports(path.read_text(), path.relative_to(ROOT).parent.parts, str(path))


def test_scanner_sees_relative_and_lazy_imports():
    sample = ("import torch\nfrom . import engine\nfrom .backends import torch_module\n"
              "def f():\n    import onnx.helper\n    from .. import compile\n    from ..compile import export\n"
              "    from xcompile.compile.models import qwen3\n    import onnxruntime\n")
    bad = {m for _, m in imports(sample, ("runtime",)) if forbidden(m)}
    assert bad == {"onnx.helper", "compile", "compile.export",
                   "xcompile.compile.models", "xcompile.compile.models.qwen3"}


def test_runtime_and_plugins_do_not_import_compile_side():
    assert shipped_files(), "no runtime/plugins sources found"
    bad = [f"{p.relative_to(ROOT)}:{line}: {m}" for p in shipped_files() for line, m in file_imports(p) if forbidden(m)]
    assert not bad, "runtime/plugins must not import the compile side, onnx or transformers:\n" + "\n".join(bad)


def runtime_layer(name: str) -> int:
    """The layer of runtime subpackage or top-level module ``name``."""
    return next(i for i, names in enumerate(RUNTIME_LAYERS) if name in names)


def test_runtime_subpackages_import_only_the_layers_below_them():
    bad = []
    for p in sorted((ROOT / "runtime").rglob("*.py")):
        rel = p.relative_to(ROOT / "runtime")
        own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for line, module in file_imports(p):
            parts = module.split(".")
            if parts[:2] != ["xcompile", "runtime"] or len(parts) < 3:
                continue
            other = parts[2]
            if other == own or other not in {n for names in RUNTIME_LAYERS for n in names}:
                continue
            if runtime_layer(other) > runtime_layer(own) or (runtime_layer(other) == runtime_layer(own)):
                bad.append(f"runtime/{rel}:{line}: {module}")
    assert not bad, "runtime subpackages must import only the layers below them (RUNTIME_LAYERS):\n" + "\n".join(bad)


def test_every_runtime_subpackage_has_a_layer():
    found = {p.name for p in (ROOT / "runtime").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    found |= {p.stem for p in (ROOT / "runtime").glob("*.py")}
    assert found <= {n for names in RUNTIME_LAYERS for n in names}, found


def test_importing_runtime_does_not_load_compile_side():
    modules = []
    for p in shipped_files():
        rel = p.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        modules.append(".".join(("xcompile", *parts)))
    script = f"""
import importlib, json, sys
skipped = []
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in {OPTIONAL!r}:
            raise
        skipped.append(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("onnx", "onnxscript", "transformers")
                or m.startswith("xcompile.compile"))
print(json.dumps({{"loaded": loaded, "skipped": skipped}}))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [], f"importing the runtime loaded {result['loaded']}"
    assert len(result["skipped"]) < len(modules), result["skipped"]


@pytest.mark.parametrize("cli", ["xcompile.compile.cli", "xcompile.runtime.cli.xrun"])
def test_cli_help_imports_nothing_heavy(cli):
    """--help stays instant: the CLI modules import torch, onnx, tensorrt only inside commands."""
    script = f"""
import sys
from click.testing import CliRunner
import {cli} as m
result = CliRunner().invoke(m.main, ["--help"])
assert result.exit_code == 0, result.output
heavy = sorted({{n.split(".")[0] for n in sys.modules}} & {{"torch", "onnx", "onnxruntime", "tensorrt",
                                                          "tensorrt_rtx", "polygraphy", "transformers"}})
print(heavy)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"{cli} --help imported {run.stdout.strip()}"
