"""The OpenAI API as this server speaks it: pydantic request models, OpenAI-style errors, response bodies.

Follows the OpenAI API as vLLM implements it (``/v1/completions``, ``/v1/chat/completions``), with two
extensions vLLM also has: ``top_k``/``min_p`` and ``return_token_ids`` (each choice then carries its
``token_ids``); and one of ours: ``usage.xcompile`` with the speculative counts (tau, drafted, accepted).

Which request fields are accepted (``_Request.check_fields``), never silently ignored:
  - the fields the models below declare, which are implemented;
  - fields of the OpenAI API or of vLLM's extensions that this server does not implement (``NEUTRAL``:
    penalties, logprobs, guided decoding, tools, ...), only at a value that leaves the output as it is
    (``repetition_penalty`` 1, ``logprobs`` false or null, ...), as clients often send defaults; any other
    value is a 400 naming the field;
  - ``IGNORED``: fields about who sent the request and how it is tracked or billed (``user``,
    ``metadata``, ...), which never change what is generated;
  - anything else is a 400 naming the field (vLLM ignores unknown fields; a typo or an extension we do
    not know would then change nothing without a word).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from xcompile.runtime.common.errors import EngineError, XcompileError
from xcompile.runtime.decoding.sampling import SamplingParams, with_seed

MAX_N = 16          # choices per request: they run one after another on the one device slot


class ServeError(XcompileError):
    """A request the server refuses or could not finish: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


# HTTP status -> OpenAI error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable_error", 504: "timeout_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code or str(status)}}


# Fields of the OpenAI API and of vLLM's extensions this server does not implement -> the values that
# leave the output as it is (a request may send those). JSON types are told apart (``_neutral``): logprobs
# 0 asks a completion for the sampled token's logprob, so only false / null are neutral.
NEUTRAL: dict[str, tuple] = {
    # OpenAI
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
    "logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "store": (None, False),
    # vLLM's sampling and guided-decoding extensions
    "repetition_penalty": (None, 1), "length_penalty": (None, 1), "use_beam_search": (None, False),
    "ignore_eos": (None, False), "min_tokens": (None, 0), "stop_token_ids": (None, []),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True), "bad_words": (None, []),
    "allowed_token_ids": (None,), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "priority": (None, 0),
    # vLLM's chat template extensions (the template is the tokenizer's, with the generation prompt)
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
}
# accepted and ignored: who sent a request and how it is tracked or billed, never what is generated
IGNORED = frozenset({"user", "metadata", "safety_identifier", "service_tier", "prompt_cache_key"})


def _neutral(value, neutral: tuple) -> bool:
    """Whether ``value`` equals one of ``neutral`` as JSON values (false is not 0; 1 is 1.0)."""
    def kind(x):
        return "bool" if isinstance(x, bool) else "number" if isinstance(x, (int, float)) else type(x)
    return any(kind(value) == kind(n) and value == n for n in neutral)


# strict: a value of another JSON type is refused, not coerced ("max_tokens": "4", "stream": "yes", a prompt of
# true / false taken as ids 1 / 0); nested objects refuse unknown keys as the request's own fields are refused
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by completions and chat completions; fields not declared are kept for
    ``check_fields`` (module docstring)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)     # STRICT, extras checked below

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: list[str] = Field(default_factory=list)        # a string or a list of them
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)     # None: 0, greedy (OpenAI's default is 1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)                  # -1 or 0: off (vLLM's convention)
    min_p: float | None = Field(None, ge=0, le=1)
    return_token_ids: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else [] if v is None else v
        if isinstance(stops, list) and any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def check_fields(self) -> None:
        """ServeError 400 naming the first field this server does not implement, unless neutral, or does
        not know (module docstring)."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED or (name in NEUTRAL and _neutral(value, NEUTRAL[name])):
                continue
            if name in NEUTRAL:
                neutral = " or ".join(json.dumps(n) for n in NEUTRAL[name] if n is not None)
                raise ServeError(400, f"{name}: not implemented by this server; leave it out"
                                      + (f" (or send {neutral}, which changes nothing)" if neutral else ""), name)
            raise ServeError(400, f"{name}: unknown field (this server refuses fields it does not implement rather "
                                  "than ignore them); leave it out", name)
        if not self.temperature:                    # greedy: a sampling filter would be ignored, so refused
            inert = {"top_k": self.top_k not in (None, -1, 0), "top_p": self.top_p not in (None, 1),
                     "min_p": self.min_p not in (None, 0)}
            for name in (name for name, given in inert.items() if given):
                raise ServeError(400, f"{name}: greedy decoding (temperature unset or 0): it changes nothing; leave "
                                      "it out or send a temperature above 0", name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self) -> SamplingParams:
        """The request's SamplingParams, with a seed drawn here when sampling without one, so that every
        choice of the request shares it (choice j is stream j of the seed) and the reply can report it."""
        try:
            return with_seed(SamplingParams(temperature=self.temperature or 0.0, top_k=max(self.top_k or 0, 0),
                                            top_p=1.0 if self.top_p is None else self.top_p,
                                            min_p=self.min_p or 0.0, seed=self.seed))
        except EngineError as e:                    # "<field> must be ...": the field is the param
            field = str(e).split(" ", 1)[0]
            raise ServeError(400, str(e), field if field in type(self).model_fields else None) from None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)        # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if not _split(v) or any(len(p) == 0 for p in _split(v)):
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One prompt per entry: text or token ids."""
        return _split(self.prompt)


def _split(prompt) -> list:
    """A prompt field as a list of prompts: a text or an id list is one, a list of them is many."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)


class ContentPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)     # the newer name of max_tokens

    def check_fields(self) -> None:
        super().check_fields()
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ServeError(400, f"max_tokens: {self.max_tokens} conflicts with max_completion_tokens "
                                  f"{self.max_completion_tokens} (the same limit's two names); send one", "max_tokens")


FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_tokens": "length", "max_seq_len": "length"}


def usage(prompt_tokens: int, stats: list, seed: int | None = None) -> dict:
    """OpenAI usage over all choices, plus ``xcompile``: tau (tokens per target forward, bonus included),
    drafted and accepted draft tokens, verify rounds, and the sampling seed (None: greedy)."""
    completion = sum(s.new_tokens for s in stats)
    rounds, drafted, accepted = (sum(getattr(s, k) for s in stats) for k in ("rounds", "drafted", "accepted"))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "xcompile": {"acceptance_length": round((accepted + rounds) / rounds, 4) if rounds else 0.0,
                         "drafted": drafted, "accepted": accepted, "rounds": rounds, "seed": seed}}


class TextStream:
    """One choice's text as it streams. Only text that can no longer change is released: not a trailing
    incomplete UTF-8 sequence, nor a tail that may still grow into a stop string; and the text ends
    before the first stop string, as OpenAI's does (the token ids keep the token that stopped it)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode, self.stop = decode, stop
        self.hold = max((len(s) for s in stop), default=1) - 1      # chars a stop string could still need
        self.tokens: list[int] = []
        self.sent = 0
        self.text = ""

    def push(self, tokens: list[int]) -> str:
        """Append a round's tokens; returns the newly released text."""
        self.tokens += tokens
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):                 # bytes of one character split over tokens: wait
            return ""
        return self._release(self._cut(text), len(text) - self.hold)

    def finish(self) -> str:
        """After the last token: the rest of the text."""
        text = self._cut(self.decode(self.tokens))
        return self._release(text, len(text))

    def _cut(self, text: str) -> str:
        ends = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return text[:min(ends)] if ends else text

    def _release(self, text: str, upto: int) -> str:
        upto = min(upto, len(text))
        out = text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        self.text += out
        return out
