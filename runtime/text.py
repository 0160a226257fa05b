"""Tokenizer of an engine dir: encode, decode and the chat template, without transformers.

``tokenizer.json`` is read with the ``tokenizers`` library; the chat template (tokenizer_config.json's
``chat_template`` or ``chat_template.jinja``) is rendered with jinja2 as HF does.
"""

from __future__ import annotations

import json
from pathlib import Path

from xcompile.runtime.errors import EngineError


class Text:
    """The tokenizer files of an engine dir (or checkpoint dir): encode, decode, chat template."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise EngineError(f"{path}: missing; the engine dir has no tokenizer, so pass --prompt-ids instead "
                              "of text, or re-export from a checkpoint that ships tokenizer.json")
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:      # tokenizers raises a bare Exception subclass from Rust
            raise EngineError(f"{path}: unreadable tokenizer ({e})") from None
        self.directory = directory
        self.config = {}
        config = directory / "tokenizer_config.json"
        if config.is_file():
            try:
                self.config = json.loads(config.read_text())
            except json.JSONDecodeError as e:
                raise EngineError(f"{config}: not valid JSON ({e})") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

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
        try:
            text = env.from_string(template).render(
                messages=messages, add_generation_prompt=True,
                bos_token=self.config.get("bos_token") or "", eos_token=self.config.get("eos_token") or "")
        except jinja2.TemplateError as e:
            raise EngineError(f"the chat template refused these messages: {e}") from None
        return self.encode(text)
