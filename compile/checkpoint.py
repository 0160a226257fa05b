"""Checkpoints: find them (local dir, HF cache, alias), read them lazily, load them strictly.

Loading is a declarative key map (STYLE rule 2): every checkpoint key is mapped to a module tensor
or ignored with a reason, every module tensor is filled, and every shape and dtype is checked before
a weight is read; errors name the file and the tensor. Our parameter names equal the HF keys
(``model.layers.N.*``, ``lm_head.weight``; ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d`` for an EAGLE3 head), so the maps are identities plus the exceptions they spell out.

Models are built on the meta device and filled tensor by tensor from memory-mapped files, so a
checkpoint never sits in memory twice (an 8B target has to load in 24 GB of RAM).
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError, safe_open
from torch import nn

from xcompile.compile.config import (
    KNOWN_MODELS, Eagle3Config, KnownModel, Qwen3Config, check_eagle3_fits, parse_eagle3, parse_qwen3, read_json,
)
from xcompile.compile.errors import CompileError
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.layers import Rotary, rope_tables
from xcompile.compile.models.qwen3 import Qwen3

# weight layouts in the order we look for them (HF save_pretrained names)
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_INDEX, SAFETENSORS, TORCH_BIN_INDEX, TORCH_BIN)

# --------------------------------------------------------------------------------------------
# resolution: never a network call


@dataclass(frozen=True)
class LocalModel:
    """A checkpoint that ships inside the package (package data): its dir, and its EAGLE3 head's and
    small draft model's, if any."""

    path: Path
    eagle3_path: Path | None = None
    draft_path: Path | None = None


# The demo pair trained by scripts/train_demo.py (compile/demo/README.md): a 7M-param Qwen3 on
# CPython's documentation, its EAGLE3 head and a 1.2M-param draft model on its tokenizer, so every
# command runs offline from a fresh clone.
DEMO_DIR = Path(__file__).parent / "demo"
LOCAL_MODELS: dict[str, LocalModel] = {
    "demo": LocalModel(DEMO_DIR / "target", DEMO_DIR / "eagle3", DEMO_DIR / "draft")}


def aliases() -> str:
    """Every alias ``resolve`` accepts, for error messages."""
    return ", ".join([*LOCAL_MODELS, *KNOWN_MODELS])


def hf_cache_dir() -> Path:
    """The HF hub cache, read from the environment at call time (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def fetch_command(repo_id: str) -> str:
    return f"hf download {repo_id}"


def _refetch_hint(path: Path) -> str:
    # only the message depends on the path: an HF cache snapshot says which repo to fetch again
    m = re.search(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots", str(path))
    if m:
        return f"fetch it again with `{fetch_command(m[1] + '/' + m[2])}`"
    return f"download the full checkpoint, e.g. `{fetch_command('<org>/<name>')} --local-dir {path}`"


def known_model(spec: str) -> KnownModel | None:
    """The KNOWN_MODELS entry for an alias (``qwen3-8b``) or its repo id (``Qwen/Qwen3-8B``)."""
    key = spec.lower()
    return KNOWN_MODELS.get(key) or next((m for m in KNOWN_MODELS.values() if m.repo_id.lower() == key), None)


def resolve(spec: str) -> Path:
    """A checkpoint dir from a local directory, an alias of ``LOCAL_MODELS`` (shipped in the package),
    an HF repo id already in the local cache, or an alias of ``config.KNOWN_MODELS``. Offline: a repo
    that is not cached is an error saying how to fetch it. A checkpoint directory named like an alias
    wins over the alias."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.absolute()
    local = LOCAL_MODELS.get(spec.lower())
    if local is not None:
        return _packaged(local.path, spec)
    if path.is_dir():
        raise CompileError(f"{path}: not a checkpoint directory (no config.json)")
    known = KNOWN_MODELS.get(spec.lower())
    repo_id = known.repo_id if known else spec
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
        if "/" in spec or "\\" in spec or spec.startswith((".", "~")):
            raise CompileError(f"{spec}: no such directory")
        raise CompileError(f"unknown model alias {spec!r}; known aliases: {aliases()} "
                           "(or pass a checkpoint directory or a Hugging Face repo id org/name)")
    cache = hf_cache_dir()
    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    except ValueError as e:                       # huggingface_hub's HFValidationError
        raise CompileError(f"{repo_id}: not a valid Hugging Face repo id ({e})") from None
    if not isinstance(found, str):                # None or the cached "does not exist" marker
        raise CompileError(f"{repo_id} is not a local directory and not in the Hugging Face cache ({cache}); "
                           f"download it with `{fetch_command(repo_id)}` (older clients: "
                           f"`huggingface-cli download {repo_id}`)")
    return Path(found).parent


def resolve_eagle3(model_spec: str, eagle3: str | None) -> Path:
    """The EAGLE3 head dir: ``eagle3`` resolved like ``resolve``; empty or None means the head
    published for ``model_spec`` (``KnownModel.eagle3_repo_id``)."""
    if eagle3:
        return resolve(eagle3)
    local = LOCAL_MODELS.get(model_spec.lower())
    if local is not None and local.eagle3_path is not None:
        return _packaged(local.eagle3_path, model_spec)
    known = known_model(model_spec)
    if known is None or known.eagle3_repo_id is None:
        heads = [f"{alias} -> the packaged head" for alias, m in LOCAL_MODELS.items() if m.eagle3_path]
        heads += [f"{alias} -> {m.eagle3_repo_id}" for alias, m in KNOWN_MODELS.items() if m.eagle3_repo_id]
        raise CompileError(f"no published EAGLE3 head is known for {model_spec!r}; pass the head's directory or "
                           f"repo id explicitly (published heads: {', '.join(heads)})")
    return resolve(known.eagle3_repo_id)


def resolve_draft(spec: str) -> Path:
    """The draft model dir of ``--draft-model``: resolved like ``resolve``, except that an alias of
    ``LOCAL_MODELS`` that ships a draft means that draft (``demo`` -> the demo target's draft model).
    A checkpoint directory named like the alias still wins."""
    local = LOCAL_MODELS.get(spec.lower())
    if local is not None and local.draft_path is not None and not (Path(spec).expanduser() / "config.json").is_file():
        return _packaged(local.draft_path, spec)
    return resolve(spec)


def _packaged(path: Path, alias: str) -> Path:
    if not (path / "config.json").is_file():
        raise CompileError(f"{path}: the checkpoint of alias {alias!r} is missing from the installed package; "
                           "reinstall xcompile (its wheel carries compile/demo as package data)")
    return path


# --------------------------------------------------------------------------------------------
# reading weight files lazily

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class _SafetensorsFile:
    """One .safetensors file; the header is parsed at open, tensors are read on demand (mmap)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._f = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CompileError(f"{path}: not a readable safetensors file ({e}); the file is truncated or "
                               f"corrupt: {_refetch_hint(path)}") from None
        self._keys = list(self._f.keys())

    def keys(self) -> list[str]:
        return self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        name = self._f.get_slice(key).get_dtype()
        if name not in _SAFETENSORS_DTYPES:
            raise CompileError(f"{self.path}: tensor '{key}' has dtype {name}, which xcompile cannot load")
        return _SAFETENSORS_DTYPES[name]

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._f.get_tensor(key)
        except SafetensorError as e:
            raise CompileError(f"{self.path}: cannot read tensor '{key}' ({e})") from None


class _TorchFile:
    """One pytorch_model.bin (torch.save zip format): loaded with weights_only and mmap, so tensors
    are paged in when read."""

    def __init__(self, path: Path):
        self.path = path
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
            raise CompileError(f"{path}: not a readable torch checkpoint ({str(e).splitlines()[0]}); the file is "
                               f"truncated or corrupt: {_refetch_hint(path)}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CompileError(f"{path}: expected a flat dict of tensors (a state dict)")
        self._state = state

    def keys(self) -> list[str]:
        return list(self._state)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._state[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._state[key].dtype

    def get(self, key: str) -> torch.Tensor:
        return self._state[key]


class Checkpoint:
    """The weights of one checkpoint dir: ``model.safetensors``, sharded safetensors with
    ``model.safetensors.index.json``, or ``pytorch_model.bin`` (sharded or not). Headers are read
    at construction (so a bad file fails here, by name); tensors are read by ``get``."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        present = [name for name in WEIGHT_FILES if (self.path / name).is_file()]
        if not present:
            raise CompileError(f"{self.path}: no weights (looked for {', '.join(WEIGHT_FILES)}); "
                               f"{_refetch_hint(self.path)}")
        name = present[0]
        reader = _TorchFile if name.startswith("pytorch_model") else _SafetensorsFile
        if name.endswith(".index.json"):
            self._files = self._open_shards(self.path / name, reader)
        else:
            f = reader(self.path / name)
            self._files = dict.fromkeys(f.keys(), f)

    def _open_shards(self, index: Path, reader) -> dict:
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CompileError(f"{index}: field 'weight_map' should map tensor names to shard files")
        shards = {}
        for shard in sorted(set(weight_map.values())):
            if not (self.path / shard).is_file():
                raise CompileError(f"{self.path / shard}: shard file listed in {index.name} is missing; "
                                   f"{_refetch_hint(self.path)}")
            shards[shard] = reader(self.path / shard)
        for shard, f in shards.items():
            listed = {k for k, v in weight_map.items() if v == shard}
            if listed - set(f.keys()):
                raise CompileError(f"{index}: lists tensor '{min(listed - set(f.keys()))}' in {shard}, which has no "
                                   "such tensor (bad index)")
            if set(f.keys()) - listed:
                raise CompileError(f"{f.path}: holds tensor '{min(set(f.keys()) - listed)}' that {index.name} does "
                                   "not list (bad index)")
        return {k: shards[v] for k, v in weight_map.items()}

    def keys(self) -> list[str]:
        return list(self._files)

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def file(self, key: str) -> Path:
        """The file that holds ``key`` (a shard for sharded checkpoints)."""
        return self._files[key].path

    def shape(self, key: str) -> tuple[int, ...]:
        return self._files[key].shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._files[key].dtype(key)

    def get(self, key: str) -> torch.Tensor:
        return self._files[key].get(key)


# --------------------------------------------------------------------------------------------
# key maps


@dataclass(frozen=True)
class KeyMap:
    """How a module's state (unique parameters + persistent buffers) is filled from a checkpoint.

    tensors   module state name -> checkpoint key; present unless ``derived`` can make it
    ignored   checkpoint key regex (full match) -> why nothing reads such a key
    external  module state filled from another model, not from this checkpoint
    derived   module state name -> builds it from the checkpoint when its key is absent
    checks    module state name -> validates the tensor's values (tensor, file) after reading
    """

    tensors: dict[str, str]
    ignored: dict[str, str] = field(default_factory=dict)
    external: frozenset[str] = frozenset()
    derived: dict[str, Callable[[Checkpoint], torch.Tensor]] = field(default_factory=dict)
    checks: dict[str, Callable[[torch.Tensor, Path], None]] = field(default_factory=dict)


_ROPE_CACHE = "RoPE tables are recomputed from rope_theta"
_QWEN3_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
_QWEN3_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")


def qwen3_key_map(cfg: Qwen3Config) -> KeyMap:
    """Qwen3ForCausalLM: HF keys are our names. Tied embeddings have no lm_head of their own."""
    layer = _QWEN3_LAYER + (_QWEN3_BIAS if cfg.attention_bias else ())
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    names += [f"model.layers.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in layer]
    ignored = {r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq": _ROPE_CACHE}
    if cfg.tie_word_embeddings:
        ignored[r"lm_head\.weight"] = "tie_word_embeddings: the output projection is model.embed_tokens.weight"
    else:
        names.append("lm_head.weight")
    return KeyMap({n: n for n in names}, ignored)


_EAGLE3_NAMES = (
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
)


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d [vocab] bool: which target ids the draft vocabulary covers (target = draft + d2t[draft])."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.shape[0]) + d2t] = True
    return t2d


def _check_d2t(cfg: Eagle3Config, d2t: torch.Tensor, file: Path) -> None:
    ids = torch.arange(d2t.shape[0]) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise CompileError(f"{file}: tensor 'd2t' maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, "
                           f"outside the target vocabulary [0, {cfg.vocab_size}); d2t holds offsets "
                           "(target = draft + d2t[draft])")


def eagle3_key_map(cfg: Eagle3Config) -> KeyMap:
    """AngelSlim/EAGLE layout (reference/eagle3_semantics.md §5-6); the embedding is the target's."""
    return KeyMap(
        {n: n for n in _EAGLE3_NAMES},
        ignored={
            r"(model\.)?embed_tokens\.weight": "the head embeds tokens with the target's table (eagle3_semantics §6.2)",
            r"midlayer\.self_attn\.rotary_emb\.inv_freq": _ROPE_CACHE,
        },
        external=frozenset({"embed_tokens.weight"}),
        # t2d is unused at inference (vLLM/sglang skip it); some heads do not ship it
        derived={"t2d": lambda ckpt: t2d_from_d2t(ckpt.get("d2t"), cfg.vocab_size)},
        checks={"d2t": partial(_check_d2t, cfg)},
    )


def key_map_for(model: nn.Module) -> KeyMap:
    if isinstance(model, Eagle3):
        return eagle3_key_map(model.cfg)
    if isinstance(model, Qwen3):
        return qwen3_key_map(model.cfg)
    raise TypeError(f"no key map for {type(model).__name__}")


def module_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unique parameters and persistent buffers by name, tied tensors once (first name wins)."""
    seen, state = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            state[name] = t
    return state


def _few(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _plan(checkpoint: Checkpoint, model: nn.Module, key_map: KeyMap) -> dict[str, str]:
    """Check the checkpoint against the module before reading a weight; returns name -> key."""
    state = module_state(model)
    wanted = set(state) - key_map.external
    assert wanted == set(key_map.tensors), sorted(wanted ^ set(key_map.tensors))   # map and module agree
    config = checkpoint.path / "config.json"
    keys = set(checkpoint.keys())
    missing = sorted(k for n, k in key_map.tensors.items() if k not in keys and n not in key_map.derived)
    if missing:
        raise CompileError(f"{checkpoint.path}: missing tensor {_few(missing)} that {config.name} implies; the "
                           f"checkpoint is incomplete or not of this model: {_refetch_hint(checkpoint.path)}")
    mapped = set(key_map.tensors.values())
    unexpected = sorted(k for k in keys - mapped if not any(re.fullmatch(p, k) for p in key_map.ignored))
    if unexpected:
        raise CompileError(f"{checkpoint.file(unexpected[0])}: unexpected tensor {_few(unexpected)}; the weights "
                           f"do not match {config} (wrong config, or a model xcompile does not know)")
    for name, key in key_map.tensors.items():
        if key not in keys:
            continue
        want, got = state[name], checkpoint.shape(key)
        if got != tuple(want.shape):
            raise CompileError(f"{checkpoint.file(key)}: tensor '{key}' has shape {list(got)}, expected "
                               f"{list(want.shape)} from {config}")
        dtype = checkpoint.dtype(key)
        # floating-point weights are cast to the requested dtype; d2t/t2d must match exactly
        ok = dtype.is_floating_point if want.is_floating_point() else dtype == want.dtype
        if not ok:
            expected = "a floating-point dtype" if want.is_floating_point() else str(want.dtype)
            raise CompileError(f"{checkpoint.file(key)}: tensor '{key}' is {dtype}, expected {expected}")
    return {name: key_map.tensors[name] for name in state if name in key_map.tensors}


def iter_state(checkpoint: Checkpoint, model: nn.Module, key_map: KeyMap | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (module state name, tensor) for ``model`` (which may live on the meta device), one
    tensor in memory at a time, floating-point tensors cast to the model's dtype. The whole
    checkpoint is checked before the first tensor is read. External state (an EAGLE3 head's
    ``embed_tokens.weight``: the target's ``model.embed_tokens.weight``) is not yielded."""
    key_map = key_map or key_map_for(model)
    plan = _plan(checkpoint, model, key_map)
    state = module_state(model)
    for name, key in plan.items():
        tensor = checkpoint.get(key) if key in checkpoint else key_map.derived[name](checkpoint)
        if name in key_map.checks:
            key_map.checks[name](tensor, checkpoint.file(key) if key in checkpoint else checkpoint.path)
        yield name, tensor.to(state[name].dtype) if tensor.is_floating_point() else tensor


def _rope_theta(model: nn.Module) -> float:
    return model.rope_theta if isinstance(model, Eagle3) else model.cfg.rope_theta


def materialize(model: nn.Module, state: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device: torch.device | str) -> nn.Module:
    """Replace the meta tensors of ``model`` by ``state``'s (floating-point ones in ``dtype``) on
    ``device``, keeping tied parameters tied; RoPE tables are recomputed. Returns it in eval mode."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for attr, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            owners.setdefault(id(t), []).append((mod, attr))
    current = module_state(model)
    with torch.no_grad():
        for name, tensor in state:
            old = current[name]
            assert tuple(tensor.shape) == tuple(old.shape), (name, tensor.shape, old.shape)
            new = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
            if isinstance(old, nn.Parameter):
                new = nn.Parameter(new, requires_grad=False)
            for mod, attr in owners[id(old)]:
                setattr(mod, attr, new)
    for mod in model.modules():
        if isinstance(mod, Rotary):                 # non-persistent [S_max, D/2] tables, rebuilt
            max_positions, half = mod.cos.shape
            cos, sin = rope_tables(2 * half, max_positions, _rope_theta(model))
            mod.cos, mod.sin = cos.to(device), sin.to(device)
    left = [n for n, t in module_state(model).items() if t.is_meta]
    assert not left, left
    return model.eval()


# --------------------------------------------------------------------------------------------
# loaders


def tap_layers(head_cfg: Eagle3Config, target_cfg: Qwen3Config) -> tuple[int, ...]:
    """The head's tap ids (0-based output-of-layer) from its config, else the target's defaults."""
    return head_cfg.tap_layers if head_cfg.tap_layers is not None else target_cfg.default_tap_layers


def load_qwen3(path: Path, max_seq_len: int, taps: tuple[int, ...] | None = None,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Qwen3:
    """A Qwen3 target (with EAGLE3 taps if given) from a checkpoint dir, strictly."""
    path = Path(path)
    cfg = parse_qwen3(path / "config.json")
    if taps and not all(0 <= t < cfg.num_hidden_layers for t in taps):
        raise CompileError(f"{path / 'config.json'}: tap layers {list(taps)} outside the model's "
                           f"{cfg.num_hidden_layers} layers")
    checkpoint = Checkpoint(path)
    with torch.device("meta"):
        model = Qwen3(cfg, max_seq_len, taps).to(dtype)     # free on meta; tensors are then read as dtype
    return materialize(model, iter_state(checkpoint, model), dtype, device)


def load_draft_model(path: Path, target_cfg: Qwen3Config, max_seq_len: int, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> Qwen3:
    """A small draft Qwen3; it proposes target token ids, so it must share the target's vocabulary."""
    path = Path(path)
    cfg = parse_qwen3(path / "config.json")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise CompileError(f"{path / 'config.json'}: vocab_size {cfg.vocab_size} differs from the target's "
                           f"{target_cfg.vocab_size}; a draft model must share the target's tokenizer "
                           "(e.g. Qwen3-0.6B for Qwen3-8B)")
    return load_qwen3(path, max_seq_len, None, dtype, device)


def load_eagle3(path: Path, target: Qwen3, max_seq_len: int, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None, rope_theta: float | None = None) -> Eagle3:
    """An EAGLE3 head for ``target``, sharing its embedding tensor (so by default in the target's
    dtype and on its device). ``rope_theta`` overrides the config's θ (eagle3_semantics §6.3)."""
    path = Path(path)
    config = path / "config.json"
    cfg = parse_eagle3(config)
    taps = tap_layers(cfg, target.cfg)
    check_eagle3_fits(cfg, target.cfg, config, taps)
    if tuple(sorted(taps)) != target.taps:
        raise CompileError(f"{config}: the head reads target layers {list(taps)}, but the target was built with "
                           f"taps {list(target.taps)}; load the target with taps=tap_layers(head_cfg, target_cfg)")
    embed = target.model.embed_tokens.weight
    dtype = dtype or embed.dtype
    device = torch.device(device) if device is not None else embed.device
    if dtype != embed.dtype or device.type != embed.device.type or device.index not in (None, embed.device.index):
        raise CompileError(f"{config}: the head shares the target's embedding ({embed.dtype} on {embed.device}); "
                           f"load it with that dtype and device, not {dtype} on {device}")
    checkpoint = Checkpoint(path)
    with torch.device("meta"):
        head = Eagle3(cfg, max_seq_len, rope_theta).to(dtype)
    head.embed_tokens.weight = embed                # shared, not copied: external in the key map
    return materialize(head, iter_state(checkpoint, head), dtype, embed.device)
