"""The ``fast`` backend: decode, verify and draft steps on fused Triton kernels (runtime/engines/kernels/).

A fast engine wraps the torch backend's engine of the same graph: it takes the reference module's
weights (packed once, norms folded in: fast_weights.py), shares its KV buffers, and runs every step of up to
``MAX_ROWS`` tokens on the kernels; longer passes (prompts) run the reference module, whose cuBLAS
matmuls and SDPA are what a prefill needs. Per Qwen3 layer, a step is six launches plus the
attention reduction:

    linear(norm)   x -> qkv                    RMSNorm + fused QKV projection
    rope_kv        qkv -> q; k, v -> caches    q/k RMSNorm + RoPE + KV write
    attention      q, caches -> a              split-KV over the live length + reduction
    linear(+res)   x += a Wo^T
    linear(gated)  x -> silu(x Wg^T) * (x Wu^T)  RMSNorm + gate/up + SiLU*mul
    linear(+res)   x += h Wd^T                 (and the EAGLE3 tap copy)

In steps of several rows the two residual projections also leave x's row sums of squares (RowSums), from
which the next projection's RMSNorm takes its 1/rms: no norm launch there. The step's embedding gather
leaves them too, for the first layer's qkv. The kernels' open choices (PDL, the CUDA GEMV, the tile tables)
are the engines' ``kernels``, a frozen KernelConfig (runtime/engines/kernels/config.py); a benchmark may
replace it to time one engine under another.

Every step is device work with shapes fixed by the token count, so the Generator records whole
speculative rounds in one CUDA graph (``graph_capturable``). Weights are read by parameter name
(the HF checkpoint keys the reference modules keep), never through the model classes, so the
runtime stays free of the compile side.
"""

from __future__ import annotations

import dataclasses

import torch

from xcompile.runtime.common.errors import EngineError, OptionError
from xcompile.runtime.common.gpu import interpreted
from xcompile.runtime.enginedir.contract import DRAFT, EAGLE3, EAGLE3_FC, MTP, TARGET
from xcompile.runtime.engines.base import KV_FP8, SHORT_STEPS, Engine
from xcompile.runtime.engines.fast_weights import Layer, Packed, dense, nbytes, project
from xcompile.runtime.engines.kernels import MAX_ROWS, cuda_gemv
from xcompile.runtime.engines.kernels.attention import attention
from xcompile.runtime.engines.kernels.config import DEFAULT, KernelConfig
from xcompile.runtime.engines.kernels.linear import embedding, linear
from xcompile.runtime.engines.kernels.norm import embed_norms
from xcompile.runtime.engines.kernels.rope_kv import rope_kv
from xcompile.runtime.engines.kernels.tile_finish import RowSums
from xcompile.runtime.engines.torch_module import TorchEngine

WIDE_ROWS = 1024    # rows of a wide batch step (_FastEngine.wide): 16 sequences x 64 prompt tokens


def check_device(device: torch.device) -> None:
    """EngineError unless the kernels can run on ``device``."""
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return
    raise OptionError(f"--backend fast runs Triton kernels on a CUDA device, not on {device} (tests set "
                      "TRITON_INTERPRET=1 to run them on the CPU); use --backend torch or ort")


class _FastEngine(Engine):
    """What the fast engines share: the reference engine for long passes, the KV it shares, the step
    inputs. A target / draft step may carry B sequences of S tokens each (the batch loop's step, B*S up to
    MAX_ROWS rows): the projections take the B*S rows as any rows, rope_kv and attention give each sequence its
    own cache row, write_index and mask; the heads' too (the batch loop's drafts, runtime/decoding/batch_drafts.py)."""

    graph_capturable = True
    partial_batch = True        # the kernels index cache rows 0..B-1; the reference slices its buffers alike
    short_rows = MAX_ROWS
    # A batch step of B sequences x S <= MAX_ROWS tokens past MAX_ROWS rows in all (prompt chunks beside decode
    # rows) runs the step's own kernels for RoPE, the KV writes and attention (over each row's live keys) and
    # cuBLAS for the projections (kernels.linear.wide_linear): on the reference, every row's attention ran over
    # the whole cache, an additive mask and fp32 scores of S_max columns, and some 1,600 eager launches.
    wide = False

    @property
    def step_rows(self) -> int:
        return WIDE_ROWS if self.wide else MAX_ROWS

    def __init__(self, reference: TorchEngine, config: dict, kernels: KernelConfig = DEFAULT):
        super().__init__(reference.spec, reference.kv_shape, reference.dtype, reference.device)
        check_device(self.device)
        self.reference, self.config, self.kernels = reference, config, kernels
        self.eps = config["rms_norm_eps"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config["head_dim"]
        if self.head_dim < 16 or self.head_dim & (self.head_dim - 1):
            raise EngineError(f"fast backend: head_dim {self.head_dim} is not a power of two >= 16 (the attention "
                              "kernel's tile); use --backend torch")
        # the residual stream's row sums of squares, left by the o / down projections of steps of several
        # rows for the RMSNorm of the projection after them
        self.sums = RowSums(config["hidden_size"], self.dtype, self.device)
        if self.device.type == "cuda" and self.dtype == torch.bfloat16:
            cuda_gemv.library(self.device.index or 0)    # built / loaded now, not inside a graph capture

    def set_kv_dtype(self, dtype: torch.dtype) -> None:
        super().set_kv_dtype(dtype)
        self.reference.set_kv_dtype(dtype)          # long passes run it, on the same buffers

    def bind_kv(self, buffers) -> None:
        super().bind_kv(buffers)
        self.reference.bind_kv(buffers)

    def narrow_batch(self, batch: int) -> None:
        super().narrow_batch(batch)
        self.reference.narrow_batch(batch)

    def close(self) -> None:
        self.reference.close()
        super().close()

    def _attend(self, layer: Layer, qkv: torch.Tensor, k_cache, v_cache, pos, wi, mask, rope):
        """qkv -> attention output [S, Hq*D] (rope + cache write + split-KV attention)."""
        q = rope_kv(qkv, pos, wi, rope[0], rope[1], k_cache, v_cache, self.heads, self.kv_heads,
                    self.head_dim, layer.q_norm, layer.k_norm, self.eps, cfg=self.kernels)
        return attention(q, k_cache, v_cache, wi, mask, self.heads, cfg=self.kernels)

    def _decoder(self, layer: Layer, x: torch.Tensor, k_cache, v_cache, pos, wi, mask,
                 extra: torch.Tensor | None = None) -> None:
        """One Qwen3 decoder layer over x [S, H] in place (its row sums in ``self.sums``); ``extra``: a copy of
        its output (an EAGLE3 tap)."""
        sums, cfg = self.sums, self.kernels
        qkv = project(x, layer.qkv, norm=layer.ln1, eps=self.eps, sums=sums, cfg=cfg)
        a = self._attend(layer, qkv, k_cache, v_cache, pos, wi, mask, self.rope)
        project(a, layer.o, residual=x, out=x, sums_out=sums, cfg=cfg)
        g = project(x, layer.gate_up, norm=layer.ln2, eps=self.eps, gated=True, sums=sums, cfg=cfg)
        project(g, layer.down, residual=x, out=x, extra_out=extra, sums_out=sums, cfg=cfg)

    def run(self, **inputs):
        """A step of up to MAX_ROWS tokens in all on the kernels (``_step``); a wider batch step (``wide``) too;
        longer passes (prompts) on the reference module, whose cuBLAS matmuls and flash attention they need."""
        ids = inputs["input_ids"]
        batch, s = ids.shape
        if batch * s > MAX_ROWS and not (self.wide and s <= MAX_ROWS and batch * s <= WIDE_ROWS):
            return self.reference.run(**inputs)
        return self._step(ids.reshape(-1), inputs["position_ids"].reshape(-1), inputs["write_index"],
                          inputs["tree_mask"], inputs)

    def _step(self, ids, pos, wi, mask, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The graph's outputs for ids [B*S], positions [B*S], write_index [B] and tree_mask [B, S, W] (and
        ``inputs``' other tensors) on the kernels."""
        raise NotImplementedError

    @staticmethod
    def _logit_rows(picked: torch.Tensor, s: int) -> torch.Tensor:
        """logit_rows [B, R] (rows of each sequence's S) -> rows of the step's B*S."""
        if picked.shape[0] == 1:
            return picked[0]
        return (picked + torch.arange(0, picked.shape[0] * s, s, device=picked.device)[:, None]).reshape(-1)

    def _head(self, x: torch.Tensor, picked: torch.Tensor, batch: int, s: int) -> dict[str, torch.Tensor]:
        """A head's outputs from its last hidden rows x [B*S, H]: logits [B, R, V] at ``picked`` [B, R] and
        hidden_out [B, S, H]."""
        logits = linear(x, self.lm_head, norm=self.norm, eps=self.eps, rows=self._logit_rows(picked, s),
                        cfg=self.kernels)
        return {"logits": logits.view(batch, -1, logits.shape[-1]), "hidden_out": x.view(batch, s, -1)}


class FastQwen3Engine(_FastEngine):
    """The ``target`` / ``draft`` graph (a Qwen3) on the fused kernels, for one sequence or a batch of them."""

    kv_dtypes = (KV_FP8,)                   # rope_kv writes e4m3 codes, the attention reads them (an FP8 cache)

    def __init__(self, reference: TorchEngine, config: dict, taps: list[int] | tuple[int, ...] = (),
                 kernels: KernelConfig = DEFAULT, shared_head: bool = False):
        super().__init__(reference, config, kernels)
        p = Packed(reference.module, reference.module.quantized)
        unit = self.sums.unit
        self.layers = [Layer(p, f"model.layers.{i}.", qk_norm=True, unit=unit)
                       for i in range(config["num_hidden_layers"])]
        self.embed = p.get("model.embed_tokens.weight")
        self.lm_head = p.get("lm_head.weight")
        # tied, the embedding too; ``shared_head``, an MTP module's head too: either way not folded
        keep = shared_head or self.lm_head.data_ptr() == self.embed.data_ptr()
        self.norm = p.get("model.norm.weight") if keep else p.fold("model.norm.weight", self.lm_head, unit)
        self.rope = p.rope()
        # tap slot(s) of each tapped layer, in the order of the concatenated hidden_taps output
        self.taps = sorted(taps)
        self.hidden = config["hidden_size"]
        self.wide = all(dense(w) for layer in self.layers for w in layer.projections()) and dense(self.lm_head)

    def _step(self, ids, pos, wi, mask, inputs):
        batch, s = mask.shape[:2]
        sums, cfg = self.sums, self.kernels
        x = embedding(ids, self.embed, sums_out=sums, cfg=cfg)                # [B*S, H], and its row sums
        h = self.hidden
        taps = torch.empty(batch, s, len(self.taps) * h, dtype=x.dtype, device=x.device) if self.taps else None
        rows = taps.view(batch * s, -1) if self.taps else None
        for i, layer in enumerate(self.layers):
            slots = [j for j, t in enumerate(self.taps) if t == i]
            extra = rows[:, slots[0] * h:(slots[0] + 1) * h] if slots else None
            self._decoder(layer, x, self.kv[2 * i], self.kv[2 * i + 1], pos, wi, mask, extra)
            for j in slots[1:]:                                                # duplicate taps (tiny models)
                rows[:, j * h:(j + 1) * h] = x
        picked = self._logit_rows(inputs["logit_rows"], s)
        logits = linear(x, self.lm_head, norm=self.norm, eps=self.eps, rows=picked, cfg=cfg)
        out = {"logits": logits.view(batch, -1, logits.shape[-1])}
        if "hidden_taps" in self.spec.output_names:
            out["hidden_taps"] = taps
        return out

    def weight_bytes(self) -> int:
        """Bytes of weights a decoded token reads: every projection as stored, the norms, lm_head (one
        embedding row, negligible, is left out unless tied)."""
        norms = sum(t.numel() * t.element_size() for layer in self.layers
                    for t in (layer.ln1, layer.ln2, layer.q_norm, layer.k_norm))
        return (sum(nbytes(w) for layer in self.layers for w in layer.projections()) + norms
                + nbytes(self.lm_head) + nbytes(self.norm))


class FastEagle3Engine(_FastEngine):
    """The ``eagle3`` graph: one EAGLE3 decoder step (docs/eagle3.md §2-3) on the kernels:
    embedding + both input norms in one launch, then the layer as above with the hidden as residual."""

    def __init__(self, reference: TorchEngine, config: dict, kernels: KernelConfig = DEFAULT):
        super().__init__(reference, config, kernels)
        p = Packed(reference.module)
        self.layer = Layer(p, "midlayer.", qk_norm=False, unit=self.sums.unit)
        self.embed = p.get("embed_tokens.weight")
        self.hidden_norm = p.get("midlayer.hidden_norm.weight")
        self.lm_head = p.get("lm_head.weight")
        self.norm = p.fold("norm.weight", self.lm_head, self.sums.unit)
        self.rope = p.rope()
        # speculators / vLLM heads: the attention residual is hidden_norm(hidden) (compile/models/eagle3.py)
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.wide = True            # the batch loop's feed of prompt chunks (batch_drafts.py) as a wide step

    def _step(self, ids, pos, wi, mask, inputs):
        batch, s = mask.shape[:2]
        hidden = inputs["hidden_states"].reshape(batch * s, -1)                # [B*S, H]
        layer, cfg = self.layer, self.kernels
        # u = [input_layernorm(embed(ids)), hidden_norm(hidden)]: embedding first (§3)
        u = embed_norms(ids, self.embed, layer.ln1, hidden, self.hidden_norm, self.eps, cfg=cfg)
        qkv = linear(u, layer.qkv, cfg=cfg)
        a = self._attend(layer, qkv, self.kv[0], self.kv[1], pos, wi, mask, self.rope)
        h = hidden.shape[-1]
        residual = u[:, h:] if self.norm_before_residual else hidden           # u[:, H:] = hidden_norm(hidden)
        self.sums.reset()
        x = linear(a, layer.o, residual=residual, sums_out=self.sums, cfg=cfg)  # residual = the hidden
        g = linear(x, layer.gate_up, norm=layer.ln2, eps=self.eps, gated=True, sums=self.sums, cfg=cfg)
        self.sums.reset()                                                      # x changes next
        linear(g, layer.down, residual=x, out=x, cfg=cfg)
        return self._head(x, inputs["logit_rows"], batch, s)


class FastMTPEngine(_FastEngine):
    """The ``mtp`` graph (compile/models/mtp.py) on the kernels: embedding + enorm / hnorm in one launch (the
    EAGLE3 step's), eh_proj, a Qwen3 decoder layer as the target's, and the target's lm_head behind the module's
    own norm (not folded: the target's tensor), or the rows of its draft vocabulary with the norm folded in."""

    def __init__(self, reference: TorchEngine, config: dict, kernels: KernelConfig = DEFAULT):
        super().__init__(reference, config, kernels)
        p = Packed(reference.module)
        self.layer = Layer(p, "", qk_norm=True, unit=self.sums.unit)
        self.embed, self.eh = p.get("embed_tokens.weight"), p.get("eh_proj.weight")
        self.enorm, self.hnorm = p.get("enorm.weight"), p.get("hnorm.weight")
        self.lm_head = p.get("shared_head.head.weight")
        # the target's own head is shared and left alone; a draft vocabulary's rows are the module's copy, so its
        # norm folds into them as the EAGLE3 head's does (1/rms then comes from the row sums)
        own = getattr(reference.module, "draft_vocab", None)
        self.norm = (p.fold("shared_head.norm.weight", self.lm_head, self.sums.unit) if own
                     else p.get("shared_head.norm.weight"))
        self.rope = p.rope()

    def _step(self, ids, pos, wi, mask, inputs):
        cfg = self.kernels
        batch, s = mask.shape[:2]
        hidden = inputs["hidden_states"].reshape(batch * s, -1)
        # u = [enorm(embed(ids)), hnorm(hidden)]: embedding first, as DeepSeek-V3 concatenates them
        u = embed_norms(ids, self.embed, self.enorm, hidden, self.hnorm, self.eps, cfg=cfg)
        x = linear(u, self.eh, sums_out=self.sums, cfg=cfg)
        self._decoder(self.layer, x, self.kv[0], self.kv[1], pos, wi, mask)
        return self._head(x, inputs["logit_rows"], batch, s)


class FastFCEngine(_FastEngine):
    """The ``eagle3_fc`` graph: taps [B, S, 3H] -> [B, S, H], one GEMV."""

    def __init__(self, reference: TorchEngine, config: dict, kernels: KernelConfig = DEFAULT):
        Engine.__init__(self, reference.spec, None, reference.dtype, reference.device)
        check_device(self.device)
        self.reference, self.kernels = reference, kernels
        self.fc = Packed(reference.module).get("fc.weight")

    def run(self, **inputs):
        """Up to SHORT_STEPS steps' rows (a short prompt's taps, drafters.prompt_pass) on the kernel, MAX_ROWS
        rows a call; more on the reference module."""
        taps = inputs["hidden_taps"]
        batch, s, width = taps.shape
        if batch * s > SHORT_STEPS * MAX_ROWS:
            return self.reference.run(**inputs)
        rows = taps.reshape(batch * s, width)
        parts = [linear(rows[i:i + MAX_ROWS], self.fc, cfg=self.kernels) for i in range(0, len(rows), MAX_ROWS)]
        return {"hidden_states": (parts[0] if len(parts) == 1 else torch.cat(parts)).view(batch, s, -1)}


def wrap(engines: dict[str, Engine], configs: dict[str, dict], taps: list[int],
         kernels: KernelConfig = DEFAULT) -> dict[str, Engine]:
    """The torch backend's engines of an engine dir -> fast engines. configs: graph -> its model's
    config (manifest); taps: the target's tapped layers; kernels: the kernels' open choices (row_invariant
    is the target's alone: the drafters' proposals never reach the output unverified)."""
    out = {}
    drafting = dataclasses.replace(kernels, row_invariant=False)
    for graph, engine in engines.items():
        if not isinstance(engine, TorchEngine):
            raise EngineError(f"fast backend: {graph} is not a torch-backend engine")
        if graph in (TARGET, DRAFT):
            # an MTP module without a draft vocabulary reads the target's head itself
            module = getattr(engines.get(MTP), "module", None)
            shared = graph == TARGET and module is not None and (
                module.shared_head.head.weight.data_ptr() == engine.module.lm_head.weight.data_ptr())
            out[graph] = FastQwen3Engine(engine, configs[graph], taps if graph == TARGET else (),
                                         kernels if graph == TARGET else drafting, shared_head=shared)
        elif graph == MTP:
            out[graph] = FastMTPEngine(engine, configs[graph], drafting)
        elif graph == EAGLE3:
            out[graph] = FastEagle3Engine(engine, configs[graph], drafting)
        elif graph == EAGLE3_FC:
            out[graph] = FastFCEngine(engine, configs[graph], drafting)
    return out
