"""``xcompile inspect DIR``: what an engine dir holds, as one readable report (or JSON).

For every graph: its ONNX I/O as written (names, dtypes, symbolic shapes, which output aliases
which input). For every engine: flavor, version, targets and, per optimization profile, the
min..max shape of every tensor. Where the engine can be deserialized here (its TensorRT flavor is
installed and a GPU is present) the shapes, dtypes and aliasing are read from the engine itself;
elsewhere they are derived from the manifest.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from xcompile.compile.errors import CompileError
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import dynamic_ranges
from xcompile.runtime.enginedir.manifest import EngineEntry, Manifest
from xcompile.runtime.engines.trt_flavor import collecting_logger, deserialize_error, import_trt, trt_dtype_names

# onnx.TensorProto.DataType values
_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64", 9: "bool"}


def onnx_io(path: Path) -> dict:
    """Inputs/outputs of an ONNX file as written (weights are not read)."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, OSError) as e:       # truncated or not an ONNX file
        raise CompileError(f"{path}: not a readable ONNX file ({type(e).__name__}: {str(e) or 'truncated?'}); "
                           "re-export the engine dir (`xcompile export ... --force`)") from None

    def rows(values):
        return [{"name": v.name, "dtype": _ONNX_DTYPES.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type)),
                 "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in values]

    return {"inputs": rows(model.graph.input), "outputs": rows(model.graph.output)}


def profile_shapes(io: dict, dims: dict, profiles: list[dict]) -> dict[str, list[str]]:
    """tensor name -> per profile "min..max" shape, from the contract's symbolic dims."""
    out = {}
    for t in io["inputs"] + io["outputs"]:
        per_profile = []
        for p in profiles:
            ranges = dynamic_ranges(p["tokens"], p.get("rows", p["tokens"]))
            per_profile.append(_shape_text(
                [(ranges[d][0], ranges[d][2]) if d in ranges else (dims.get(d, d),) * 2 for d in t["shape"]]))
        out[t["name"]] = per_profile
    return out


def _shape_text(dims: list[tuple]) -> str:
    return "[" + ", ".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in dims) + "]"


def engine_io(path: Path, entry: EngineEntry) -> dict:
    """I/O read from a deserialized engine: per tensor mode, dtype, alias and per-profile shapes."""
    import torch

    if not torch.cuda.is_available():
        raise EngineError("no CUDA GPU here; TensorRT deserializes engines on a GPU only")
    trt = import_trt(entry.flavor)
    logger = collecting_logger(trt)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise deserialize_error(str(path), entry, trt, logger.errors)
    dtype_of = trt_dtype_names(trt)
    tensors = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        row = {"name": name, "mode": "input" if is_input else "output",
               "dtype": dtype_of.get(engine.get_tensor_dtype(name), str(engine.get_tensor_dtype(name))),
               "shape": list(engine.get_tensor_shape(name)), "aliases": engine.get_aliased_input_tensor(name) or None}
        if is_input:
            row["profiles"] = []
            for p in range(engine.num_optimization_profiles):
                lo, _, hi = engine.get_tensor_profile_shape(name, p)
                row["profiles"].append(_shape_text(list(zip(lo, hi))))
        tensors.append(row)
    return {"tensors": tensors, "device_memory": [engine.get_device_memory_size_for_profile_v2(p)
                                                  for p in range(engine.num_optimization_profiles)]}


def describe(directory: Path, read_engines: bool = True) -> dict:
    """The engine dir as a dict: manifest fields, graphs (with ONNX I/O) and engines (with shapes)."""
    directory = Path(directory)
    try:
        manifest = Manifest.load(directory)
    except EngineError as e:
        raise CompileError(str(e)) from None
    out = {k: v for k, v in asdict(manifest).items() if k not in ("graphs", "engines", "files", "inputs")}
    # the block hashes are for `xcompile verify`; a report shows what they cover
    out["files"] = {n: r["size"] for n, r in manifest.files.items()}
    out["inputs"] = {n: r["size"] for n, r in manifest.inputs.items()}
    # what a stat tells without reading the bytes (`xcompile verify` hashes them): a file gone or resized
    out["damaged"] = [f"{name}: {problem}" for name in manifest.needed_files()
                      if (problem := _stat_problem(directory / name, manifest.files.get(name)))]
    out["graphs"], out["engines"] = {}, {}
    for graph, g in manifest.graphs.items():
        path = directory / g.onnx
        entry = {"onnx": g.onnx, "sha256": g.sha256, "dims": g.dims, "model": g.model,
                 "io": onnx_io(path) if path.is_file() else None}
        if entry["io"] is None:
            entry["missing"] = f"{g.onnx} not found"
        aliases = {t["name"]: t["aliases"] for t in g.io["outputs"] if t.get("aliases")}
        entry["aliases"] = aliases
        out["graphs"][graph] = entry
    for graph, e in manifest.engines.items():
        entry = asdict(e)
        g = manifest.graphs.get(graph)
        entry["shapes"] = profile_shapes(g.io, g.dims, e.profiles) if g else {}
        entry["aliases"] = {t["name"]: t["aliases"] for t in g.io["outputs"] if t.get("aliases")} if g else {}
        path = directory / e.file
        if not path.is_file():
            entry["read"] = f"{e.file} not found"
        elif read_engines:
            try:
                entry["engine"] = engine_io(path, e)
                entry["read"] = "from the engine"
            except EngineError as err:
                entry["read"] = f"from the manifest (engine not deserialized: {err})"
        out["engines"][graph] = entry
    return out


def _stat_problem(path: Path, record: dict | None) -> str | None:
    if not path.is_file():
        return "missing"
    if record is not None and path.stat().st_size != record["size"]:
        return f"{path.stat().st_size} bytes, {record['size']} recorded"
    return None


def format_report(d: dict) -> str:
    """``describe``'s dict as the text ``xcompile inspect`` prints."""
    lines = [f"{d['name']}: {d['dtype']}, max_seq_len {d['max_seq_len']}, max_batch {d['max_batch']}, "
             f"contract v{d['contract_version']}, xcompile {d['xcompile_version'] or '?'}"]
    for key, m in d["models"].items():
        lines.append(f"  model {key}: {m['kind']} from {m['source']}" + (f" {m['extra']}" if m["extra"] else ""))
    if d["eos_token_ids"]:
        lines.append(f"  eos token ids: {d['eos_token_ids']}")
    for graph, g in d["graphs"].items():
        lines.append(f"graph {graph}: {g['onnx']} (sha256 {g['sha256'][:12] or '?'}), dims {g['dims']}")
        if g["io"] is None:
            lines.append(f"  {g['missing']}")
            continue
        for kind in ("inputs", "outputs"):
            for t in g["io"][kind]:
                alias = f"  (in place: aliases {g['aliases'][t['name']]})" if t["name"] in g["aliases"] else ""
                lines.append(f"  {kind[:-1]:6} {t['name']:16} {t['dtype']:9} {t['shape']}{alias}")
    for graph, e in d["engines"].items():
        ccs = ", ".join(e["compute_capabilities"]) or "default set"
        lines.append(f"engine {graph}: {e['file']}, {e['flavor']} {e['trt_version']}, compute capability {ccs}; "
                     f"shapes {e.get('read', '')}")
        names = [p["name"] for p in e["profiles"]]
        lines.append("  profiles: " + "; ".join(f"{p['name']} tokens {p['tokens'][0]}..{p['tokens'][2]} "
                                                  f"(opt {p['tokens'][1]})" for p in e["profiles"]))
        if "engine" in e:
            for t in e["engine"]["tensors"]:
                shapes = " | ".join(t.get("profiles", [])) or str(t["shape"])
                alias = f"  aliases {t['aliases']}" if t["aliases"] else ""
                lines.append(f"  {t['mode']:6} {t['name']:16} {t['dtype']:9} {shapes}{alias}")
        else:
            for name, shapes in e["shapes"].items():
                alias = f"  aliases {e['aliases'][name]}" if name in e["aliases"] else ""
                lines.append(f"  {name:16} " + " | ".join(f"{n} {s}" for n, s in zip(names, shapes)) + alias)
    lines += [f"damaged: {problem}" for problem in d["damaged"]]
    return "\n".join(lines)


def verify_dir(directory: Path, full: bool = True, log=lambda _: None) -> str:
    """``xcompile verify DIR``: every file the dir needs against the sizes and hashes recorded when it
    was written (every byte; ``full=False``: the sampled check every load does). Returns a summary
    line; the first mismatch is a CompileError naming the file."""
    directory = Path(directory)
    start = time.perf_counter()
    try:
        manifest = Manifest.load(directory)
        names = manifest.needed_files()
        for name in names:
            manifest.verify(directory, [name], full=full)
            log(f"ok {name} ({_size(manifest.files[name]['size'])})")
    except EngineError as e:
        raise CompileError(str(e)) from None
    size = sum(manifest.files[n]["size"] for n in names)
    return (f"{directory}: {len(names)} files, {_size(size)} match the manifest "
            f"({'every byte' if full else 'sampled blocks'}, {time.perf_counter() - start:.2f} s)")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
