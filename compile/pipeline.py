"""``xcompile export``: checkpoint (or synthetic weights) -> an engine dir of ONNX graphs.

    resolve -> parse configs (+ checks) -> meta-device modules (the plan: export_plan.py) -> export each graph,
    weights streamed tensor by tensor -> tokenizer files, d2t maps -> manifest.json

Atomic and locked (runtime/common/files.py): everything is written into a staging dir next to ``out`` and
renamed onto it at the end, so a failure (or Ctrl-C) leaves nothing half-written; an existing dir is
replaced only with ``force``, only when xcompile wrote it, and never when it holds an input.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from xcompile.compile.export import export_graph
from xcompile.compile.export_plan import ExportPlan, Part, plan_export
from xcompile.compile.hf_config import parse_generation_config, read_json
from xcompile.runtime.common import files, logs
from xcompile.runtime.enginedir import integrity
from xcompile.runtime.enginedir.manifest import D2T_FILES, GraphEntry, Manifest, io_table

Log = Callable[[str], None]

# the target's tokenizer, chat template and generation config, as HF checkpoints ship them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class ExportRequest:
    """What ``xcompile export`` asks for. ``eagle3``: None = no head, "" = the alias's published head."""

    model: str
    out: Path
    eagle3: str | None = None
    draft_model: str | None = None
    dtype: str = "bf16"
    max_seq_len: int | None = None      # None: min(export_plan.DEFAULT_MAX_SEQ_LEN, the model's context)
    max_batch: int = 1
    synthetic: bool = False
    seed: int = 0
    force: bool = False
    eagle3_taps: tuple[int, ...] | None = None   # 0-based layer-output ids overriding the head config's
    synthetic_layers: int | None = None          # --synthetic: the alias's shape with fewer (or more) layers
    revision: str | None = None                  # of the --model repo id (a branch, tag or commit)
    mtp: str | None = None                       # MTP module dir; "": the alias's packaged one (or synthetic)


def export_engine_dir(req: ExportRequest, log: Log = lambda _: None) -> Manifest:
    """Export the request's graphs into ``req.out`` atomically (runtime/common/files.py); returns the manifest."""
    plan = plan_export(req)
    with files.staged_dir(req.out, "xcompile export", inputs=plan.inputs, replace=req.force) as tmp:
        manifest = export_into(tmp, Path(req.out).absolute().name, req, plan, log)
    log(f"wrote {Path(req.out).absolute()}")
    return manifest


def export_into(directory: Path, name: str, req: ExportRequest, plan: ExportPlan, log: Log = lambda _: None
                ) -> Manifest:
    """Write the planned graphs, tokenizer, d2t and manifest (named ``name``) into the empty ``directory``."""
    parts, target_dir = plan.parts, plan.target_dir
    manifest = Manifest(name=name, dtype=req.dtype, max_seq_len=parts[0].module.max_seq_len,
                        max_batch=req.max_batch, models={p.key: p.entry for p in parts}, xcompile_version=_version())
    graphs = sum(len(p.module.graphs(p.key)) for p in parts)
    with logs.progress("export", graphs, "graphs") as bar:
        for p in parts:
            quantization = p.entry.extra.get("quantization")
            if quantization is not None:
                log(f"{p.key}: {quantization['method']} checkpoint, its quantized weights kept quantized "
                    "(DequantizeLinear in the graphs)")
            for graph, module in p.module.graphs(p.key):
                log(f"exporting {graph} ({type(module).__name__}, {req.dtype}) ...")
                bar.update(note=graph)
                done = export_graph(module, directory / f"{graph}.onnx", max_tokens=manifest.max_seq_len,
                                    weights=p.weights(), max_batch=req.max_batch)
                manifest.graphs[graph] = GraphEntry(done.onnx.name, p.key, io_table(done.spec), done.dims,
                                                    done.onnx_record["sha256"])
                manifest.files[done.onnx.name] = done.onnx_record
                manifest.files[f"{done.onnx.name}.data"] = done.data_record
                if quantization is not None:
                    quantization["graphs"][graph] = done.quantized
                bar.advance()
            if p.source.files():
                log(f"hashing the {p.key} checkpoint files ...")
            for record_name, record in p.source.records().items():
                manifest.inputs[f"{p.key}/{record_name}"] = record
    written = []
    for p in parts:
        if p.d2t is not None:
            _write_d2t(p, directory / D2T_FILES[p.key])
            written.append(D2T_FILES[p.key])
    if target_dir is not None:
        manifest.tokenizer_files = _copy_tokenizer(target_dir, directory)
        written += manifest.tokenizer_files
        manifest.eos_token_ids = list(parse_generation_config(
            target_dir / "generation_config.json", read_json(target_dir / "config.json")).eos_token_ids)
    manifest.files.update({n: integrity.record_file(directory / n) for n in written})
    manifest.save(directory)
    return manifest


# --------------------------------------------------------------------------------------------
# files


def _write_d2t(head: Part, path: Path) -> None:
    """The draft->target id offsets (target = draft + d2t[draft]) of an EAGLE3 head or an MTP module, as int64
    ``d2t``."""
    from safetensors.torch import save_file

    save_file({"d2t": head.d2t().to(torch.int64).contiguous()}, str(path))


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def _version() -> str:
    try:
        return version("xcompile")
    except PackageNotFoundError:
        return ""


def describe(manifest: Manifest) -> str:
    """One line about an exported dir, for the CLI."""
    return (f"{manifest.name}: {manifest.dtype}, max_seq_len {manifest.max_seq_len}, batch {manifest.max_batch}, "
            f"graphs {', '.join(manifest.graphs)}")
