"""What ``xrun serve`` runs and the engine side of it: ``ServeConfig`` (the engine dir, drafter and the server's
limits) and ``EngineWorker`` (the process's engines, tokenizer and Generator or batch loop, opened once and used on
the Scheduler's engine thread, runtime/serve/scheduler.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.registry import DrafterSpec
from xcompile.runtime.serve.jobs import Job
from xcompile.runtime.serve.protocol import ServeError

log = logging.getLogger("xcompile.serve")


@dataclass(frozen=True)
class ServeConfig:
    """What ``xrun serve`` runs: the engine dir and drafter, and the server's limits."""

    engine_dir: str
    backend: str = "auto"
    device: str | None = None                   # default: cuda if available
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    served_model_name: str | None = None        # default: the manifest's model name
    api_key: str | None = None                  # required as "Authorization: Bearer KEY" on /v1 when set
    max_queue: int = 64                         # requests waiting for the device (a batch slot on batch dirs)
    request_timeout: float | None = None        # seconds from arrival to the last token; None: no limit
    cuda_graphs: bool = True
    warm_up: bool = True                        # run every kernel and graph once before reporting ready
    kv_cache_dtype: str = "auto"                # or fp8: the target's KV cache in e4m3 (fast and torch backends)
    row_invariant: bool = False                 # the fast target's KernelConfig.row_invariant

    def kernels(self):
        """The fast backend's KernelConfig asked for (None: the defaults)."""
        from xcompile.runtime.engines.kernels.config import KernelConfig
        return KernelConfig(row_invariant=True) if self.row_invariant else None


class EngineWorker:
    """The engine set, tokenizer and Generator of the process. ``run`` is called on the worker thread
    only; ``encode`` and ``check_prompt`` only read and may run on the event loop."""

    def __init__(self, config: ServeConfig):
        from xcompile.runtime.api import LLM

        self.llm = LLM(config.engine_dir, backend=config.backend, device=config.device, drafter=config.drafter,
                       cuda_graphs=config.cuda_graphs, kv_cache_dtype=config.kv_cache_dtype, kernels=config.kernels())
        llm = self.llm
        self.es, self.text, self.spec, self.drafter, self.gen = llm.engines, llm.tokenizer, llm.spec, llm.drafter, llm.generator
        self.batch = llm.batch                      # the continuous-batching loop (None: batch 1, self.gen)
        self.target = self.es.engines["target"]
        m = self.es.manifest
        self.model_name = config.served_model_name or m.name
        self.max_seq_len = m.max_seq_len
        # characters a text prompt may hold before it is tokenized (encode): a scan of the vocabulary, done here
        # rather than inside the first text request
        self.max_chars = m.max_seq_len * self.text.longest_token if self.text is not None else None
        self.vocab_size = m.models["target"].config["vocab_size"]

    def encode(self, prompt: str | list[int] | list[dict], param: str) -> list[int]:
        """Token ids of a text, token-id or chat-messages prompt, checked against the engine's limits."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            ids = list(prompt)
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                raise ServeError(400, f"token ids must lie in [0, {self.vocab_size}) for this model", param)
        elif self.text is None:
            raise ServeError(400, "the engine dir has no tokenizer: send the prompt as token ids", param)
        else:
            # a text too long for the context whatever its tokens, refused before tokenizing it (on the event loop:
            # 8 million characters took 6 s, every other request waiting)
            chars = len(prompt) if isinstance(prompt, str) else sum(len(m.get("content") or "") for m in prompt)
            if chars > self.max_chars:
                raise ServeError(400, f"a prompt of {chars} characters holds more than the {self.max_seq_len} tokens "
                                      f"of this model's context (a token covers at most {self.text.longest_token}); "
                                      "shorten it", param, "context_length_exceeded")
            try:
                ids = self.text.chat(prompt) if isinstance(prompt, list) else self.text.encode(prompt)
            except EngineError as e:
                raise ServeError(400, str(e), param) from None
        try:
            self.llm.loop.check_prompt(ids)
        except EngineError as e:
            raise ServeError(400, str(e), param, "context_length_exceeded") from None
        return ids

    def warm_up(self) -> list:
        """LLM.warm_up on the worker thread, logging one line per part as it finishes; returns the parts."""
        return self.llm.warm_up(lambda part: log.info("warmed %s in %.2f s", part.what, part.seconds))

    def decode(self, ids: list[int]) -> str:
        return self.text.decode(ids) if self.text else ""

    def run(self, job: Job, post: Callable[[tuple], None]) -> None:
        """Every generation of ``job`` in order (worker thread): posts ``("tokens", i, ids)`` per round
        and ``("done", i, Result)`` per generation, until the job is cancelled."""
        for i, g in enumerate(job.generations):
            if job.cancel.is_set():
                return
            result = self.gen.generate(g.prompt, g.max_new_tokens, stop=g.stop, sampling=g.sampling, index=g.index,
                                       cancel=job.cancel, on_tokens=lambda tokens, i=i, post=post: post(("tokens", i, tokens)))
            if result.finish_reason != "cancelled":
                post(("done", i, result))

    def close(self) -> None:
        self.es.close()
