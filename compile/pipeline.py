"""``xcompile export``: checkpoint (or synthetic weights) -> an engine dir of ONNX graphs.

    resolve -> parse configs (+ checks) -> meta-device modules -> export each graph, weights
    streamed tensor by tensor -> tokenizer files, d2t.safetensors -> manifest.json

Atomic and locked (runtime/files.py): everything is written into a staging dir next to ``out`` and
renamed onto it at the end, so a failure (or Ctrl-C) leaves nothing half-written; an existing dir is
replaced only with ``force``, only when xcompile wrote it, and never when it holds an input.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from xcompile.compile import checkpoint as ckpt
from xcompile.compile import synthetic
from xcompile.compile.config import (
    Eagle3Config, Qwen3Config, check_eagle3_fits, parse_eagle3, parse_generation_config, parse_qwen3,
    read_json, synthetic_eagle3_config,
)
from xcompile.compile.errors import CompileError
from xcompile.compile.export import Weights, export_graph, sha256_file
from xcompile.compile.models.eagle3 import Eagle3, Eagle3FC
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.runtime import files, integrity
from xcompile.runtime.contract import DRAFT, EAGLE3, EAGLE3_FC, TARGET
from xcompile.runtime.engine import MODEL_TORCH_DTYPES
from xcompile.runtime.manifest import D2T_FILE, GraphEntry, Manifest, ModelEntry, io_table

Log = Callable[[str], None]

DEFAULT_MAX_SEQ_LEN = 4096
# export traces with 5 example tokens (export._EXAMPLE); the cache must hold more
MIN_SEQ_LEN = 8
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
    max_seq_len: int | None = None      # None: min(DEFAULT_MAX_SEQ_LEN, max_position_embeddings)
    max_batch: int = 1
    synthetic: bool = False
    seed: int = 0
    force: bool = False


@dataclass
class _Part:
    """One model of the dir: its meta-device module(s), a weight stream factory, and its manifest entry."""

    key: str
    module: torch.nn.Module
    weights: Callable[[], Weights]
    entry: ModelEntry
    files: dict[str, Path]              # checkpoint files to hash, by manifest key
    d2t: Callable[[], torch.Tensor] | None = None


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes, decided before any weight is read."""

    parts: list[_Part]
    target_dir: Path | None

    @property
    def inputs(self) -> list[Path]:
        """The checkpoint dirs the export reads: its output must stay clear of them."""
        return sorted({path.parent for p in self.parts for path in p.files.values()})


def plan_export(req: ExportRequest) -> ExportPlan:
    """Check the request and plan the export (configs, checks, meta modules): fails before any work."""
    if req.dtype not in MODEL_TORCH_DTYPES:
        raise CompileError(f"--dtype {req.dtype!r}: expected one of {', '.join(MODEL_TORCH_DTYPES)}")
    if req.max_batch < 1:
        raise CompileError(f"--max-batch {req.max_batch}: must be at least 1")
    return ExportPlan(*_plan(req))


def export_engine_dir(req: ExportRequest, log: Log = lambda _: None) -> Manifest:
    """Export the request's graphs into ``req.out`` atomically (runtime/files.py); returns the manifest."""
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
    for p in parts:
        for graph, module in _graphs(p):
            log(f"exporting {graph} ({type(module).__name__}, {req.dtype}) ...")
            done = export_graph(module, directory / f"{graph}.onnx", max_tokens=manifest.max_seq_len,
                                weights=p.weights(), max_batch=req.max_batch)
            manifest.graphs[graph] = GraphEntry(done.onnx.name, p.key, io_table(done.spec), done.dims,
                                                done.onnx_record["sha256"])
            manifest.files[done.onnx.name] = done.onnx_record
            manifest.files[f"{done.onnx.name}.data"] = done.data_record
        for key, path in p.files.items():
            log(f"hashing {path.name} ...")
            manifest.inputs_sha256[key] = sha256_file(path)
    written = []
    for p in parts:
        if p.d2t is not None:
            _write_d2t(p, directory / D2T_FILE)
            written.append(D2T_FILE)
    if target_dir is not None:
        manifest.tokenizer_files = _copy_tokenizer(target_dir, directory)
        written += manifest.tokenizer_files
        manifest.eos_token_ids = list(parse_generation_config(
            target_dir / "generation_config.json", read_json(target_dir / "config.json")).eos_token_ids)
    manifest.files.update({n: integrity.record_file(directory / n) for n in written})
    manifest.save(directory)
    return manifest


# --------------------------------------------------------------------------------------------
# planning: configs, checks and meta modules; no weight is read here


def _plan(req: ExportRequest) -> tuple[list[_Part], Path | None]:
    dtype = MODEL_TORCH_DTYPES[req.dtype]
    if req.synthetic:
        cfg, target_dir = synthetic.known_config(req.model), None
        source = synthetic.source(req.model.lower(), req.seed)
        files = {}
    else:
        target_dir = ckpt.resolve(req.model)
        cfg = parse_qwen3(target_dir / "config.json")
        source, files = str(target_dir), _checkpoint_files("target", target_dir)
    max_seq_len = _max_seq_len(req, cfg, target_dir)
    head_cfg = head_dir = None
    taps = cfg.default_tap_layers
    if req.eagle3 is not None:
        if req.synthetic:
            if req.eagle3:
                raise CompileError("--synthetic builds the head in the published shape; give --eagle3 without a value")
            head_cfg = synthetic_eagle3_config(cfg)
        else:
            head_dir = ckpt.resolve_eagle3(req.model, req.eagle3)
            head_cfg = parse_eagle3(head_dir / "config.json")
            taps = ckpt.tap_layers(head_cfg, cfg)
            check_eagle3_fits(head_cfg, cfg, head_dir / "config.json", taps)
    with torch.device("meta"):
        target = Qwen3(cfg, max_seq_len, tuple(taps)).to(dtype)
    parts = [_Part(TARGET, target, _stream(req, target, target_dir), ModelEntry(
        "qwen3", cfg.to_dict(), source, {"taps": list(target.taps)}), files)]
    if head_cfg is not None:
        parts.append(_head_part(req, head_cfg, head_dir, target, target_dir, dtype))
    if req.draft_model is not None:
        parts.append(_draft_part(req, cfg, max_seq_len, dtype))
    return parts, target_dir


def _max_seq_len(req: ExportRequest, cfg: Qwen3Config, target_dir: Path | None) -> int:
    where = target_dir / "config.json" if target_dir else f"the {req.model} config"
    if req.max_seq_len is None:
        return min(DEFAULT_MAX_SEQ_LEN, cfg.max_position_embeddings)
    if req.max_seq_len > cfg.max_position_embeddings:
        raise CompileError(f"--max-seq-len {req.max_seq_len} exceeds max_position_embeddings "
                           f"{cfg.max_position_embeddings} of {where}; RoPE past it is untrained")
    if req.max_seq_len < MIN_SEQ_LEN:
        raise CompileError(f"--max-seq-len {req.max_seq_len}: must be at least {MIN_SEQ_LEN}")
    return req.max_seq_len


def _head_part(req: ExportRequest, head_cfg: Eagle3Config, head_dir: Path | None, target: Qwen3,
               target_dir: Path | None, dtype: torch.dtype) -> _Part:
    with torch.device("meta"):
        head = Eagle3(head_cfg, target.max_seq_len).to(dtype)
    # the head embeds with the target's table: stream it from the target's weights under the head's name
    embed = _target_embedding(req, target, target_dir)
    if req.synthetic:
        source, files = synthetic.source(req.model.lower(), req.seed, EAGLE3), {}
    else:
        source, files = str(head_dir), _checkpoint_files("eagle3", head_dir)
    entry = ModelEntry("eagle3", head_cfg.to_dict(), source, {"taps": list(target.taps), "rope_theta": head.rope_theta})
    own = _stream(req, head, head_dir, EAGLE3)
    if req.synthetic:
        seed = req.seed + synthetic.SEED_OFFSETS[EAGLE3]
        d2t = lambda: synthetic.synthetic_tensor(head, "d2t", head.d2t, seed)           # noqa: E731
    else:
        d2t = lambda: ckpt.Checkpoint(head_dir).get("d2t")                               # noqa: E731
    return _Part(EAGLE3, head, lambda: itertools.chain(own(), embed()), entry, files, d2t)


def _draft_part(req: ExportRequest, target_cfg: Qwen3Config, max_seq_len: int, dtype: torch.dtype) -> _Part:
    if req.synthetic:
        cfg, draft_dir = synthetic.known_config(req.draft_model), None
        source, files = synthetic.source(req.draft_model.lower(), req.seed, DRAFT), {}
    else:
        draft_dir = ckpt.resolve_draft(req.draft_model)
        cfg = parse_qwen3(draft_dir / "config.json")
        source, files = str(draft_dir), _checkpoint_files("draft", draft_dir)
    where = draft_dir / "config.json" if draft_dir else f"the {req.draft_model} config"
    if cfg.vocab_size != target_cfg.vocab_size:
        raise CompileError(f"{where}: vocab_size {cfg.vocab_size} differs from the target's {target_cfg.vocab_size}; "
                           "a draft model must share the target's tokenizer (e.g. Qwen3-0.6B for Qwen3-8B)")
    if max_seq_len > cfg.max_position_embeddings:
        raise CompileError(f"--max-seq-len {max_seq_len} exceeds max_position_embeddings "
                           f"{cfg.max_position_embeddings} of {where}")
    with torch.device("meta"):
        draft = Qwen3(cfg, max_seq_len).to(dtype)
    return _Part(DRAFT, draft, _stream(req, draft, draft_dir, DRAFT),
                 ModelEntry("qwen3", cfg.to_dict(), source), files)


def _stream(req: ExportRequest, module: torch.nn.Module, directory: Path | None,
            role: str = TARGET) -> Callable[[], Weights]:
    """A factory of (name, tensor) streams for ``module`` (the dir's ``role`` model): one per exported graph."""
    if req.synthetic:
        seed = req.seed + synthetic.SEED_OFFSETS[role]
        return lambda: synthetic.synthetic_state(module, seed)
    return lambda: ckpt.iter_state(ckpt.Checkpoint(directory), module)


def _target_embedding(req: ExportRequest, target: Qwen3, target_dir: Path | None) -> Callable[[], Weights]:
    name = "model.embed_tokens.weight"
    like = target.model.embed_tokens.weight

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        if req.synthetic:
            yield "embed_tokens.weight", synthetic.synthetic_tensor(target, name, like, req.seed)
        else:
            yield "embed_tokens.weight", ckpt.Checkpoint(target_dir).get(name).to(like.dtype)
    return stream


def _graphs(part: _Part) -> list[tuple[str, torch.nn.Module]]:
    if part.key == EAGLE3:
        return [(EAGLE3_FC, Eagle3FC(part.module)), (EAGLE3, part.module)]
    return [(part.key, part.module)]


# --------------------------------------------------------------------------------------------
# files


def _checkpoint_files(role: str, directory: Path) -> dict[str, Path]:
    """config + weight files (+ index) of a checkpoint dir, keyed ``<role>/<file>`` for the manifest."""
    names = ["config.json"]
    for index in (ckpt.SAFETENSORS_INDEX, ckpt.TORCH_BIN_INDEX):
        if (directory / index).is_file():
            names += [index, *sorted(set(read_json(directory / index).get("weight_map", {}).values()))]
            break
    else:
        names += [n for n in (ckpt.SAFETENSORS, ckpt.TORCH_BIN) if (directory / n).is_file()][:1]
    return {f"{role}/{n}": directory / n for n in names}


def _write_d2t(head: _Part, path: Path) -> None:
    """The head's draft->target id offsets (target = draft + d2t[draft]) as int64 ``d2t``."""
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
