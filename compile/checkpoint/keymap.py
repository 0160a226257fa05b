"""Key maps applied: a module's state checked strictly against a checkpoint before any weight is read.

STYLE rule 2: every checkpoint key is mapped to a module tensor or ignored with a reason, every module
tensor is filled, and every shape and dtype is checked; errors name the file and the tensor. The maps
themselves live with each model family (``Qwen3.key_map``, ``Eagle3.key_map``; the ``KeyMap`` type in
compile/models/keymap.py), as nano-vllm keeps ``packed_modules_mapping`` on the model class.

Models are built on the meta device and filled tensor by tensor (``materialize``), so a checkpoint
never sits in memory twice (an 8B target has to load in 24 GB of RAM).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from xcompile.compile.checkpoint.files import Checkpoint
from xcompile.compile.checkpoint.resolution import refetch_hint
from xcompile.compile.errors import CompileError
from xcompile.compile.models.keymap import KeyMap
from xcompile.compile.models.layers import Rotary


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


def plan(checkpoint: Checkpoint, model: nn.Module, key_map: KeyMap) -> dict[str, str]:
    """Check the checkpoint against the module before reading a weight; returns name -> key (a packed
    tensor's first key), in the module's state order."""
    state = module_state(model)
    wanted = set(state) - key_map.external
    filled = set(key_map.tensors) | set(key_map.packed)
    assert wanted == filled, sorted(wanted ^ filled)      # map and module agree
    config = checkpoint.path / "config.json"
    keys = set(checkpoint.keys())
    stored = {s.key: s for p in key_map.packed.values() for s in p.stored}
    missing = sorted(k for n, k in key_map.tensors.items() if k not in keys and n not in key_map.derived)
    missing += sorted(k for k in stored if k not in keys)
    if missing:
        raise CompileError(f"{checkpoint.path}: missing tensor {_few(missing)} that {config.name} implies; the "
                           f"checkpoint is incomplete or not of this model: {refetch_hint(checkpoint.path)}")
    mapped = set(key_map.tensors.values()) | set(stored)
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
    for key, s in stored.items():
        if checkpoint.shape(key) != s.shape:
            raise CompileError(f"{checkpoint.file(key)}: tensor '{key}' has shape {list(checkpoint.shape(key))}, "
                               f"expected {list(s.shape)} ({s.why}, from {config})")
        if checkpoint.dtype(key) not in s.dtypes:
            raise CompileError(f"{checkpoint.file(key)}: tensor '{key}' is {checkpoint.dtype(key)}, expected "
                               f"{' or '.join(map(str, s.dtypes))} ({s.why})")
    first = {name: p.stored[0].key for name, p in key_map.packed.items()}
    return {name: key_map.tensors.get(name) or first[name] for name in state if name in wanted}


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
            cos, sin = mod.computed_tables()
            mod.cos, mod.sin = cos.to(device), sin.to(device)
    left = [n for n, t in module_state(model).items() if t.is_meta]
    assert not left, left
    return model.eval()
