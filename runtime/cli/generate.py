"""``xrun generate`` as a function: engine dir + request in, streamed text and stats out."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from xcompile.runtime.api import LLM
from xcompile.runtime.common import logs
from xcompile.runtime.common.errors import EngineError, OptionError
from xcompile.runtime.decoding.outcome import Result
from xcompile.runtime.decoding.registry import DrafterSpec, check_spec
from xcompile.runtime.decoding.sampling import SamplingParams, sampling_params
from xcompile.runtime.enginedir.manifest import Manifest
from xcompile.runtime.enginedir.text import Text
from xcompile.runtime.engines.load import EngineSet, pick_backend
from xcompile.runtime.engines.run_checks import check_backend_options, check_cuda_graphs, resolve_device

log = logs.logger("generate")
DEFAULT_NEW_TOKENS = 128


@dataclass
class GenerateRequest:
    """What ``xrun generate`` asks for: one of prompt / prompt_ids / chat, and how to run it."""

    engine_dir: str
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    chat: str | None = None
    max_new_tokens: int | None = None  # None: DEFAULT_NEW_TOKENS, or what the context leaves if fewer
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    stop: list[str] = field(default_factory=list)
    backend: str = "auto"
    device: str | None = None
    cuda_graphs: bool = True
    verify: bool = False                # hash every byte of the dir's files (default: sampled blocks)
    kv_cache_dtype: str = "auto"        # or "fp8": the target's KV cache in e4m3
    row_invariant: bool = False         # the fast target's KernelConfig.row_invariant
    # sampling: None = not given; ``sample`` starts from the dir's generation_config.json
    sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    num_samples: int | None = None

    @property
    def prompt_option(self) -> str:
        """The option the prompt came from, for the errors about it."""
        return "--prompt-ids" if self.prompt_ids is not None else "--chat" if self.chat is not None else "--prompt"

    def sampling(self) -> SamplingParams:
        """The request's SamplingParams (EngineError on a bad value; reads only generation_config.json)."""
        return sampling_params(self.engine_dir, self.sample, temperature=self.temperature, top_k=self.top_k,
                               top_p=self.top_p, min_p=self.min_p, seed=self.seed, n=self.num_samples)


def stats_dict(result: Result) -> dict:
    """A generation's stats as the JSON ``xrun generate --json`` prints (rounded)."""
    s = result.stats
    return {
        "acceptance_length": round(s.acceptance_length, 4),
        "drafted": s.drafted,
        "accepted": s.accepted,
        "target_forwards": s.target_forwards,
        "rounds": s.rounds,
        "tokens_per_s": round(s.tokens_per_s, 2),
        "decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
        "prefill_s": round(s.prefill_s, 6),
        "decode_s": round(s.decode_s, 6),
        "prompt_tokens": s.prompt_tokens,
        "new_tokens": s.new_tokens,
        "acceptance_by_position": [round(x, 4) for x in s.acceptance_by_position],
        "finish_reason": result.finish_reason,
        "seed": result.seed,
        "sample": result.index,
    }


def prompt_ids(req: GenerateRequest, es: EngineSet, text: Text | None) -> list[int]:
    if req.prompt_ids is not None:
        vocab = es.manifest.models["target"].config["vocab_size"]
        if req.prompt_ids and (min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab):
            raise OptionError(f"--prompt-ids: ids must lie in [0, {vocab}) for this model")
        return list(req.prompt_ids)
    return text.chat(req.chat) if req.chat is not None else text.encode(req.prompt)


def check_drafter_options(req: GenerateRequest, manifest: Manifest) -> None:
    """registry.check_spec for the request's drafter, before any engine is loaded."""
    check_spec(req.drafter, req.engine_dir, manifest)


def check_tokenizer(req: GenerateRequest, manifest: Manifest) -> None:
    """A text prompt, a chat message or stop strings need the dir's tokenizer: say so before anything loads (and
    that a tokenizer the manifest lists is gone: the dir is damaged, whatever the prompt)."""
    gone = [f for f in manifest.tokenizer_files if not (Path(req.engine_dir) / f).is_file()]
    if gone:
        raise EngineError(f"{Path(req.engine_dir) / gone[0]}: missing, though the dir's manifest lists it; re-export "
                          "the engine dir (--force)")
    if (req.prompt_ids is None or req.stop) and not (Path(req.engine_dir) / "tokenizer.json").is_file():
        need = "--stop" if req.prompt_ids is not None else req.prompt_option
        raise EngineError(f"{need} needs the engine dir's tokenizer, and {req.engine_dir} has no tokenizer.json "
                          "(a --synthetic export has none); give --prompt-ids and no --stop, or export with a tokenizer")


def new_tokens(req: GenerateRequest, prompt: int, max_seq_len: int) -> int:
    """--max-new-tokens if it fits the context after the prompt (else an error saying what fits); without it,
    DEFAULT_NEW_TOKENS or the room left, whichever is less."""
    room = max_seq_len - prompt
    if req.max_new_tokens is None:
        return max(1, min(DEFAULT_NEW_TOKENS, room))
    if req.max_new_tokens > room:
        raise OptionError(f"--max-new-tokens {req.max_new_tokens}: the prompt's {prompt} tokens and that many new "
                          f"ones exceed the engine dir's max_seq_len {max_seq_len}; at most {max(room, 0)} fit "
                          "(or rebuild with a larger --max-seq-len)")
    return req.max_new_tokens


def run_generate(req: GenerateRequest, as_json: bool = False, echo: Callable[..., None] = print) -> list[Result]:
    """Open the dir, encode the prompt, generate its n samples one after another (streaming text
    unless ``as_json``), print stats."""
    sampling = req.sampling()                       # bad values fail here, before anything is loaded
    check_cuda_graphs(req.cuda_graphs, req.device)
    manifest = Manifest.load(req.engine_dir)
    check_drafter_options(req, manifest)
    check_tokenizer(req, manifest)
    device = resolve_device(req.device)
    check_backend_options(pick_backend(manifest, req.backend, device), device, req.kv_cache_dtype)
    opened = time.perf_counter()
    from xcompile.runtime.engines.kernels.config import KernelConfig
    kernels = KernelConfig(row_invariant=True) if req.row_invariant else None
    with LLM(req.engine_dir, backend=req.backend, device=req.device, drafter=req.drafter,
             cuda_graphs=req.cuda_graphs, verify=req.verify, kv_cache_dtype=req.kv_cache_dtype,
             kernels=kernels) as llm:
        load_s = time.perf_counter() - opened       # checks, weights to the device, engines built
        es, gen, drafter = llm.engines, llm.loop, llm.drafter      # loop: a --max-batch N dir's batch loop
        log.debug(f"opened {req.engine_dir}: {', '.join(es.engines)} on {es.backend}/{es.device}")
        text = llm.tokenizer if req.prompt_ids is None or req.stop else None
        ids = prompt_ids(req, es, text)
        try:
            gen.check_prompt(ids)                   # the drafter's round must fit after it too
        except EngineError as e:
            raise OptionError(f"{req.prompt_option}: {e}") from None
        max_new = new_tokens(req, len(ids), es.manifest.max_seq_len)
        # on a GPU the first prompt pass and rounds compile kernels and record graphs: done here, so the
        # prefill and decode times below are the request's own
        warmed = time.perf_counter()
        if llm.generator is not None and es.device.type == "cuda":
            llm.generator.warm_up([sampling], prompt=len(ids))
        warm_up_s = time.perf_counter() - warmed
        stream = None
        if not as_json and text is not None:
            done: dict[int, list[int]] = {}

            def stream(index: int, tokens: list[int]) -> None:
                # decode the whole output each time: byte-level BPE pieces only form text together
                seen = done.setdefault(index, [])
                if not seen and sampling.n > 1:
                    # the previous sample's text ends its line, so each header starts one
                    echo(("\n" if index else "") + f"--- sample {index} ---")
                before = text.decode(seen)
                seen.extend(tokens)
                echo(text.decode(seen)[len(before):], nl=False)

        results = gen.generate_n(ids, max_new, stop=req.stop, on_tokens=stream, sampling=sampling)
    outs = []
    for result in results:
        stats = stats_dict(result)
        stats.update(backend=es.backend, device=str(es.device), drafter=drafter.name if drafter else "none",
                     sampling=sampling_dict(sampling), load_s=round(load_s, 6), warm_up_s=round(warm_up_s, 6))
        outs.append({"tokens": result.tokens, "text": text.decode(result.tokens) if text else None, "stats": stats})
    if as_json:
        echo(json.dumps(outs[0] if sampling.n == 1 else {"samples": outs}))
        return results
    if text is not None:
        echo("")                                    # the last sample's streamed text ends its line
    for result, out in zip(results, outs):
        stats = out["stats"]
        if text is None:
            if sampling.n > 1:
                echo(f"--- sample {result.index} ---")
            echo(" ".join(map(str, result.tokens)))
        seed = "" if result.seed is None else f", seed {result.seed} sample {result.index}"
        log.info(f"[{stats['drafter']} on {stats['backend']}/{stats['device']}] {stats['new_tokens']} tokens, "
                 f"{stats['tokens_per_s']:.1f} tok/s, tau {stats['acceptance_length']:.2f} tokens per verify round "
                 f"({stats['accepted']}/{stats['drafted']} drafts accepted, {stats['target_forwards']} target "
                 f"forwards), finish: {stats['finish_reason']}{seed}")
        # where the wall time went: opening the dir, the compiles and graph captures (a GPU), the prompt pass,
        # the rounds
        log.info(f"load {stats['load_s']:.2f} s, warm-up {stats['warm_up_s']:.2f} s, prefill "
                 f"{1e3 * stats['prefill_s']:.1f} ms, decode "
                 f"{stats['decode_s']:.3f} s ({stats['decode_tokens_per_s']:.1f} tok/s after the first token)")
    return results


def sampling_dict(p: SamplingParams) -> dict:
    """What the stats report of the sampling (greedy: just that)."""
    if p.greedy:
        return {"temperature": 0.0}
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p}
