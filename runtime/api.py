"""The runtime as a library: open an engine dir once, then generate for one or many prompts, or stream.

    from xcompile.runtime import LLM, SamplingParams

    with LLM("engines/qwen3-8b") as llm:                   # backend, device and drafter: auto
        for c in llm.generate(["The capital of France is", "def fib(n):"], max_new_tokens=64):
            print(c.text)
        c = llm.generate("Once upon a time", SamplingParams(temperature=0.6, top_p=0.95, n=2))[0]
        print([o.text for o in c.outputs])
        for piece in llm.stream("Explain speculative decoding.", max_new_tokens=200):
            print(piece, end="", flush=True)

Greedy output is plain greedy decoding's, whatever the drafter; sampling draws every token from the target's
warped distribution (speculative sampling). Prompts run one after another on the engines' one sequence slot;
on an engine dir exported with ``--max-batch N > 1`` they decode together, N at a time (runtime/decoding/batch.py),
each getting the tokens it gets alone, greedy ones verifying EAGLE3 / MTP chains in the same steps
(batch_drafts.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from xcompile.runtime.common.errors import EngineError, OptionError
from xcompile.runtime.common.logs import logger
from xcompile.runtime.decoding.outcome import Stats
from xcompile.runtime.decoding.registry import DRAFTERS, DrafterSpec, TreeShape
from xcompile.runtime.decoding.sampling import GENERATION_CONFIG, GREEDY, SamplingParams, generation_defaults, with_seed
from xcompile.runtime.decoding.warmup import Warmed, sampler_modes
from xcompile.runtime.engines.run_checks import check_kv_cache_dtype, resolve_device, set_kv_cache_dtype

if TYPE_CHECKING:
    from xcompile.runtime.decoding.batch import BatchGenerator
    from xcompile.runtime.decoding.generator import Generator
    from xcompile.runtime.engines.kernels.config import KernelConfig

Prompt = str | Sequence[int]           # text (the dir's tokenizer encodes it) or token ids
DEFAULT_NEW_TOKENS = 128


@dataclass
class Output:
    """One sample of a prompt."""

    index: int                  # which of the prompt's n samples
    text: str | None            # None when the engine dir has no tokenizer
    token_ids: list[int]        # generated tokens, a stopping EOS or stop-string token included
    finish_reason: str          # "eos" | "stop" | "max_tokens" | "max_seq_len"
    stats: Stats                # timings, tau, drafts accepted
    seed: int | None            # the sampling seed (None: greedy); with ``index`` it reproduces the sample


@dataclass
class Completion:
    """What one prompt gave: its ``SamplingParams.n`` samples."""

    prompt_ids: list[int]
    outputs: list[Output]

    @property
    def text(self) -> str | None:
        """The first sample's text."""
        return self.outputs[0].text


class LLM:
    """An engine dir opened on one device: its engines, tokenizer, drafter and generation loop."""

    def __init__(self, engine_dir: str | Path, *, backend: str = "auto", device: str | None = None,
                 drafter: str | DrafterSpec = "auto", gamma: int | None = None, tree: TreeShape | None = None,
                 cuda_graphs: bool = True, verify: bool = False, kernels: KernelConfig | None = None,
                 kv_cache_dtype: str = "auto"):
        """backend: auto | trt | fast | ort | torch; device: cpu | cuda (None: cuda when there is one); drafter:
        auto | eagle3 | mtp | draft-model | none, with a chain of ``gamma`` drafts (default 4) or, for eagle3 and
        mtp, a ``tree`` (or a whole DrafterSpec); cuda_graphs: replay each round from a CUDA graph; verify: hash
        every byte of the dir's files first (default: sampled blocks); kernels: the fast backend's kernel choices;
        kv_cache_dtype: auto (the engines' dtype) or fp8 (the target's cache in e4m3, unscaled: the fast and torch
        backends). EngineError (one line naming the file or option) when the dir cannot serve this."""

        from xcompile.runtime.decoding.batch import BatchGenerator
        from xcompile.runtime.decoding.batch_drafts import BatchDrafts, batch_chain
        from xcompile.runtime.decoding.generator import Generator, LoopOptions
        from xcompile.runtime.decoding.registry import make_drafter
        from xcompile.runtime.enginedir.text import Text
        from xcompile.runtime.engines.graphs import CudaGraphCapture
        from xcompile.runtime.engines.load import open_engine_dir

        if isinstance(drafter, DrafterSpec):
            if gamma is not None or tree is not None:
                raise EngineError("give gamma and tree inside the DrafterSpec, not beside it")
            spec = drafter
        else:
            tree_options = (tree.topk, tree.depth, tree.total_tokens) if tree is not None else (None, None, None)
            spec = DrafterSpec.from_options(drafter, gamma, *tree_options)
        check_kv_cache_dtype(kv_cache_dtype)          # before the weights load
        device = str(resolve_device(device))
        self.engines = open_engine_dir(engine_dir, backend, device, cuda_graphs=cuda_graphs, verify=verify,
                                       kernels=kernels)
        try:
            set_kv_cache_dtype(self.engines, kv_cache_dtype)
            m, directory = self.engines.manifest, self.engines.directory
            self.tokenizer = Text(directory) if (directory / "tokenizer.json").is_file() else None
            detokenize = self.tokenizer.decode if self.tokenizer else None
            self.generator: Generator | None = None
            self.batch: BatchGenerator | None = None
            if m.max_batch > 1:
                # the continuous-batching loop: greedy rows verify chains of drafts in its steps (batch_drafts.py),
                # and a lone greedy sequence speculates on the batch-1 Generator in slot 0 (solo.py)
                engines = self.engines.engines
                target, lone = engines["target"], all(e.partial_batch for e in engines.values())
                if spec.name not in ("auto", "none") and not lone:
                    raise OptionError(f"--drafter {spec.name}: {directory} was exported with --max-batch "
                                      f"{m.max_batch}, and the {self.engines.backend} backend's graphs fix the "
                                      "batch, so it cannot speculate; use --drafter none, --backend "
                                      "fast or torch, or an engine dir exported with --max-batch 1")
                if spec.name == "auto" and not lone and (spec.gamma_given or spec.tree is not None):
                    raise OptionError(f"--gamma / --tree-*: {directory} was exported with --max-batch {m.max_batch}"
                                      f", and the {self.engines.backend} backend's graphs fix the batch, so it "
                                      "cannot speculate; drop them, or use --backend fast or torch")
                self.spec = spec.resolve(self.engines) if lone and spec.name != "none" else DrafterSpec("none")
                if spec.name == "auto" and not lone and any(k.holds(self.engines) for k in DRAFTERS.values()
                                                            if k.graphs):
                    logger(__name__).warning(
                        "--drafter auto: none, %s's %s graphs fix the batch at %d sequences, so it cannot "
                        "speculate; use --backend fast or torch, or an engine dir exported with --max-batch 1",
                        directory, self.engines.backend, m.max_batch)
                self.drafter = make_drafter(self.engines, self.spec) if self.spec.name != "none" else None
                self.batch_spec = batch_chain(self.spec, m.max_batch)
                # bound before the lone sequence's drafter, which would narrow the engines' KV to one slot
                drafts = BatchDrafts(make_drafter(self.engines, self.batch_spec), m.max_batch, m.max_seq_len,
                                     self.device) if self.batch_spec.name != "none" else None
                graphed = cuda_graphs and self.device.type == "cuda"
                solo = Generator(target, self.drafter, m.eos_token_ids, m.max_seq_len, detokenize=detokenize,
                                 options=LoopOptions(cuda_graphs=graphed)) if self.drafter is not None else None
                self.batch = BatchGenerator(target, m.eos_token_ids, m.max_seq_len, detokenize=detokenize,
                                            capture=CudaGraphCapture() if graphed and target.graph_capturable
                                            else None, solo=solo, drafts=drafts)
            else:
                self.batch_spec = None
                self.spec = spec.resolve(self.engines)          # auto replaced by what the dir holds
                self.drafter = make_drafter(self.engines, self.spec)
                self.generator = Generator(self.engines.engines["target"], self.drafter, m.eos_token_ids,
                                           m.max_seq_len, detokenize=detokenize,
                                           options=LoopOptions(cuda_graphs=cuda_graphs and self.device.type == "cuda"))
            self.loop = self.generator or self.batch        # what checks requests: both say the same
        except BaseException:
            self.engines.close()
            raise

    @property
    def device(self):
        return self.engines.device

    @property
    def backend(self) -> str:
        return self.engines.backend

    def warm_up(self, on_part: Callable[[Warmed], None] | None = None) -> list[Warmed]:
        """Run once every kernel, step shape and round recording a request can reach (prompt passes of every
        length class, the rounds under greedy, sampling, top-p and the dir's generation_config), so that no
        request waits on a compile or a capture; the output of every request after it is what it would be
        without (decoding/warmup.py). Seconds on a GPU, little on the CPU. ``on_part`` hears of each part as
        it finishes; returns them all."""
        has_config = (self.engines.directory / GENERATION_CONFIG).is_file()
        samplings = sampler_modes(generation_defaults(self.engines.directory) if has_config else None)
        return self.loop.warm_up(samplings, on_part)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (the dir's tokenizer), or the ids given, checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineError(f"{self.engines.directory}: no tokenizer.json; give the prompt as token ids")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.engines.manifest.models["target"].config["vocab_size"]
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise EngineError(f"prompt token ids must lie in [0, {vocab}) for this model")
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams = GREEDY, *,
                 max_new_tokens: int | None = None, stop: Sequence[str] = ()) -> list[Completion]:
        """One Completion per prompt (a text, token ids, or a list of either), each with ``sampling.n``
        samples; every prompt is checked before any is generated. max_new_tokens: None is DEFAULT_NEW_TOKENS or
        the room the context leaves, if less; one that does not fit after a prompt is refused."""
        many = isinstance(prompts, (list, tuple)) and prompts and not isinstance(prompts[0], int)
        ids = [self.encode(p) for p in (prompts if many else [prompts])]
        budgets = [self._budget(p, max_new_tokens, stop, sampling) for p in ids]
        if self.batch is not None:
            return self._complete_batched(ids, sampling, budgets, stop)
        return [self._complete(p, sampling, n, stop) for p, n in zip(ids, budgets)]

    def chat(self, messages: str | list[dict], sampling: SamplingParams = GREEDY, *,
             max_new_tokens: int | None = None, stop: Sequence[str] = ()) -> Completion:
        """The assistant's reply to one user message, or to OpenAI-style messages ``[{"role": ..., "content":
        ...}]``, under the tokenizer's chat template."""
        if self.tokenizer is None:
            raise EngineError(f"{self.engines.directory}: no tokenizer.json, so no chat template")
        ids = self.tokenizer.chat(messages)
        budget = self._budget(ids, max_new_tokens, stop, sampling)
        if self.batch is not None:
            return self._complete_batched([ids], sampling, [budget], stop)[0]
        return self._complete(ids, sampling, budget, stop)

    def stream(self, prompt: Prompt, sampling: SamplingParams = GREEDY, *, max_new_tokens: int | None = None,
               stop: Sequence[str] = ()) -> Iterator[str]:
        """The text of one sample, piece by piece as rounds commit it (needs the dir's tokenizer)."""
        if self.tokenizer is None:
            raise EngineError(f"{self.engines.directory}: no tokenizer.json, so no text to stream; use generate")
        if sampling.n != 1:
            raise EngineError(f"stream gives one sample; got SamplingParams(n={sampling.n}): use generate")
        ids = self.encode(prompt)
        budget = self._budget(ids, max_new_tokens, stop, sampling)
        if self.batch is not None:
            return self._pieces(self._batch_stream(ids, budget, stop, sampling))
        return self._pieces(self.generator.stream(ids, budget, stop, sampling))

    def _budget(self, ids: list[int], max_new_tokens: int | None, stop: Sequence[str],
                sampling: SamplingParams) -> int:
        """The request checked (Generator.check_request) and its token budget: ``max_new_tokens`` if it fits the
        context after the prompt, else EngineError; None: DEFAULT_NEW_TOKENS or the room left, if less."""
        room = self.loop.max_seq_len - len(ids)
        budget = max(1, min(DEFAULT_NEW_TOKENS, room)) if max_new_tokens is None else max_new_tokens
        self.loop.check_request(ids, budget, stop, sampling)
        if budget > room:
            raise EngineError(f"max_new_tokens {budget}: the prompt's {len(ids)} tokens and that many new ones "
                              f"exceed the engine dir's max_seq_len {self.loop.max_seq_len}; at most "
                              f"{max(room, 0)} fit")
        return budget

    def _pieces(self, run) -> Iterator[str]:
        # decode the whole output each time: byte-level BPE pieces only form text together
        tokens, text = [], ""
        for new in run:
            tokens += new
            now = self.tokenizer.decode(tokens)
            if len(now) > len(text):
                yield now[len(text):]
                text = now

    def _complete(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int,
                  stop: Sequence[str]) -> Completion:
        results = self.generator.generate_n(prompt_ids, max_new_tokens, stop, sampling=sampling)
        decode = self.tokenizer.decode if self.tokenizer else None
        return Completion(prompt_ids, [Output(r.index, decode(r.tokens) if decode else None, r.tokens, r.finish_reason,
                                              r.stats, r.seed) for r in results])

    def _complete_batched(self, prompts: list[list[int]], sampling: SamplingParams, budgets: list[int],
                          stop: Sequence[str]) -> list[Completion]:
        """Every sample of every prompt submitted to the batch at once, then steps until all have stopped;
        sample j of a prompt draws stream j of the request's seed, as ``Generator.generate_n``."""
        one = replace(with_seed(sampling), n=1)
        try:
            seqs = [[self.batch.submit(p, n, stop, one, j) for j in range(sampling.n)]
                    for p, n in zip(prompts, budgets)]
            while not self.batch.idle:
                self.batch.step()
        except BaseException as e:          # a failed step or submit: no sequence of this call stays seated
            self.batch.abort(f"{type(e).__name__}: {e}")
            raise
        decode = self.tokenizer.decode if self.tokenizer else None
        return [Completion(p, [Output(q.index, decode(q.result.tokens) if decode else None, q.result.tokens,
                                      q.result.finish_reason, q.result.stats, q.result.seed) for q in qs])
                for p, qs in zip(prompts, seqs)]

    def _batch_stream(self, ids: list[int], budget: int, stop: Sequence[str],
                      sampling: SamplingParams) -> Iterator[list[int]]:
        new: list[list[int]] = []
        cancel = threading.Event()
        seq = self.batch.submit(ids, budget, stop, sampling, cancel=cancel, on_tokens=new.append)
        try:
            while seq.result is None:
                self.batch.step()
                yield from new
                new.clear()
            yield from new                  # tokens of the step it ended in
        except BaseException as e:
            if not isinstance(e, GeneratorExit):     # a failed step: every row's state is suspect
                self.batch.abort(f"{type(e).__name__}: {e}")
            raise
        finally:
            cancel.set()                    # a stream left early frees its slot at the next step

    def close(self) -> None:
        self.engines.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
