"""Build the demo corpus from text that ships with CPython itself (no network, no hub).

Sources, both under the PSF License 2.0 (see data/README.md):
  - ``pydoc_data.topics``: the language-reference topics that ``help()`` shows, one document each;
  - the docstrings of the standard library's ``.py`` files (read with ``ast``, nothing is imported),
    one document per source file, its docstrings in source order separated by blank lines.

Output: ``data/corpus.train.txt`` and ``data/corpus.heldout.txt``, documents separated by a line
holding a single form feed (the separator ``xcompile.compile.data`` splits plain text on). Every
20th document goes to the held-out split (5%), so both splits cover the same kinds of text. The
result depends only on the Python version (recorded in the first line of data/README.md's table).

    python scripts/make_corpus.py [--out data] [--min-chars 40]
"""

from __future__ import annotations

import argparse
import ast
import sys
import sysconfig
from pathlib import Path

HELDOUT_EVERY = 20          # every 20th document -> held-out (5%)
SEPARATOR = "\n\f\n"        # xcompile.compile.data.DOC_SEPARATOR


def topic_documents() -> list[str]:
    from pydoc_data.topics import topics
    return [topics[name].strip() for name in sorted(topics)]


def docstrings(path: Path, min_chars: int) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []       # a few stdlib files are deliberately invalid (test data, bad encodings)
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [n for n in ast.walk(tree) if isinstance(n, kinds)]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))       # source order; the module comes first
    out = []
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc and len(doc) >= min_chars:
            out.append(doc.replace("\f", "").strip())
    return out


def docstring_documents(min_chars: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    docs = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.relative_to(root).parts:
            continue
        parts = [d for d in docstrings(path, min_chars) if d not in seen]     # drop copied docstrings
        seen.update(parts)
        if parts:
            docs.append("\n\n".join(parts))
    return docs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data")
    ap.add_argument("--min-chars", type=int, default=40, help="skip shorter docstrings (one-liners)")
    args = ap.parse_args()

    docs = topic_documents() + docstring_documents(args.min_chars)
    train = [d for i, d in enumerate(docs) if (i + 1) % HELDOUT_EVERY]
    heldout = [d for i, d in enumerate(docs) if (i + 1) % HELDOUT_EVERY == 0]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, split in (("corpus.train.txt", train), ("corpus.heldout.txt", heldout)):
        text = SEPARATOR.join(split) + "\n"
        (args.out / name).write_text(text, encoding="utf-8")
        print(f"{args.out / name}: {len(split)} documents, {len(text.encode()) / 1e6:.2f} MB")
    print(f"python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
