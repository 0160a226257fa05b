"""``xcompile build`` end to end: export a checkpoint into an engine dir unless the dir already holds that export,
then build its engines (build.py), all in one staging dir; what an existing dir holds decides what is redone.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from xcompile.compile.build import BuildOptions, build_into, check_draft_tokens, check_options, open_manifest
from xcompile.compile.errors import CompileError
from xcompile.compile.export_plan import plan_export
from xcompile.compile.pipeline import export_into
from xcompile.compile.trt_loaders import Progress
from xcompile.runtime.common import files
from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.manifest import Manifest


def default_out(model: str) -> Path:
    """``engines/<name>``: the alias, or the last part of a repo id or directory."""
    return Path("engines") / Path(model.rstrip("/")).name.lower()


def request_differs(req, plan, manifest: Manifest) -> str | None:
    """How the export in ``manifest``'s dir differs from what request ``req`` (planned as ``plan``)
    asks for: graphs, dtype, sizes, sources (None: the same request). Replacing it needs --force."""
    wanted = {"target"} | ({"eagle3", "eagle3_fc"} if req.eagle3 is not None else set()) | (
        {"draft"} if req.draft_model is not None else set()) | ({"mtp"} if req.mtp is not None else set())
    if set(manifest.graphs) != wanted:
        return f"it holds graphs {sorted(manifest.graphs)}, the request wants {sorted(wanted)}"
    for field, have, want in (("dtype", manifest.dtype, req.dtype), ("max_batch", manifest.max_batch, req.max_batch),
                              ("max_seq_len", manifest.max_seq_len, req.max_seq_len or manifest.max_seq_len)):
        if have != want:
            return f"its {field} is {have}, the request's {want}"
    head = manifest.models.get("eagle3")
    taps = head.extra.get("taps") if head is not None else None         # the target's may end with MTP's tap
    if req.eagle3_taps is not None and sorted(req.eagle3_taps) != taps:
        return f"its EAGLE3 taps are {taps}, the request's --eagle3-taps {sorted(req.eagle3_taps)}"
    if req.eagle3_taps is None and head is not None and head.extra.get("taps_from") == "--eagle3-taps":
        return f"its EAGLE3 taps {taps} came from --eagle3-taps, the request reads the head's config"
    for part in plan.parts:
        have = manifest.models.get(part.key)
        if have is None or have.source != part.entry.source:
            return f"its {part.key} comes from {have.source if have else 'nowhere'}, the request's from " \
                   f"{part.entry.source}"
    return None


def inputs_changed(directory: Path, manifest: Manifest) -> str | None:
    """Why the dir's export is out of date although the request is the same (None: it is not):
    a checkpoint file changed since the export, or a graph file no longer matches its record."""
    for role in manifest.models:
        try:
            manifest.verify_inputs(role, full=True)
        except EngineError as e:
            return str(e).split("; ")[0]
    for graph in manifest.graphs:
        try:
            manifest.verify(directory, manifest.graph_files(graph), full=True)
        except EngineError as e:
            return str(e).split("; ")[0]
    return None


def export_and_build(req, options: BuildOptions = BuildOptions(), progress: Progress = print) -> Manifest:
    """``xcompile build``: export ``req`` (an ExportRequest) unless its dir already holds that export,
    then build every engine that is missing or stale; all in one staging dir (runtime/common/files.py), so
    an interrupted or failed build leaves the previous dir as it was. A dir holding another export
    (other dtype, graphs, sizes or sources) is replaced only with ``req.force``, which also re-exports
    and rebuilds everything; a dir whose checkpoint or graph files changed is re-exported."""
    check_options(options)                          # before a minutes-long export, not after it
    plan = plan_export(req)
    out = Path(req.out).absolute()
    check_draft_tokens(options, plan.parts[0].module.max_seq_len, out)       # before the export too
    with files.staged_dir(out, "xcompile build", inputs=plan.inputs, replace=True) as tmp:
        reason = "--force" if req.force else "no export there yet"
        if not req.force and (out / "manifest.json").is_file():
            manifest = open_manifest(out)
            differs = request_differs(req, plan, manifest)
            if differs is not None:
                raise CompileError(f"{out}: holds another export ({differs}); pass --force to replace it, or "
                                   "choose another --out")
            reason = inputs_changed(out, manifest)
        if reason is None:
            progress(f"{out}: ONNX graphs up to date, not re-exported")
            files.link_tree(out, tmp)
        else:
            progress(f"exporting into {out} ({reason})")
            export_into(tmp, out.name, req, plan, log=progress)
        return build_into(tmp, options if not req.force else replace(options, force=True), progress, shown=out,
                          check_graphs=False)
