"""Where a checkpoint lives: a local dir, an alias of ``config.KNOWN_MODELS`` (packaged or published),
or a Hugging Face repo id already in the local cache. Never a network call."""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from xcompile.compile.config import KNOWN_MODELS, KnownModel
from xcompile.compile.errors import CompileError, CompileOptionError


def aliases() -> str:
    """Every alias ``resolve`` accepts, for error messages."""
    return ", ".join(KNOWN_MODELS)


def hf_cache_dir() -> Path:
    """The HF hub cache, read from the environment at call time (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def fetch_command(repo_id: str) -> str:
    return f"hf download {repo_id}"


def refetch_hint(path: Path) -> str:
    """How to get a complete copy of the checkpoint at ``path``, its dir or one of its files (for errors about
    its files): --local-dir names the dir."""
    path = path.parent if path.suffix in (".safetensors", ".bin", ".json", ".pt", ".pth") else path
    # only the message depends on the path: an HF cache snapshot says which repo to fetch again
    m = re.search(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots", str(path))
    if m:
        return f"fetch it again with `{fetch_command(m[1] + '/' + m[2])}`"
    return f"download the full checkpoint, e.g. `{fetch_command('<org>/<name>')} --local-dir {path}`"


def known_model(spec: str) -> KnownModel | None:
    """The KNOWN_MODELS entry for an alias (``qwen3-8b``) or its repo id (``Qwen/Qwen3-8B``)."""
    key = spec.lower()
    return KNOWN_MODELS.get(key) or next(
        (m for m in KNOWN_MODELS.values() if m.repo_id is not None and m.repo_id.lower() == key), None)


def resolve(spec: str, revision: str | None = None) -> Path:
    """A checkpoint dir from a local directory, a packaged alias (``demo``), an HF repo id already in
    the local cache, or a published alias of ``config.KNOWN_MODELS``. Offline: a repo that is not
    cached is an error saying how to fetch it. A checkpoint directory named like an alias wins over
    the alias. ``revision`` (a branch, tag or commit of the repo, as ``hf download --revision``)
    picks the cached snapshot; it applies to repo ids (and the aliases that name one) only."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        _no_revision(revision, f"{spec} is a local directory")
        return path.absolute()
    known = KNOWN_MODELS.get(spec.lower())
    if known is not None and known.path is not None:
        _no_revision(revision, f"{spec} is packaged with xcompile")
        return _packaged(known.path, spec)
    if path.is_dir():
        raise CompileError(f"{path}: not a checkpoint directory (no config.json)")
    repo_id = known.repo_id if known else spec
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
        if "/" in spec or "\\" in spec or spec.startswith((".", "~")):
            raise CompileError(f"{spec}: no such directory; give a checkpoint directory, a Hugging Face repo id "
                               f"(org/name) or an alias ({aliases()})")
        raise CompileError(f"unknown model alias {spec!r}; known aliases: {aliases()} "
                           "(or pass a checkpoint directory or a Hugging Face repo id org/name)")
    cache = hf_cache_dir()
    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
    except ValueError as e:                       # huggingface_hub's HFValidationError
        raise CompileError(f"{repo_id}: not a valid Hugging Face repo id ({e})") from None
    if not isinstance(found, str):                # None or the cached "does not exist" marker
        at, rev = ("", "") if revision is None else (f" at revision {revision!r}", f" --revision {revision}")
        raise CompileError(f"{repo_id}{at} is not a local directory and not in the Hugging Face cache ({cache}); "
                           f"download it with `{fetch_command(repo_id)}{rev}` (older clients: "
                           f"`huggingface-cli download {repo_id}{rev}`)")
    return Path(found).parent


def _no_revision(revision: str | None, why: str) -> None:
    if revision is not None:
        raise CompileOptionError(f"--revision {revision}: {why}; a revision picks a snapshot of a Hugging Face repo "
                                 "id")


def resolve_eagle3(model_spec: str, eagle3: str | None) -> Path:
    """The EAGLE3 head dir: ``eagle3`` resolved like ``resolve``; empty or None means the head
    published (or packaged) for ``model_spec``."""
    if eagle3:
        return resolve(eagle3)
    packaged = KNOWN_MODELS.get(model_spec.lower())
    if packaged is not None and packaged.eagle3_path is not None:
        return _packaged(packaged.eagle3_path, model_spec)
    known = known_model(model_spec)
    if known is None or known.eagle3_repo_id is None:
        heads = [f"{alias} -> the packaged head" for alias, m in KNOWN_MODELS.items() if m.eagle3_path]
        heads += [f"{alias} -> {m.eagle3_repo_id}" for alias, m in KNOWN_MODELS.items() if m.eagle3_repo_id]
        raise CompileError(f"no published EAGLE3 head is known for {model_spec!r}; pass the head's directory or "
                           f"repo id explicitly (published heads: {', '.join(heads)})")
    return resolve(known.eagle3_repo_id)


def resolve_mtp(model_spec: str, module: str | None) -> Path:
    """The MTP module dir: ``module`` resolved like ``resolve``; empty or None means the module packaged for
    ``model_spec`` (the demo's; no Qwen3 release ships one: ``xcompile train-mtp`` makes one)."""
    if module:
        return resolve(module)
    packaged = KNOWN_MODELS.get(model_spec.lower())
    if packaged is not None and packaged.mtp_path is not None:
        return _packaged(packaged.mtp_path, model_spec)
    raise CompileError(f"no MTP module is known for {model_spec!r} (Qwen3 releases ship none); train one with "
                       "`xcompile train-mtp` and pass its directory: --mtp DIR")


def resolve_draft(spec: str) -> Path:
    """The draft model dir of ``--draft-model``: resolved like ``resolve``, except that an alias that
    ships a draft means that draft (``demo`` -> the demo target's draft model). A checkpoint
    directory named like the alias still wins."""
    known = KNOWN_MODELS.get(spec.lower())
    if known is not None and known.draft_path is not None and not (Path(spec).expanduser() / "config.json").is_file():
        return _packaged(known.draft_path, spec)
    return resolve(spec)


def _packaged(path: Path, alias: str) -> Path:
    if not (path / "config.json").is_file():
        raise CompileError(f"{path}: the checkpoint of alias {alias!r} is missing from the installed package; "
                           "reinstall xcompile (its wheel carries compile/demo as package data)")
    return path
