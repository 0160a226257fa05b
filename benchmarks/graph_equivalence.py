"""Tokens of every drafter with and without whole-round CUDA graphs, against plain decoding, on a GPU.

    python benchmarks/graph_equivalence.py ENGINE_DIR [--backends torch,fast] [--num-prompts 4]

For each backend and drafter: how many prompts give the same tokens eagerly and with round graphs,
and how many equal plain greedy decoding (eager) on that backend; the first differing index of each
that does not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from xcompile.runtime.decoding.drafters import NoDrafter
from xcompile.runtime.decoding.generator import Generator, LoopOptions
from xcompile.runtime.decoding.registry import DrafterSpec, TreeShape, make_drafter
from xcompile.runtime.enginedir.text import Text
from xcompile.runtime.engines.load import open_engine_dir


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def generator(es, drafter, cuda_graphs: bool = False):
    """A Generator over the engine set's target, eager or recording whole rounds as CUDA graphs."""
    return Generator(es.engines["target"], drafter, [], es.manifest.max_seq_len,
                     options=LoopOptions(cuda_graphs=cuda_graphs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine_dir")
    ap.add_argument("--backends", default="torch,fast")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args()
    ids = Text(Path(args.engine_dir)).encode(Path("data/corpus.heldout.txt").read_text())
    prompts = [ids[i * 128:(i + 1) * 128] for i in range(args.num_prompts)]
    specs = [DrafterSpec("eagle3", 4), DrafterSpec("eagle3", tree=TreeShape(10, 6, 32)),
             DrafterSpec("eagle3", tree=TreeShape(4, 4, 16))]
    for backend in args.backends.split(","):
        with open_engine_dir(args.engine_dir, backend, "cuda") as es:
            plain = [generator(es, NoDrafter()).generate(p, args.new_tokens).tokens for p in prompts]
            for spec in specs:
                eager = generator(es, make_drafter(es, spec))
                graphed = generator(es, make_drafter(es, spec), cuda_graphs=True)
                e = [eager.generate(p, args.new_tokens).tokens for p in prompts]
                g = [graphed.generate(p, args.new_tokens).tokens for p in prompts]
                print(f"{backend:<6} {spec.label:<22} eager==graphs {sum(x == y for x, y in zip(e, g))}/{len(prompts)} "
                      f"{[first_diff(x, y) for x, y in zip(e, g)]}  eager==plain {sum(x == y for x, y in zip(e, plain))}"
                      f"/{len(prompts)} {[first_diff(x, y) for x, y in zip(e, plain)]}  graphs==plain "
                      f"{sum(x == y for x, y in zip(g, plain))}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
