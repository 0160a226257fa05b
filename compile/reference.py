"""The PyTorch reference modules of an engine dir, as ``torch``-backend engines.

The runtime reaches this through the ``xcompile.torch_models`` entry point (pyproject.toml), so
``xrun --backend torch`` works whenever the compile side is installed, while the runtime package
itself never imports model code. Weights come from where the manifest says the graphs came from:
the checkpoint dirs it records, or the same seeded synthetic weights (``synthetic-hash:<name>:<seed>``).
``qwen3_engine`` and ``eagle3_engines`` wrap any in-memory module the same way (training's acceptance
check, the runtime tests).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from xcompile.compile import synthetic
from xcompile.compile.checkpoint.source import CheckpointSource, WeightSource
from xcompile.compile.config import QWEN3_TRAINED_CONTEXT, Qwen3Config, Yarn, synthetic_eagle3_config
from xcompile.compile.errors import CompileError
from xcompile.compile.families import family
from xcompile.compile.models import mtp as mtp_model
from xcompile.compile.models import qwen3
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.runtime.enginedir.contract import DRAFT, EAGLE3, EAGLE3_FC, MTP, TARGET
from xcompile.runtime.enginedir.manifest import Manifest, ModelEntry
from xcompile.runtime.engines import qweight
from xcompile.runtime.engines.base import MODEL_TORCH_DTYPES, Engine
from xcompile.runtime.engines.torch_module import TorchEngine


def torch_engines(module: torch.nn.Module, role: str, max_seq_len: int | None = None,
                  batch: int = 1) -> dict[str, TorchEngine]:
    """Every contract graph ``module`` runs as in the ``role`` slot (a head: ``eagle3`` and ``eagle3_fc``), as
    torch engines in its own dtype and on its device, with KV for ``batch`` sequences of ``max_seq_len``
    tokens (default: the module's)."""
    w = next(module.parameters())
    return {graph: TorchEngine(m, m.graph_spec(graph), m.kv_shape(max_seq_len, batch), w.dtype, w.device)
            for graph, m in module.graphs(role)}


def qwen3_engine(module: Qwen3, graph: str = TARGET, max_seq_len: int | None = None, batch: int = 1) -> TorchEngine:
    """``module`` as the ``target`` (or ``draft``) graph, in its own dtype and on its device, with KV for
    ``batch`` sequences of ``max_seq_len`` tokens (default: the module's)."""
    return torch_engines(module, graph, max_seq_len, batch)[graph]


def eagle3_engines(head: Eagle3, max_seq_len: int | None = None) -> tuple[TorchEngine, TorchEngine]:
    """An EAGLE3 head as its ``eagle3`` step graph (one KV layer for ``max_seq_len`` tokens, default: the
    head's) and its ``eagle3_fc`` projection, in its own dtype and on its device."""
    engines = torch_engines(head, EAGLE3, max_seq_len)
    return engines[EAGLE3], engines[EAGLE3_FC]


def weight_source(entry: ModelEntry) -> WeightSource:
    """Where a manifest entry's weights come from: the seeded synthetic weights or the checkpoint dir it names."""
    found = synthetic.parse_source(entry.source)
    if found is not None:
        return synthetic.SyntheticSource(*found)
    path = Path(entry.source)
    if not path.is_dir():
        raise CompileError(f"{path}: checkpoint recorded in the manifest is gone; the PyTorch reference (the torch "
                           "backend, xcompile diff) reloads weights from it: rebuild from where the checkpoint now "
                           "lives, or run the engines with --backend ort/trt")
    return CheckpointSource(path)


def reference_engines(manifest: Manifest, device: torch.device | str, dtype: torch.dtype | None = None,
                      verify: bool = False, quantized: bool = False) -> dict[str, Engine]:
    """Torch engines for every graph the manifest lists (target, eagle3 + eagle3_fc, mtp, draft), with the
    weights its sources name, in ``dtype`` (default: the manifest's). Each model's kind picks its family.
    A checkpoint must still be what the export read (its recorded sizes and hashes: sampled blocks, or
    every byte with ``verify``), else these would not be the exported weights. ``quantized``: a quantized
    checkpoint's modules also keep its linears' codes (``Qwen3.quantized``, for the fast kernels)."""
    dtype = dtype or MODEL_TORCH_DTYPES[manifest.dtype]
    modules: dict[str, torch.nn.Module] = {}
    for role in sorted(manifest.models, key=lambda r: r != TARGET):     # the target first: a head shares its embedding
        entry = manifest.models[role]
        source = weight_source(entry)
        manifest.verify_inputs(role, full=verify)
        fam = family(entry.kind)
        cfg = fam.config_from(entry.config, f"manifest model {role!r}")
        modules[role] = fam.load(source, cfg, manifest.max_seq_len, dtype, device, modules.get(TARGET), entry.extra)
        if quantized and source.quantization is not None:
            module = modules[role]
            # kept on the host: the fast engines pack them onto the device (no third copy there)
            module.quantized = {name: source.quantized(module, name) for name in source.key_map(module).packed}
    # KV for the dir's max_batch sequences, as its graphs were exported (the continuous-batching loop's slots)
    return {graph: engine for role, module in modules.items()
            for graph, engine in torch_engines(module, role, batch=manifest.max_batch).items()}


def load_torch_models(source: Path | Manifest, device: torch.device | str, dtype: torch.dtype | None = None,
                      verify: bool = False, quantized: bool = False) -> dict[str, Engine]:
    """The engine dir's (or an in-memory manifest's) graphs as torch-backend engines (``verify``: hash
    every byte of the checkpoints, not sampled blocks; ``quantized``: keep quantized linears' codes too)."""
    manifest = source if isinstance(source, Manifest) else Manifest.load(source)
    return reference_engines(manifest, device, dtype, verify, quantized)


# synthetic quantization: what Qwen/Qwen3-8B-FP8 (128 x 128 blocks) and Qwen/Qwen3-8B-AWQ (groups of 128) hold
SYNTHETIC_SCHEMES = {qweight.FP8: (128, 128), qweight.INT4: (1, 128)}


def synthetic_manifest(name: str, max_seq_len: int, dtype: str = "bf16", eagle3: bool = True,
                       draft: str | None = None, seed: int = 0, mtp: bool = False, config: Qwen3Config | None = None,
                       max_batch: int = 1, yarn: float | None = None) -> Manifest:
    """An in-memory manifest of seeded synthetic weights in the shape of a known model (no files):
    what ``xrun bench --synthetic qwen3-8b`` runs. Seeds follow ``xcompile export --synthetic``; ``mtp``: an
    MTP module too, whose tap (the last layer) follows EAGLE3's (Manifest.tap_columns); ``config``: another
    shape under ``name``'s seeds (benchmarks/batch_decode.py cuts layers); ``max_batch``: the KV slots; ``yarn``: the
    target's RoPE stretched by that YaRN factor over QWEN3_TRAINED_CONTEXT, as Qwen3's model card sets it for long
    contexts (4: 131,072 positions; the heads keep their own RoPE, as a published head's config does)."""
    cfg = _synthetic_config(name, yarn, config)
    if max_seq_len > cfg.context_length:
        raise CompileError(f"max_seq_len {max_seq_len} exceeds {name}'s {cfg.context_source}")
    taps = cfg.default_tap_layers if eagle3 else ()
    taps = list(mtp_model.target_taps(taps, cfg) if mtp else taps)
    models = {TARGET: ModelEntry(qwen3.KIND, cfg.to_dict(), synthetic.source(name, seed), {"taps": taps})}
    if eagle3:
        head = synthetic_eagle3_config(cfg)
        models[EAGLE3] = ModelEntry(Eagle3.kind, head.to_dict(), synthetic.source(name, seed, EAGLE3),
                                    {"taps": list(cfg.default_tap_layers), "rope_theta": head.rope_theta})
    if mtp:
        models[MTP] = ModelEntry(mtp_model.KIND, mtp_model.mtp_config(cfg).to_dict(), synthetic.source(name, seed, MTP),
                                 mtp_model.manifest_extra(cfg, mtp_model.synthetic_draft_vocab(cfg)))
    if draft:
        models[DRAFT] = ModelEntry(qwen3.KIND, synthetic.known_config(draft).to_dict(),
                                   synthetic.source(draft, seed, DRAFT))
    return Manifest(name=f"synthetic-{name}", dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch,
                    models=models)


def _synthetic_config(name: str, yarn: float | None, config: Qwen3Config | None = None) -> Qwen3Config:
    """``config`` or ``name``'s, its RoPE stretched by the YaRN factor ``yarn`` over QWEN3_TRAINED_CONTEXT."""
    cfg = config or synthetic.known_config(name)
    return cfg if yarn is None else replace(cfg, rope_scaling=Yarn(yarn, QWEN3_TRAINED_CONTEXT))


def synthetic_positions(name: str, yarn: float | None = None, draft: str | None = None) -> tuple[int, str]:
    """The positions a synthetic ``name`` (stretched by YaRN ``yarn``) covers, and where that bound comes from;
    CompileOptionError naming --synthetic or --draft-model for a name with no synthetic shape."""
    if draft is not None:
        synthetic.known_config(draft, "--draft-model")
    cfg = _synthetic_config(name, yarn, synthetic.known_config(name, "--synthetic"))
    return cfg.context_length, cfg.context_source


def open_synthetic(name: str, max_seq_len: int, dtype: str, device: torch.device | str, eagle3: bool = True,
                   draft: str | None = None, seed: int = 0, quantize: str | None = None, mtp: bool = False,
                   yarn: float | None = None) -> tuple[Manifest, dict[str, Engine], dict[str, torch.Tensor]]:
    """Synthetic engines for ``xrun bench --synthetic``: manifest, torch engines and the d2t maps by graph (an
    EAGLE3 head's, an MTP module's with a draft vocabulary).
    ``quantize`` (``fp8`` or ``int4``): the target's decoder linears rounded to that scheme (SYNTHETIC_SCHEMES),
    as a quantized checkpoint of that shape would hold them; the head stays in ``dtype``. ``mtp``: an MTP module
    too; ``yarn``: synthetic_manifest's."""
    manifest = synthetic_manifest(name, max_seq_len, dtype, eagle3, draft, seed, mtp, yarn=yarn)
    engines = reference_engines(manifest, device)
    if quantize is not None:
        block = SYNTHETIC_SCHEMES[quantize]
        quantize_linears(engines[TARGET].module, quantize, block)
        manifest.models[TARGET].extra["quantization"] = {"method": "synthetic round-to-nearest", "kind": quantize,
                                                         "block": list(block)}
    d2t = {g: engines[g].module.d2t for g in (EAGLE3, MTP) if g in engines and hasattr(engines[g].module, "d2t")}
    return manifest, engines, d2t


@torch.no_grad()
def quantize_linears(model: Qwen3, kind: str, block: tuple[int, int]) -> None:
    """Round ``model``'s decoder-layer linears to ``kind`` in ``block``s (runtime/engines/qweight.py), in place:
    each parameter becomes its dequantized rounding and ``model.quantized`` holds the codes, as when a quantized
    checkpoint is loaded for the fast kernels (lm_head and the embedding stay, as quantized Qwen3 releases keep
    them)."""
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            q = qweight.quantize(module.weight, kind, block)
            module.weight.copy_(q.dequantize())
            model.quantized[f"model.layers.{name}.weight"] = q


def hf_peer(engines: dict[str, Engine]):
    """transformers' Qwen3ForCausalLM on the very same weight tensors (no copy), timed through
    ``generate()`` with a static cache: returns ``peer(prompt_ids, new_tokens) -> ms per token``."""
    import time

    import transformers

    target: Qwen3 = engines[TARGET].module
    c = target.cfg
    hf_cfg = transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        rope_scaling=c.rope_scaling.to_hf() if c.rope_scaling else None,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias, torch_dtype=target.lm_head.weight.dtype)
    device = target.lm_head.weight.device
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(hf_cfg)
    hf.load_state_dict(target.state_dict(), strict=False, assign=True)      # shares our tensors
    with torch.device(device):                                              # its inv_freq stayed on meta
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg)
    hf.eval()

    def run(ids: torch.Tensor, n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                    pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    @torch.inference_mode()
    def peer(prompt_ids: list[int], new_tokens: int) -> float:
        ids = torch.tensor([prompt_ids], device=device)
        run(ids, 2), run(ids, new_tokens)                                    # warm-up
        return 1e3 * (run(ids, new_tokens) - run(ids, 1)) / (new_tokens - 1)

    return peer
