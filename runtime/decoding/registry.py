"""What drafts each round: the drafter registry and the spec a request gives.

``DRAFTERS`` maps a drafter name to the graphs it needs and how it is made from a ``DrafterSpec`` (a chain
of gamma tokens, or an EAGLE3 tree); ``auto`` takes the first the dir holds. Adding a drafter is one
entry; the CLI's choices are its keys. The drafters are imported inside functions: ``xrun --help`` stays
instant (tests/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xcompile.runtime.common.errors import EngineError, OptionError
from xcompile.runtime.enginedir.contract import DRAFT, EAGLE3, EAGLE3_FC, MTP
from xcompile.runtime.engines.load import AUTO, EngineSet

if TYPE_CHECKING:
    from xcompile.runtime.decoding.drafters import Drafter
    from xcompile.runtime.enginedir.manifest import Manifest

DEFAULT_GAMMA = 4       # draft tokens per chain round when none is asked for

@dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 dynamic tree: ``topk`` children per expanded node, ``depth`` draft steps per round,
    ``total_tokens`` drafts verified per round. Defaults: SGLang's for Qwen3-8B heads
    (docs/eagle3.md §4: steps 6, top-k 10, 32 draft tokens, from the Tengyunw/qwen3_8b_eagle3 model card)."""

    topk: int = 10
    depth: int = 6
    total_tokens: int = 32

    def __post_init__(self):
        for name, flag in (("topk", "--tree-topk"), ("depth", "--tree-depth"), ("total_tokens", "--tree-tokens")):
            if getattr(self, name) < 1:
                raise EngineError(f"{flag} must be >= 1, got {getattr(self, name)}")

    @property
    def lookahead(self) -> int:
        """KV slots a round of this tree writes past the prompt: its verified block, or its widest draft step."""
        return max(self.total_tokens, self.topk * (self.depth - 1), self.depth + 1)


@dataclass(frozen=True)
class DrafterSpec:
    """What drafts each round: ``name`` (a ``DRAFTERS`` key, or ``auto``: the first the dir holds) with a
    chain of ``gamma`` tokens, or, for a drafter that drafts trees (eagle3), the ``tree``."""

    name: str = AUTO
    gamma: int = DEFAULT_GAMMA
    tree: TreeShape | None = None
    gamma_given: bool = field(default=False, compare=False)     # --gamma set, not DEFAULT_GAMMA (refused unused)

    def __post_init__(self):
        if self.name != AUTO and self.name not in DRAFTERS:
            raise EngineError(f"--drafter {self.name!r}: expected one of {', '.join(DRAFTER_CHOICES)}")
        if self.gamma < 1:
            raise EngineError(f"--gamma must be >= 1, got {self.gamma}")
        if self.tree is not None and self.name != AUTO and not DRAFTERS[self.name].tree:
            raise EngineError(f"--tree-* options: the {self.name} drafter drafts chains (use --gamma), only "
                              f"{', '.join(n for n, k in DRAFTERS.items() if k.tree)} draft trees")

    @classmethod
    def from_options(cls, drafter: str = AUTO, gamma: int | None = None, tree_topk: int | None = None,
                     tree_depth: int | None = None, tree_tokens: int | None = None) -> DrafterSpec:
        """From CLI-style options: any tree option asks for a tree (the others take TreeShape's defaults)."""
        given = {k: v for k, v in (("topk", tree_topk), ("depth", tree_depth), ("total_tokens", tree_tokens))
                 if v is not None}
        if given and gamma is not None:
            raise EngineError("--gamma sets a chain, --tree-* a tree: give one or the other")
        return cls(drafter, DEFAULT_GAMMA if gamma is None else gamma, TreeShape(**given) if given else None,
                   gamma_given=gamma is not None)

    def resolve(self, es: EngineSet) -> DrafterSpec:
        """This spec with ``auto`` replaced by the first drafter the dir holds (one that drafts trees, if a
        tree is asked for); an explicit name is checked against what the dir holds."""
        name = self.name
        if name == AUTO:
            name = next(n for n, k in DRAFTERS.items() if k.holds(es))
            if self.tree is not None and not DRAFTERS[name].tree:
                raise OptionError(f"{es.directory or es.manifest.name}: --tree-* needs an EAGLE3 head or an MTP "
                                  "module, which the dir does not hold; rebuild with --eagle3 or --mtp, or use --gamma")
        kind = DRAFTERS[name]
        if not kind.holds(es):
            other = next(n for n, k in DRAFTERS.items() if k.holds(es))
            raise OptionError(f"{es.directory or es.manifest.name}: holds no {kind.what}; rebuild with "
                              f"{kind.rebuild}, or use --drafter {other}")
        return DrafterSpec(name, self.gamma, self.tree)

    @property
    def label(self) -> str:
        """``plain``, ``eagle3 chain g=4``, ``eagle3 tree 10/6/32``, ``draft-model g=2`` (bench rows); "chain"
        is said only for drafters that also draft trees."""
        if self.name == "none":
            return "plain"
        if self.tree is not None:
            return f"{self.name} tree {self.tree.topk}/{self.tree.depth}/{self.tree.total_tokens}"
        chain = "chain " if self.name in DRAFTERS and DRAFTERS[self.name].tree else ""
        return f"{self.name} {chain}g={self.gamma}"


@dataclass(frozen=True)
class DrafterKind:
    """A drafter: the graphs it runs (``what`` the dir must hold, added by the export option ``rebuild``),
    ``make(es, spec)`` building it, and whether it drafts trees."""

    graphs: tuple[str, ...]
    make: Callable[[EngineSet, DrafterSpec], Drafter]
    what: str = ""
    rebuild: str = ""
    tree: bool = False

    def holds(self, es: EngineSet) -> bool:
        return all(g in es.engines for g in self.graphs)


def _none(es: EngineSet, spec: DrafterSpec) -> Drafter:
    from xcompile.runtime.decoding.drafters import NoDrafter

    return NoDrafter()


def _draft_model(es: EngineSet, spec: DrafterSpec) -> Drafter:
    from xcompile.runtime.decoding.drafters import DraftModelDrafter

    return DraftModelDrafter(es.engines[DRAFT], spec.gamma)


def _eagle3(es: EngineSet, spec: DrafterSpec) -> Drafter:
    from xcompile.runtime.decoding.drafters import Eagle3ChainDrafter, Eagle3TreeDrafter

    e, cols = es.engines, es.manifest.tap_columns(EAGLE3)
    if spec.tree is not None:
        t = spec.tree
        return Eagle3TreeDrafter(e[EAGLE3], e[EAGLE3_FC], es.d2t, topk=t.topk, depth=t.depth,
                                 total_tokens=t.total_tokens, columns=cols)
    return Eagle3ChainDrafter(e[EAGLE3], e[EAGLE3_FC], es.d2t, spec.gamma, cols)


def _mtp(es: EngineSet, spec: DrafterSpec) -> Drafter:
    from xcompile.runtime.decoding.drafters import MTPChainDrafter, MTPTreeDrafter

    cols = es.manifest.tap_columns(MTP)
    size = es.manifest.models[MTP].extra.get("draft_vocab")
    if (size is None) != (es.mtp_d2t is None) or (size is not None and es.mtp_d2t.numel() != size):
        have = "none" if es.mtp_d2t is None else f"{es.mtp_d2t.numel()} tokens"
        raise EngineError(f"{es.directory or es.manifest.name}: the MTP module's draft vocabulary is {size or 'none'} "
                          f"in the manifest but its d2t map holds {have}; the dir is damaged or hand-edited: "
                          "re-export it (--force)")
    if spec.tree is not None:
        t = spec.tree
        return MTPTreeDrafter(es.engines[MTP], t.topk, t.depth, t.total_tokens, columns=cols, d2t=es.mtp_d2t)
    return MTPChainDrafter(es.engines[MTP], spec.gamma, cols, d2t=es.mtp_d2t)


# order is auto's preference (module docstring); "none" holds always, so auto always finds one
DRAFTERS: dict[str, DrafterKind] = {
    "eagle3": DrafterKind((EAGLE3, EAGLE3_FC), _eagle3, "EAGLE3 head", "--eagle3", tree=True),
    "mtp": DrafterKind((MTP,), _mtp, "MTP module", "--mtp", tree=True),
    "draft-model": DrafterKind((DRAFT,), _draft_model, "draft model", "--draft-model"),
    "none": DrafterKind((), _none),
}
DRAFTER_CHOICES = (AUTO, *DRAFTERS)


def make_drafter(es: EngineSet, spec: DrafterSpec | str = AUTO) -> Drafter:
    """The drafter ``spec`` asks for (a name alone: its default chain), from what the engine dir holds."""
    spec = (DrafterSpec(spec) if isinstance(spec, str) else spec).resolve(es)
    return DRAFTERS[spec.name].make(es, spec)


def held(kind: DrafterKind, manifest: Manifest) -> bool:
    """Whether the engine dir of ``manifest`` holds the graphs the drafter ``kind`` runs (``none``: always)."""
    return all(g in manifest.graphs for g in kind.graphs)


def check_spec(spec: DrafterSpec, directory, manifest: Manifest) -> None:
    """Before any engine loads: OptionError for a drafter the dir does not hold, a tree the drafter ``spec``
    resolves to would ignore (``auto`` picks as ``make_drafter`` does), or a round that leaves no room for a
    prompt; and an explicit --gamma (``gamma_given``) with no drafter to run."""
    drafter = spec.name
    if drafter == AUTO:
        drafter = next(name for name, kind in DRAFTERS.items() if held(kind, manifest))
    elif not held(DRAFTERS[drafter], manifest):
        kind, other = DRAFTERS[drafter], next(n for n, k in DRAFTERS.items() if held(k, manifest))
        raise OptionError(f"--drafter {drafter}: {directory} holds no {kind.what}; rebuild with {kind.rebuild}, or "
                          f"use --drafter {other}")
    auto = f" (--drafter auto picks {drafter} for {directory})" if spec.name == AUTO else ""
    if drafter == "none" and spec.tree:
        raise OptionError(f"--tree-* would do nothing: no drafter runs{auto}")
    if drafter == "none" and spec.gamma_given:
        raise OptionError(f"--gamma {spec.gamma} would do nothing: no drafter runs{auto}; drop it, or rebuild with "
                          "--eagle3, --mtp or --draft-model")
    if drafter == "draft-model" and spec.tree:
        raise OptionError(f"--tree-* shape the EAGLE3 or MTP tree; the draft model drafts a chain of --gamma "
                          f"tokens{auto}")
    # a round's block beside a prompt of one token at least: a longer one fits no prompt at all (the prompt check
    # would blame the prompt)
    block, option = (spec.tree.total_tokens + 1, f"--tree-tokens {spec.tree.total_tokens}") if spec.tree else \
        (spec.gamma + 1, f"--gamma {spec.gamma}")
    if drafter != "none" and block >= manifest.max_seq_len:
        raise OptionError(f"{option}: a round verifies {block} tokens, which leaves no room for a prompt in "
                          f"{directory}'s max_seq_len {manifest.max_seq_len}; draft fewer{auto}")
    t = spec.tree
    if t is not None and drafter != "none":
        need = t.lookahead
        if need + 1 > manifest.max_seq_len:
            raise OptionError(f"--tree-topk {t.topk} --tree-depth {t.depth} --tree-tokens {t.total_tokens}: a round "
                              f"writes {need} KV slots, which leaves no room for a prompt in {directory}'s "
                              f"max_seq_len {manifest.max_seq_len}; a smaller tree{auto}")
