"""The fast engines' weights, taken from a reference module by parameter name (the HF checkpoint keys): packed
(q/k/v and gate/up concatenated, the module's parameters re-pointed at the packed storage, so no weight is held
twice), RMSNorm weights folded into the projection they alone feed, quantized linears as the kernels' QLinear
blocks (runtime/engines/fast.py runs them)."""

from __future__ import annotations

import torch

from xcompile.runtime.common import logs
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.engines.kernels.linear import linear
from xcompile.runtime.engines.kernels.qlinear import QLinear, qlinear
from xcompile.runtime.engines.qweight import QWeight

log = logs.logger("fast")


class Packed:
    """Parameters of a reference module by name, with helpers that pack several into one tensor; ``quantized``:
    the codes of its quantized linears by parameter name (runtime/engines/qweight.py)."""

    def __init__(self, module: torch.nn.Module, quantized: dict[str, QWeight] | None = None):
        self.module = module
        self.params = dict(module.named_parameters(remove_duplicate=False))
        self.buffers = dict(module.named_buffers())
        self.quantized = quantized or {}

    def weights(self, names: list[str]) -> torch.Tensor | QLinear:
        """The [n_i, K] weights ``names`` stacked along rows: quantized (QLinear) where each of them is and the
        kernels take its blocks, else the parameters (``cat``)."""
        if all(n in self.quantized for n in names):
            try:
                return QLinear.pack([self.quantized[n] for n in names], self.get(names[0]).device)
            except ValueError as e:         # blocks the kernels do not tile: the dequantized parameters, said once
                log.warning(f"fast backend: {', '.join(names)} run dequantized (bf16 bytes): {e}")
        return self.cat(names) if len(names) > 1 else self.get(names[0])

    def get(self, name: str) -> torch.Tensor:
        if name not in self.params:
            raise EngineError(f"fast backend: the reference module has no parameter {name!r}")
        return self.params[name].data

    def has(self, name: str) -> bool:
        return name in self.params

    def cat(self, names: list[str]) -> torch.Tensor:
        """Concatenate the [n_i, K] weights ``names`` along rows, then re-point each parameter at its
        rows of the packed tensor (the old storage is freed: no weight is held twice)."""
        packed = torch.cat([self.get(n) for n in names])
        start = 0
        for n in names:
            rows = self.params[n].shape[0]
            self.params[n].data = packed[start:start + rows]
            start += rows
        return packed

    def fold(self, norm: str, weight: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        """Fold the RMSNorm weight ``norm`` into the [N, K] ``weight`` it alone feeds (W * g per column, in
        place, rounded once) and make the norm's weight ones (the module's a copy of its own): RMSNorm(x) W^T
        is unchanged but for that rounding, and a call whose 1/rms comes from row sums (linear.RowSums) then
        needs no prologue. Returns ``unit`` (the RowSums' ones), the fast layer's norm weight."""
        weight.mul_(self.get(norm)[None, :])
        self.params[norm].data = unit.clone()          # the module's own ones: ``unit`` is the kernels' token
        return unit

    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's RoPE tables cos/sin [positions, D/2] (fp32)."""
        cos = next((b for n, b in self.buffers.items() if n.endswith("rotary.cos")), None)
        sin = next((b for n, b in self.buffers.items() if n.endswith("rotary.sin")), None)
        if cos is None or sin is None:
            raise EngineError("fast backend: the reference module has no rotary.cos/sin tables")
        return cos.contiguous(), sin.contiguous()


class Layer:
    """One decoder layer's packed weights; the RMSNorm weights before gate/up (and, ``qk_norm``, before qkv)
    folded into them (Packed.fold) unless they are quantized (the kernel then applies the norm's weight)."""

    def __init__(self, p: Packed, prefix: str, qk_norm: bool, unit: torch.Tensor):
        a = f"{prefix}self_attn."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if p.has(f"{a}{proj}.bias"):
                raise EngineError("fast backend: attention biases are not supported; use --backend torch")
        self.qkv = p.weights([f"{a}q_proj.weight", f"{a}k_proj.weight", f"{a}v_proj.weight"])
        self.o = p.weights([f"{a}o_proj.weight"])
        self.q_norm = p.get(f"{a}q_norm.weight") if qk_norm else None
        self.k_norm = p.get(f"{a}k_norm.weight") if qk_norm else None
        self.gate_up = p.weights([f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"])
        # a Qwen3 layer's input norm feeds qkv alone; the EAGLE3 layer's feeds the embedding half of u
        self.ln1 = p.fold(f"{prefix}input_layernorm.weight", self.qkv, unit) if qk_norm and dense(self.qkv) else \
            p.get(f"{prefix}input_layernorm.weight")
        ln2 = f"{prefix}post_attention_layernorm.weight"
        self.ln2 = p.fold(ln2, self.gate_up, unit) if dense(self.gate_up) else p.get(ln2)
        self.down = p.weights([f"{prefix}mlp.down_proj.weight"])

    def projections(self) -> list[torch.Tensor | QLinear]:
        return [self.qkv, self.o, self.gate_up, self.down]


def dense(w: torch.Tensor | QLinear) -> bool:
    return isinstance(w, torch.Tensor)


def project(x: torch.Tensor, w: torch.Tensor | QLinear, **kwargs) -> torch.Tensor:
    """linear() for a dense weight, qlinear() for a quantized one (the same arguments)."""
    return linear(x, w, **kwargs) if dense(w) else qlinear(x, w, **kwargs)


def nbytes(w: torch.Tensor | QLinear) -> int:
    return w.numel() * w.element_size() if dense(w) else w.nbytes()
