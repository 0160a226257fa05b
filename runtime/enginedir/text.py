"""Tokenizer of an engine dir: encode, decode and the chat template, without transformers.

``tokenizer.json`` is read with the ``tokenizers`` library; the chat template (tokenizer_config.json's
``chat_template`` or ``chat_template.jinja``) is rendered with jinja2 as HF does.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from xcompile.runtime.common.errors import EngineError


def _tokenizer(directory: Path):
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise EngineError(f"{path}: missing; the engine dir has no tokenizer, so pass --prompt-ids instead "
                          "of text, or re-export from a checkpoint that ships tokenizer.json")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:      # tokenizers raises a bare Exception subclass from Rust
        raise EngineError(f"{path}: unreadable tokenizer ({e})") from None


def vocabulary(directory: Path) -> dict[str, int]:
    """token -> id of a dir's tokenizer.json, added tokens included: two models share a vocabulary
    when these are equal (sizes alone say nothing about which token an id means)."""
    return _tokenizer(directory).get_vocab(with_added_tokens=True)


class Text:
    """The tokenizer files of an engine dir (or checkpoint dir): encode, decode, chat template."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        self.tokenizer = _tokenizer(directory)
        self.directory = directory
        self.config = {}
        config = directory / "tokenizer_config.json"
        if config.is_file():
            try:
                self.config = json.loads(config.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise EngineError(f"{config}: not valid JSON ({e})") from None
            if not isinstance(self.config, dict):
                raise EngineError(f"{config}: expected a JSON object, got {type(self.config).__name__}")

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters one token covers (its vocabulary entry's UTF-8 bytes, added tokens included; a
        byte-level BPE entry holds a character per byte): a text of more than n times as many characters holds
        more than n tokens, known before it is tokenized."""
        return max((len(t.encode("utf-8", "surrogatepass")) for t in self.tokenizer.get_vocab(with_added_tokens=True)),
                   default=1)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(utf8(text), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat(self, message: str | list[dict]) -> list[int]:
        """Token ids of a conversation under the chat template, with the assistant turn opened: one user
        message, or OpenAI-style messages ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``."""
        messages = [{"role": "user", "content": message}] if isinstance(message, str) else message
        template = self.config.get("chat_template")
        jinja = self.directory / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        if not isinstance(template, str):
            raise EngineError(f"{self.directory / 'tokenizer_config.json'}: no chat_template; use --prompt instead "
                              "of --chat")
        import jinja2

        def raise_exception(message: str):     # what HF templates call to refuse a conversation
            raise jinja2.TemplateError(message)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        messages = [{**m, "content": utf8(m["content"])} if isinstance(m.get("content"), str) else m for m in messages]
        try:
            text = env.from_string(template).render(
                messages=messages, add_generation_prompt=True,
                bos_token=self.config.get("bos_token") or "", eos_token=self.config.get("eos_token") or "")
        except jinja2.TemplateError as e:       # syntax errors, undefined names, raise_exception() in templates
            where = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
            raise EngineError(f"{self.directory}: the chat template{where} cannot be rendered "
                              f"({type(e).__name__}: {e}); fix it in tokenizer_config.json / chat_template.jinja, "
                              "or use --prompt") from None
        return self.encode(text)


def utf8(text: str) -> str:
    """``text`` if it is valid Unicode; command-line bytes that are not UTF-8 reach Python as lone
    surrogates (PEP 383), which the tokenizer cannot take: one line naming the offending byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else repr(bad)
        raise EngineError(f"the prompt is not valid UTF-8 (byte {byte} at character {e.start}); pass UTF-8 text") \
            from None
    return text
