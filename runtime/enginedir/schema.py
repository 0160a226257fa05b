"""The manifest's fields, declared once as data and checked field by field when a manifest is read.

Each field maps to a check that returns None or what is wrong; ``validate`` reports the first
problem as "field 'graphs.target.dims.vocab' should be ..., got ...", so a hand-edited or damaged
manifest is one line naming the field, never a traceback or a silently ignored value (EOS ids of
the wrong type would disable stopping).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from xcompile.runtime.enginedir.contract import DTYPES, GRAPHS

Check = Callable[[object, str], list[tuple[str, str]]]     # (value, field) -> [(field, problem)]

KNOWN_CONTRACT_VERSIONS = (1, 2)     # the runtime loads only CONTRACT_VERSION (manifest.py)
MODEL_KINDS = ("qwen3", "eagle3", "mtp")
FLAVORS = ("tensorrt", "rtx")
_HEX = re.compile(r"[0-9a-f]*")


def _got(value) -> str:
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int | None = None) -> Check:
    def check(v, f):
        if not _is_int(v) or (lo is not None and v < lo):
            return [(f, f"should be an integer{f' >= {lo}' if lo is not None else ''}, got {_got(v)}")]
        return []
    return check


def string(v, f):
    return [] if isinstance(v, str) else [(f, f"should be a string, got {_got(v)}")]


def hex_digest(length: int | None = None) -> Check:
    def check(v, f):
        ok = isinstance(v, str) and _HEX.fullmatch(v) and (length is None or len(v) == length)
        return [] if ok else [(f, f"should be a{f' {length}-digit' if length else ''} hex digest, got {_got(v)}")]
    return check


def file_name(v, f):
    """A plain name inside the engine dir: the runtime opens ``dir / name``, so no separators or '..'."""
    if isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\\" not in v:
        return []
    return [(f, f"should be a file name inside the engine dir, got {_got(v)}")]


def choice(*values) -> Check:
    def check(v, f):
        return [] if v in values else [(f, f"should be one of {', '.join(map(str, values))}, got {_got(v)}")]
    return check


def optional(inner: Check) -> Check:
    return lambda v, f: [] if v is None else inner(v, f)


def list_of(item: Check, length: int | None = None) -> Check:
    def check(v, f):
        if not isinstance(v, list) or (length is not None and len(v) != length):
            return [(f, f"should be a list{f' of {length}' if length is not None else ''}, got {_got(v)}")]
        return [p for i, x in enumerate(v) for p in item(x, f"{f}[{i}]")]
    return check


def dict_of(value: Check, keys: Check = string) -> Check:
    def check(v, f):
        if not isinstance(v, dict):
            return [(f, f"should be a mapping, got {_got(v)}")]
        return [p for k, x in v.items() for p in keys(k, f"{f}.{k}") + value(x, f"{f}.{k}")]
    return check


def fields(spec: dict[str, Check], required: tuple[str, ...] = ()) -> Check:
    """A mapping with exactly these keys (``required`` ones must be there; others may be left out)."""
    def check(v, f):
        if not isinstance(v, dict):
            return [(f, f"should be a mapping, got {_got(v)}")]
        at = f"{f}." if f else ""
        problems = [(f"{at}{k}", "is missing") for k in required if k not in v]
        problems += [(f"{at}{k}", "is not a field xcompile knows (written by a newer version?)") for k in v if k not in spec]
        return problems + [p for k, x in v.items() if k in spec for p in spec[k](x, f"{at}{k}")]
    return check


def record(v, f):
    """A file record (runtime/enginedir/integrity.py): block count must match size and block size."""
    problems = fields({"size": integer(0), "block_size": integer(1), "blocks": list_of(hex_digest(32)),
                       "sha256": hex_digest(64)}, ("size", "block_size", "blocks", "sha256"))(v, f)
    if not problems and len(v["blocks"]) != -(-v["size"] // v["block_size"]):
        problems.append((f"{f}.blocks", f"should hold one digest per {v['block_size']}-byte block of "
                                        f"{v['size']} bytes, got {len(v['blocks'])}"))
    return problems


_TENSOR = fields({"name": string, "dtype": string, "shape": list_of(string), "aliases": optional(string)},
                 ("name", "dtype", "shape"))
_PROFILE = fields({"name": string, "tokens": list_of(integer(1), 3), "rows": list_of(integer(1), 3)},
                  ("name", "tokens"))

MANIFEST = fields({
    "format": string,
    "contract_version": choice(*KNOWN_CONTRACT_VERSIONS),
    "name": string,
    "dtype": choice(*DTYPES),
    "max_seq_len": integer(1),
    "max_batch": integer(1),
    "models": dict_of(fields({"kind": choice(*MODEL_KINDS), "config": dict_of(lambda v, f: []), "source": string,
                              "extra": dict_of(lambda v, f: [])}, ("kind", "config", "source"))),
    "graphs": dict_of(fields({"onnx": file_name, "model": string,
                              "io": fields({"inputs": list_of(_TENSOR), "outputs": list_of(_TENSOR)},
                                           ("inputs", "outputs")),
                              "dims": dict_of(integer(1)), "sha256": string}, ("onnx", "model", "io", "dims")),
                      choice(*GRAPHS)),
    "engines": dict_of(fields({"file": file_name, "graph": choice(*GRAPHS), "flavor": choice(*FLAVORS),
                               "trt_version": string, "compute_capabilities": list_of(string),
                               "profiles": list_of(_PROFILE), "onnx_sha256": string,
                               # builder controls (compile/build.py BuildOptions.builder): workspace bytes,
                               # optimization level 0..5
                               "builder": fields({"workspace": integer(1), "optimization_level": integer(0)}, ())},
                              ("file", "graph", "flavor", "trt_version")), choice(*GRAPHS)),
    "eos_token_ids": list_of(integer(0)),
    "tokenizer_files": list_of(file_name),
    "files": dict_of(record, file_name),
    "inputs": dict_of(record),
    "xcompile_version": string,
    "digest": string,
}, ("format", "contract_version", "name", "dtype", "max_seq_len", "max_batch", "models", "digest"))


def validate(data) -> tuple[str, str] | None:
    """(field, problem) of the first thing wrong with a parsed manifest.json, or None."""
    problems = MANIFEST(data, "")
    if problems:
        return problems[0]
    models, graphs = data["models"], data.get("graphs", {})
    if "target" not in models:
        return "models", "has no 'target' entry"
    for name, g in graphs.items():
        if g["model"] not in models:
            return f"graphs.{name}.model", f"names model {g['model']!r}, which 'models' does not hold"
    for name, e in data.get("engines", {}).items():
        if e["graph"] != name or name not in graphs:
            return f"engines.{name}.graph", f"should name its own graph {name!r} of 'graphs', got {e['graph']!r}"
    vocab = models["target"]["config"].get("vocab_size")
    for i, t in enumerate(data.get("eos_token_ids", [])):
        if _is_int(vocab) and t >= vocab:
            return f"eos_token_ids[{i}]", f"should be a token id below the target's vocab_size {vocab}, got {t}"
    return None
