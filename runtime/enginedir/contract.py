"""The engine I/O contract: every graph's inputs and outputs, declared once as data.

The exporter names its ONNX inputs/outputs from these tables, the builder derives optimization
profiles from them, and every runtime backend checks a loaded engine against them. Bump
``CONTRACT_VERSION`` whenever a name, dtype, rank or meaning changes; an engine dir records the
version it was built with and the runtime refuses a mismatch.

Symbolic dims (sizes fixed per engine are recorded in the manifest's ``dims``):

    batch        sequences in flight (1 for now; every graph keeps the axis)
    tokens       new tokens this call
    rows         rows whose logits are wanted (1 for prefill, ``tokens`` for verify)
    mask_keys    keys ``tree_mask`` covers, >= tokens (``eagle3`` and ``mtp``; ``tokens`` elsewhere)
    max_seq_len  static KV capacity per sequence
    kv_heads, head_dim, vocab, hidden, taps_hidden (3 * target hidden; 4 * with an MTP module), draft_vocab

Graphs:

    target  Qwen3 forward over ``tokens`` new tokens written at ``write_index``:
            logits of the selected rows and the three EAGLE3 taps. One graph serves prefill,
            decode and chain/tree verify: ``tree_mask`` says which new tokens see which.
    draft   the same graph for a small draft Qwen3 (no taps).
    eagle3  one EAGLE3 decoder step over ``tokens`` inputs (token embedding + hidden state).
    eagle3_fc  the EAGLE3 ``fc`` projection of target taps (3H -> H); kept apart so the
            ``eagle3`` graph takes one hidden width for target features and its own feedback.
    mtp     one step of a DeepSeek-V3-style MTP module (compile/models/mtp.py): the ``eagle3`` graph's
            inputs and outputs, logits over its ``draft_vocab`` (the target's ``vocab`` without one); its
            hidden input is the target's last layer output (one of the target's taps).

KV caches: input ``past_key_{i}`` [batch, kv_heads, max_seq_len, head_dim] is updated in place;
output ``present_key_{i}`` aliases it (TensorRT KVCacheUpdate / ORT TensorScatter in place).
Attention: the columns of ``tree_mask`` [batch, tokens, mask_keys] are the last ``mask_keys`` keys up
to the new ones, starting at ``origin[b] = write_index[b] + tokens - mask_keys``. New token i of
sequence b sees key j iff j < origin[b], or j = origin[b] + m with tree_mask[b, i, m] true. Slots
past write_index[b] + tokens are stale and never read. Target and draft take [batch, tokens, tokens]
(the columns are the new tokens); the ``eagle3`` graph's may cover more, so a tree level appended after
earlier temporary levels sees only its ancestors among them (runtime/decoding/drafters.py).
"""

from __future__ import annotations

from dataclasses import dataclass

CONTRACT_VERSION = 2     # 2: eagle3 tree_mask columns may reach before write_index (mask_keys)

TARGET, DRAFT, EAGLE3, EAGLE3_FC, MTP = "target", "draft", "eagle3", "eagle3_fc", "mtp"

# the axes that vary from call to call (every other dim is fixed per engine, recorded in ``dims``)
DYNAMIC_DIMS = ("tokens", "rows", "mask_keys")
GRAPHS = (TARGET, DRAFT, EAGLE3, EAGLE3_FC, MTP)

# dtype names as they appear in manifests ("model" resolves to the engine's compute dtype)
MODEL_DTYPE = "model"
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a graph."""

    name: str
    dtype: str                      # "int64", "bool" or MODEL_DTYPE
    shape: tuple[str, ...]          # symbolic dims, see module docstring
    aliases: str | None = None      # output written in place into this input


def past_key(i: int) -> str:
    """Name of layer ``i``'s key-cache input."""
    return f"past_key_{i}"


def past_value(i: int) -> str:
    """Name of layer ``i``'s value-cache input."""
    return f"past_value_{i}"


def present_key(i: int) -> str:
    """Name of layer ``i``'s key-cache output (aliases ``past_key(i)``)."""
    return f"present_key_{i}"


def present_value(i: int) -> str:
    """Name of layer ``i``'s value-cache output (aliases ``past_value(i)``)."""
    return f"present_value_{i}"


_KV_SHAPE = ("batch", "kv_heads", "max_seq_len", "head_dim")

_STEP_INPUTS = (
    TensorSpec("input_ids", "int64", ("batch", "tokens")),
    TensorSpec("position_ids", "int64", ("batch", "tokens")),
    TensorSpec("write_index", "int64", ("batch",)),
    TensorSpec("tree_mask", "bool", ("batch", "tokens", "tokens")),
    TensorSpec("logit_rows", "int64", ("batch", "rows")),
)


def dynamic_ranges(tokens, rows) -> dict:
    """Each dynamic dim's range, given those of ``tokens`` and ``rows`` (an optimization profile's):
    ``mask_keys`` shares ``tokens``' range."""
    return {"tokens": tokens, "rows": rows, "mask_keys": tokens}


def _kv_inputs(num_layers: int) -> tuple[TensorSpec, ...]:
    specs = []
    for i in range(num_layers):
        specs += [TensorSpec(past_key(i), MODEL_DTYPE, _KV_SHAPE), TensorSpec(past_value(i), MODEL_DTYPE, _KV_SHAPE)]
    return tuple(specs)


def _kv_outputs(num_layers: int) -> tuple[TensorSpec, ...]:
    specs = []
    for i in range(num_layers):
        specs += [
            TensorSpec(present_key(i), MODEL_DTYPE, _KV_SHAPE, aliases=past_key(i)),
            TensorSpec(present_value(i), MODEL_DTYPE, _KV_SHAPE, aliases=past_value(i)),
        ]
    return tuple(specs)


@dataclass(frozen=True)
class GraphSpec:
    """Names, dtypes and symbolic shapes of one graph's inputs and outputs, in call order."""

    graph: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    num_layers: int = 0             # KV layers (0 for graphs without a cache)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def step_inputs(self) -> tuple[TensorSpec, ...]:
        """What ``Engine.run`` takes: every input but the KV caches, which come last."""
        return self.inputs[: len(self.inputs) - 2 * self.num_layers]

    @property
    def step_outputs(self) -> tuple[TensorSpec, ...]:
        """What ``Engine.run`` returns: every output but the KV caches (written in place), which come last."""
        return self.outputs[: len(self.outputs) - 2 * self.num_layers]

    def aliases(self) -> dict[str, str]:
        """present output name -> past input name."""
        return {t.name: t.aliases for t in self.outputs if t.aliases}


def target_spec(num_layers: int, taps: bool = True) -> GraphSpec:
    """Target (or draft-model) graph: step inputs + KV in, logits (+ taps) + KV out."""
    outputs = [TensorSpec("logits", MODEL_DTYPE, ("batch", "rows", "vocab"))]
    if taps:
        outputs.append(TensorSpec("hidden_taps", MODEL_DTYPE, ("batch", "tokens", "taps_hidden")))
    return GraphSpec(
        TARGET if taps else DRAFT,
        _STEP_INPUTS + _kv_inputs(num_layers),
        tuple(outputs) + _kv_outputs(num_layers),
        num_layers,
    )


def eagle3_spec(graph: str = EAGLE3, vocab: str = "draft_vocab") -> GraphSpec:
    """EAGLE3 step: draft-vocab logits of the selected rows and the pre-norm hidden to feed back (the ``mtp``
    step: the same, over its draft vocabulary or the target's whole one)."""
    mask = TensorSpec("tree_mask", "bool", ("batch", "tokens", "mask_keys"))
    inputs = (_STEP_INPUTS[0], TensorSpec("hidden_states", MODEL_DTYPE, ("batch", "tokens", "hidden")),
              *(mask if t.name == "tree_mask" else t for t in _STEP_INPUTS[1:]))
    outputs = (
        TensorSpec("logits", MODEL_DTYPE, ("batch", "rows", vocab)),
        TensorSpec("hidden_out", MODEL_DTYPE, ("batch", "tokens", "hidden")),
    )
    return GraphSpec(graph, inputs + _kv_inputs(1), outputs + _kv_outputs(1), 1)


def eagle3_fc_spec() -> GraphSpec:
    """EAGLE3 ``fc``: target taps [B, S, 3H] -> the head's hidden input [B, S, H]."""
    return GraphSpec(
        EAGLE3_FC,
        (TensorSpec("hidden_taps", MODEL_DTYPE, ("batch", "tokens", "taps_hidden")),),
        (TensorSpec("hidden_states", MODEL_DTYPE, ("batch", "tokens", "hidden")),),
    )


def graph_spec(graph: str, num_layers: int = 0) -> GraphSpec:
    """The contract of ``graph`` (one of GRAPHS); ``num_layers`` counts the KV layers of target/draft."""
    if graph == TARGET:
        return target_spec(num_layers, taps=True)
    if graph == DRAFT:
        return target_spec(num_layers, taps=False)
    if graph == EAGLE3:
        return eagle3_spec()
    if graph == EAGLE3_FC:
        return eagle3_fc_spec()
    if graph == MTP:
        return eagle3_spec(MTP)
    raise ValueError(f"unknown graph {graph!r}; expected one of {GRAPHS}")

@dataclass(frozen=True)
class KVShape:
    """Static cache geometry of one graph: ``layers`` x (key, value) of [batch, kv_heads, max_seq_len, head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int
    max_seq_len: int
    batch: int = 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.max_seq_len, self.head_dim)
