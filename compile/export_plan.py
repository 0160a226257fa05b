"""``xcompile export``'s plan, decided before any weight is read: each model of the dir (target, EAGLE3 head, MTP
module, draft model) as its config, checks against the target, a meta-device module, where its weights come from and
its manifest entry (``Part``); the cache size; the checkpoint dirs the export reads (its output must stay clear of
them). pipeline.py writes what the plan says.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xcompile.compile import checkpoint as ckpt
from xcompile.compile import synthetic
from xcompile.compile.checkpoint.quantized import linear_weights
from xcompile.compile.checkpoint.source import CheckpointSource, WeightSource
from xcompile.compile.config import Eagle3Config, Qwen3Config, synthetic_eagle3_config
from xcompile.compile.errors import CompileError, CompileOptionError
from xcompile.compile.export import Weights
from xcompile.compile.families import family
from xcompile.compile.head_config import TAP_DEFAULT, TAP_OVERRIDE, check_eagle3_fits, tap_convention
from xcompile.compile.models import eagle3, mtp, qwen3
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.contract import DRAFT, EAGLE3, MTP, TARGET
from xcompile.runtime.enginedir.manifest import ModelEntry
from xcompile.runtime.enginedir.text import vocabulary
from xcompile.runtime.engines.base import MODEL_TORCH_DTYPES

if TYPE_CHECKING:
    from xcompile.compile.pipeline import ExportRequest

DEFAULT_MAX_SEQ_LEN = 4096
# export traces with 5 example tokens (export._EXAMPLE); the cache must hold more
MIN_SEQ_LEN = 8

# the family of each model slot (recorded as ModelEntry.kind)
_KINDS = {TARGET: qwen3.KIND, DRAFT: qwen3.KIND, EAGLE3: eagle3.KIND, MTP: mtp.KIND}


@dataclass
class Part:
    """One model of the dir: its meta-device module, where its weights come from, and its manifest entry."""

    key: str
    module: torch.nn.Module
    source: WeightSource
    entry: ModelEntry
    borrowed: Callable[[], Weights] = lambda: iter(())     # weights from another model (a head's embedding)
    d2t: Callable[[], torch.Tensor] | None = None

    def weights(self) -> Weights:
        """A fresh (name, tensor) stream over the whole module: one per exported graph."""
        return itertools.chain(self.source.tensors(self.module, quantized=True), self.borrowed())


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes, decided before any weight is read."""

    parts: list[Part]
    target_dir: Path | None

    @property
    def inputs(self) -> list[Path]:
        """The checkpoint dirs the export reads: its output must stay clear of them."""
        return sorted({path.parent for p in self.parts for path in p.source.files().values()})


def plan_export(req: ExportRequest) -> ExportPlan:
    """Check the request and plan the export (configs, checks, meta modules): fails before any work."""
    if req.dtype not in MODEL_TORCH_DTYPES:
        raise CompileOptionError(f"--dtype {req.dtype!r}: expected one of {', '.join(MODEL_TORCH_DTYPES)}")
    if req.max_batch < 1:
        raise CompileOptionError(f"--max-batch {req.max_batch}: must be at least 1")
    return ExportPlan(*_plan(req))


def _open(req: ExportRequest, role: str, target_cfg: Qwen3Config | None = None
          ) -> tuple[Qwen3Config | Eagle3Config, WeightSource, Path | None]:
    """The config, weight source and checkpoint dir (None: synthetic) of the dir's ``role`` model: the one
    place export tells a checkpoint from synthetic weights."""
    name = req.draft_model if role == DRAFT else req.model
    if req.synthetic_layers is not None and (not req.synthetic or req.synthetic_layers < 1):
        raise CompileOptionError(f"--synthetic-layers {req.synthetic_layers}: needs --synthetic and at least 1 layer")
    if req.synthetic:
        if role == EAGLE3 and req.eagle3 or role == MTP and req.mtp:
            raise CompileError(f"--synthetic builds the {role} model in its default shape; give --{role} without "
                               "a value")
        cfg = synthetic_eagle3_config(target_cfg) if role == EAGLE3 else mtp.mtp_config(target_cfg) \
            if role == MTP else synthetic.known_config(name, "--draft-model" if role == DRAFT else "--model")
        if role == TARGET and req.synthetic_layers:
            cfg = replace(cfg, num_hidden_layers=req.synthetic_layers)
        return cfg, synthetic.SyntheticSource.for_role(name.lower(), req.seed, role), None
    try:
        directory = (ckpt.resolve_eagle3(req.model, req.eagle3) if role == EAGLE3 else ckpt.resolve_mtp(req.model,
                     req.mtp) if role == MTP else ckpt.resolve_draft(name) if role == DRAFT else
                     ckpt.resolve(name, req.revision))
    except CompileError as e:                       # which option's checkpoint, where the message names none
        option = {EAGLE3: "--eagle3", MTP: "--mtp", DRAFT: "--draft-model"}.get(role, "--model")
        raise type(e)(str(e) if str(e).startswith("--") else f"{option} {e}") from None
    return family(_KINDS[role]).parse(directory / "config.json"), CheckpointSource(directory), directory


def _where(cfg_dir: Path | None, name: str) -> str:
    return str(cfg_dir / "config.json") if cfg_dir else f"the {name} config"


def _plan(req: ExportRequest) -> tuple[list[Part], Path | None]:
    dtype = MODEL_TORCH_DTYPES[req.dtype]
    cfg, source, target_dir = _open(req, TARGET)
    max_seq_len = _max_seq_len(req, cfg, target_dir)
    taps, head = cfg.default_tap_layers, None
    if req.eagle3_taps is not None:
        if req.eagle3 is None:
            raise CompileOptionError(f"{TAP_OVERRIDE} sets the EAGLE3 head's taps; add --eagle3")
        if len(req.eagle3_taps) != 3 or not all(0 <= t < cfg.num_hidden_layers for t in req.eagle3_taps):
            raise CompileOptionError(f"{TAP_OVERRIDE} {','.join(map(str, req.eagle3_taps))}: expected three "
                                     f"layer-output ids in 0..{cfg.num_hidden_layers - 1} (the target has "
                                     f"{cfg.num_hidden_layers} layers)")
    if req.eagle3 is not None:
        head = _open(req, EAGLE3, cfg)
        head_cfg, _, head_dir = head
        taps = req.eagle3_taps or ckpt.tap_layers(head_cfg, cfg)
        check_eagle3_fits(head_cfg, cfg, _where(head_dir, "synthetic head"), taps)
    # an MTP module reads the last layer's output: tapped after EAGLE3's three (Manifest.tap_columns)
    target_taps = mtp.target_taps(taps, cfg) if req.mtp is not None else tuple(taps)
    with torch.device("meta"):
        target = Qwen3(cfg, max_seq_len, target_taps).to(dtype)
    parts = [Part(TARGET, target, source, ModelEntry(qwen3.KIND, cfg.to_dict(), source.source,
                                                      _extra(source, target, taps=list(target.taps))))]
    if head is not None:
        field = TAP_OVERRIDE if req.eagle3_taps else head[0].tap_field or TAP_DEFAULT
        parts.append(_head_part(head[0], head[1], parts[0], dtype, field, tuple(sorted(taps))))
    if req.mtp is not None:
        parts.append(_mtp_part(req, parts[0], dtype))
    if req.draft_model is not None:
        parts.append(_draft_part(req, cfg, max_seq_len, dtype, target_dir))
        _check_smaller(parts[-1], target, req.draft_model)
    for p in parts:
        p.source.check(p.module)        # every key, shape and dtype (quantized tensors too), before any work
    return parts, target_dir


def _max_seq_len(req: ExportRequest, cfg: Qwen3Config, target_dir: Path | None) -> int:
    where = _where(target_dir, req.model)
    if req.max_seq_len is None:
        return min(DEFAULT_MAX_SEQ_LEN, cfg.context_length)
    if req.max_seq_len > cfg.context_length:
        raise CompileOptionError(f"--max-seq-len {req.max_seq_len} exceeds {cfg.context_source} of {where}; "
                                 "RoPE past it is untrained")
    if req.max_seq_len < MIN_SEQ_LEN:
        raise CompileError(f"--max-seq-len {req.max_seq_len}: must be at least {MIN_SEQ_LEN}")
    return req.max_seq_len


def _head_part(head_cfg: Eagle3Config, source: WeightSource, target: Part, dtype: torch.dtype,
               taps_from: str, taps: tuple[int, ...]) -> Part:
    with torch.device("meta"):
        head = Eagle3(head_cfg, target.module.max_seq_len).to(dtype)
    # which config field (or option) the taps came from and how its ids count (head_config.TAP_FIELDS)
    entry = ModelEntry(eagle3.KIND, head_cfg.to_dict(), source.source,
                       {"taps": list(taps), "taps_from": taps_from,
                        "taps_convention": tap_convention(taps_from), "rope_theta": head.rope_theta})

    def embedding() -> Weights:
        # the head embeds with the target's table: streamed from the target's weights under the head's name
        yield "embed_tokens.weight", target.source.tensor(target.module, "model.embed_tokens.weight")
    return Part(EAGLE3, head, source, entry, embedding, _early_d2t(source, head))


def _early_d2t(source: WeightSource, module: torch.nn.Module) -> Callable[[], torch.Tensor]:
    """A draft vocabulary's map, read (and value-checked by the key map) now, before any graph is exported."""
    d2t = source.tensor(module, "d2t").to(torch.int64)
    return lambda: d2t


def _mtp_part(req: ExportRequest, target: Part, dtype: torch.dtype) -> Part:
    """The MTP module: its config checked against the target; the target's embedding and lm_head streamed under
    the module's names (shared tensors, compile/models/mtp.py)."""
    cfg, source, mtp_dir = _open(req, MTP, target.module.cfg)
    mtp.check_mtp_fits(cfg, target.module.cfg, _where(mtp_dir, "synthetic MTP module"))
    vocab = ckpt.mtp_draft_vocab(source, cfg) if mtp_dir else mtp.synthetic_draft_vocab(cfg)
    with torch.device("meta"):
        module = mtp.MTP(cfg, target.module.max_seq_len, tied=target.module.cfg.tie_word_embeddings,
                         draft_vocab=vocab).to(dtype)
    entry = ModelEntry(mtp.KIND, cfg.to_dict(), source.source, mtp.manifest_extra(target.module.cfg, vocab))
    d2t = _early_d2t(source, module) if vocab else None

    def shared() -> Weights:
        t = target.module
        embed = target.source.tensor(t, "model.embed_tokens.weight")
        yield "embed_tokens.weight", embed
        if vocab:                       # the draft vocabulary's rows of the target's head (its embedding when tied)
            head = embed if module.tied else target.source.tensor(t, "lm_head.weight")
            yield "shared_head.head.weight", head[eagle3.target_ids(d2t())]
        elif not module.tied:
            yield "shared_head.head.weight", target.source.tensor(t, "lm_head.weight")
    return Part(MTP, module, source, entry, shared, d2t)


def _draft_part(req: ExportRequest, target_cfg: Qwen3Config, max_seq_len: int, dtype: torch.dtype,
                target_dir: Path | None) -> Part:
    cfg, source, draft_dir = _open(req, DRAFT)
    where = _where(draft_dir, req.draft_model)
    if cfg.vocab_size != target_cfg.vocab_size:
        raise CompileError(f"{where}: vocab_size {cfg.vocab_size} differs from the target's {target_cfg.vocab_size}; "
                           "a draft model must share the target's tokenizer (e.g. Qwen3-0.6B for Qwen3-8B)")
    if draft_dir is not None and target_dir is not None:
        _check_same_vocabulary(draft_dir, target_dir)
    if max_seq_len > cfg.context_length:
        raise CompileOptionError(f"--max-seq-len {max_seq_len} exceeds {cfg.context_source} of {where}")
    with torch.device("meta"):
        draft = Qwen3(cfg, max_seq_len).to(dtype)
    return Part(DRAFT, draft, source, ModelEntry(qwen3.KIND, cfg.to_dict(), source.source, _extra(source, draft)))


def _extra(source: WeightSource, module: torch.nn.Module, **extra) -> dict:
    """A model's manifest ``extra``, with how its checkpoint is quantized (compile/quantization.py) where it is;
    the export adds, per graph, how many weights it holds in each DequantizeLinear form (compile/qdq.py)."""
    if source.quantization is not None:
        linears = [name for _, name in linear_weights(module.key_map(), module)]
        extra["quantization"] = {**source.quantization.record(linears), "graphs": {}}
    return extra


def _check_smaller(draft: Part, target: Qwen3, name: str) -> None:
    """A draft model larger than its target makes every round cost more than the plain steps it could save: refused.
    The same size is kept (the target drafting for itself accepts every token, which the tests use)."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    if count(draft.module) > count(target):
        raise CompileError(f"--draft-model {name}: {count(draft.module) / 1e9:.2f}B parameters, more than the "
                           f"target's {count(target) / 1e9:.2f}B; a draft model must be smaller than its target "
                           "(e.g. Qwen3-0.6B for Qwen3-8B)")


def _check_same_vocabulary(draft_dir: Path, target_dir: Path) -> None:
    """A draft model proposes target token ids: the same size is not enough, every token must map to the
    same id (runtime/enginedir/text.py vocabulary)."""
    for d in (draft_dir, target_dir):
        if not (d / "tokenizer.json").is_file():
            raise CompileError(f"{d / 'tokenizer.json'}: missing; a draft model proposes target token ids, so "
                               "xcompile checks that both tokenizers map every token to the same id: add the "
                               "checkpoint's tokenizer files")
    try:
        draft, target = vocabulary(draft_dir), vocabulary(target_dir)
    except EngineError as e:
        raise CompileError(str(e)) from None
    if draft != target:
        tokens = sorted({t for t, _ in set(draft.items()) ^ set(target.items())})
        raise CompileError(f"{draft_dir / 'tokenizer.json'}: the draft model's vocabulary differs from the target's "
                           f"({target_dir / 'tokenizer.json'}) in {len(tokens)} token(s), e.g. {tokens[0]!r} -> "
                           f"{draft.get(tokens[0])} vs {target.get(tokens[0])}; a draft model must share the "
                           "target's tokenizer")
