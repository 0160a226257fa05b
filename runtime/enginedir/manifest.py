"""``manifest.json``: what an engine dir holds, written by the exporter/builder, checked by the runtime.

Layout of an engine dir (engines/README.md):

    manifest.json           this file
    target.onnx (+ .data)   graphs, one per entry of ``graphs``
    eagle3.onnx, eagle3_fc.onnx, draft.onnx   (those present)
    *.engine                TensorRT engines, one per entry of ``engines`` (after ``xcompile build``)
    tokenizer.json, tokenizer_config.json, ...   the target's tokenizer files
    d2t.safetensors         EAGLE3 draft->target id offsets (when an EAGLE3 head is present)
    mtp_d2t.safetensors     the same for an MTP module's draft vocabulary (when it has one)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir import integrity
from xcompile.runtime.enginedir.contract import CONTRACT_VERSION, EAGLE3, MTP, TARGET, GraphSpec, KVShape, TensorSpec
from xcompile.runtime.enginedir.schema import validate

MANIFEST = "manifest.json"
FORMAT = "xcompile-engine-dir"
D2T_FILE = "d2t.safetensors"
D2T_FILES = {EAGLE3: D2T_FILE, MTP: "mtp_d2t.safetensors"}     # by graph: its draft vocabulary's ids


def content_digest(data: dict) -> str:
    """sha256 of a manifest's fields but ``digest``, in a canonical JSON (sorted keys, no spaces): a manifest
    edited by hand (a vocab_size, taps, a dtype) no longer describes the graphs and weights it sits beside, and
    every field is read before them, so load() refuses it as a whole rather than fail later on one field."""
    fields_ = {k: v for k, v in data.items() if k != "digest"}
    return hashlib.sha256(json.dumps(fields_, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class ModelEntry:
    """One model of the dir: ``kind`` is "qwen3", "eagle3" or "mtp"; ``config`` the parsed config's fields;
    ``source`` the checkpoint dir it came from, or ``synthetic-hash:<name>:<seed>``."""

    kind: str
    config: dict
    source: str
    extra: dict = field(default_factory=dict)      # e.g. {"taps": [1, 17, 32]} or {"rope_theta": 1e6}


@dataclass
class GraphEntry:
    """One exported ONNX graph of the dir."""

    onnx: str                                      # file name inside the dir
    model: str                                     # key into Manifest.models
    io: dict                                       # {"inputs": [TensorSpec...], "outputs": [...]} as dicts
    dims: dict                                     # concrete sizes of the symbolic dims fixed at export
    sha256: str = ""                               # of the .onnx file (external data hashed separately)


@dataclass
class EngineEntry:
    """One TensorRT engine of the dir, with what it was built from and for."""

    file: str
    graph: str
    flavor: str                                    # "tensorrt" or "rtx"
    trt_version: str
    compute_capabilities: list = field(default_factory=list)
    profiles: list = field(default_factory=list)   # [{"name": "prefill", "tokens": [min, opt, max]}, ...]
    onnx_sha256: str = ""
    builder: dict = field(default_factory=dict)    # builder controls that were set: workspace, optimization_level


@dataclass
class Manifest:
    """Everything an engine dir holds; ``load`` checks format and contract version."""

    name: str
    dtype: str                                     # "fp32" | "fp16" | "bf16"
    max_seq_len: int
    max_batch: int
    models: dict[str, ModelEntry]                  # "target", and "eagle3", "mtp" and/or "draft"
    graphs: dict[str, GraphEntry] = field(default_factory=dict)
    engines: dict[str, EngineEntry] = field(default_factory=dict)
    eos_token_ids: list = field(default_factory=list)
    tokenizer_files: list = field(default_factory=list)
    files: dict = field(default_factory=dict)     # file of the dir -> size and hashes (runtime/enginedir/integrity.py)
    inputs: dict = field(default_factory=dict)    # "<model>/<file>" of the checkpoints exported -> size and hashes
    contract_version: int = CONTRACT_VERSION
    format: str = FORMAT
    xcompile_version: str = ""
    digest: str = ""                    # of every other field (content_digest), written by save()

    def to_json(self) -> str:
        data = asdict(self)
        data["digest"] = content_digest(data)
        return json.dumps(data, indent=2, sort_keys=False) + "\n"

    def save(self, directory: Path) -> None:
        path = Path(directory) / MANIFEST
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)

    @staticmethod
    def load(directory: Path) -> "Manifest":
        """The manifest of an engine dir, checked field by field (runtime/enginedir/schema.py)."""
        path = Path(directory) / MANIFEST
        if not Path(directory).is_dir():
            raise EngineError(f"{directory}: no such engine dir; build one with `xcompile build --model ...`")
        if not path.is_file():
            raise EngineError(f"{path}: missing; {directory} is not an xcompile engine dir (run `xcompile build`)")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise EngineError(f"{path}: unreadable ({e}); rebuild the engine dir with --force") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise EngineError(f"{path}: not an xcompile manifest; rebuild the engine dir with --force")
        if data.get("contract_version") != CONTRACT_VERSION:
            raise EngineError(f"{path}: built for I/O contract v{data.get('contract_version')}, this runtime speaks "
                              f"v{CONTRACT_VERSION}; rebuild with `xcompile build ... --force`")
        problem = validate(data)
        if problem is not None:
            raise EngineError(f"{path}: field '{problem[0]}' {problem[1]}; the manifest is damaged or hand-edited: "
                              "re-export the engine dir (--force)")
        if data["digest"] != content_digest(data):
            raise EngineError(f"{path}: edited since xcompile wrote it (its digest does not match its fields); "
                              "its sizes, taps and files describe the graphs and weights beside it, so re-export "
                              "the engine dir (--force) rather than edit it")
        m = Manifest(**data)
        m.models = {k: ModelEntry(**v) for k, v in m.models.items()}
        m.graphs = {k: GraphEntry(**v) for k, v in m.graphs.items()}
        m.engines = {k: EngineEntry(**v) for k, v in m.engines.items()}
        return m

    def tap_columns(self, head: str) -> slice | None:
        """The columns of the target's hidden_taps the ``head`` (``eagle3`` or ``mtp``) reads; None: all of them.
        A target built for both taps EAGLE3's three layers, then its last layer (sorted, the last comes last):
        EAGLE3 reads the first three taps, an MTP module the last one."""
        target = self.models[TARGET]
        taps = list(target.extra.get("taps") or ())
        n, h = len(taps), target.config["hidden_size"]
        module = self.models.get(head)
        if head != EAGLE3 and module is not None and (not taps or taps[-1] != module.extra.get("tap")):
            raise EngineError(f"{MANIFEST}: models.{head}.extra.tap is {module.extra.get('tap')}, but the target's "
                              f"last tap is {taps[-1] if taps else None}; the dir is damaged or hand-edited: "
                              "re-export it (--force)")
        cols = slice(0, 3 * h) if head == EAGLE3 else slice((n - 1) * h, n * h)
        return None if cols.stop - cols.start == n * h else cols

    def graph_files(self, graph: str) -> list[str]:
        """The files of ``graph``: its ONNX file and its external data."""
        onnx = self.graphs[graph].onnx
        return [onnx, f"{onnx}.data"] if f"{onnx}.data" in self.files else [onnx]

    def verify(self, directory: Path, names: list[str], full: bool = False) -> None:
        """Check files ``names`` of the dir against the sizes and hashes recorded when they were written:
        sampled blocks by default, every byte with ``full`` (runtime/enginedir/integrity.py)."""
        integrity.verify(directory, self.files, names, full=full,
                         fix="re-export the engine dir (`xcompile export/build ... --force`)")

    def verify_inputs(self, role: str, full: bool = False) -> None:
        """Check the checkpoint files ``role``'s model was exported from against what the export recorded
        (the torch backend loads them instead of the graphs: other bytes would be other weights)."""
        source = Path(self.models[role].source)
        records = {key.split("/", 1)[1]: r for key, r in self.inputs.items() if key.split("/", 1)[0] == role}
        integrity.verify(source, records, sorted(records), full=full,
                         fix="the checkpoint changed since the export, so the torch backend would not run the "
                             "exported weights: re-export from it (`xcompile export/build ... --force`), or run the "
                             "graphs with --backend ort/trt")

    def d2t_files(self) -> dict[str, str]:
        """graph -> the file of its draft vocabulary's d2t: an EAGLE3 head's always, an MTP module's when the
        module has a draft vocabulary (``extra.draft_vocab``)."""
        return {g: f for g, f in D2T_FILES.items() if g in self.graphs
                and (g == EAGLE3 or self.models[g].extra.get("draft_vocab"))}

    def needed_files(self) -> list[str]:
        """Every file the dir's graphs, engines, d2t maps and tokenizer need, then any other recorded one."""
        names = [f for g in self.graphs for f in self.graph_files(g)] + [e.file for e in self.engines.values()]
        names += list(self.d2t_files().values()) + list(self.tokenizer_files)
        return names + sorted(set(self.files) - set(names))

    def graph_spec(self, graph: str) -> GraphSpec:
        """``graph``'s I/O contract as its export recorded it (names, dtypes, symbolic shapes, aliases)."""
        io = self.graphs[graph].io
        return spec_from_io(graph, io, kv_layers(io))

    def kv_shape(self, graph: str) -> KVShape | None:
        """Static cache geometry of ``graph`` from the dims its export recorded (None: no KV cache)."""
        layers = kv_layers(self.graphs[graph].io)
        if not layers:
            return None
        dims = self.graphs[graph].dims
        try:
            return KVShape(layers, dims["kv_heads"], dims["head_dim"], dims.get("max_seq_len", self.max_seq_len),
                           dims.get("batch", self.max_batch))
        except KeyError as e:
            raise EngineError(f"manifest graph {graph!r} records no {e.args[0]!r} dim; re-export the engine "
                              "dir") from None


def kv_layers(io: dict) -> int:
    """KV layers of a graph from its recorded I/O table: each has a present key and value aliasing its past."""
    return sum(1 for t in io["outputs"] if t.get("aliases")) // 2


def io_table(spec: GraphSpec) -> dict:
    """A graph's I/O as the manifest records it (``GraphEntry.io``)."""
    return {"inputs": [asdict(t) for t in spec.inputs], "outputs": [asdict(t) for t in spec.outputs]}


def spec_from_io(graph: str, io: dict, num_layers: int) -> GraphSpec:
    """The GraphSpec an ``io_table`` was written from."""
    def specs(rows):
        return tuple(TensorSpec(r["name"], r["dtype"], tuple(r["shape"]), r.get("aliases")) for r in rows)

    return GraphSpec(graph, specs(io["inputs"]), specs(io["outputs"]), num_layers)
