"""Training text for ``xcompile train-eagle3`` (and the demo target): read, tokenise, pack, batch.

Inputs:
  - plain text (``.txt``, optionally ``.gz``): documents are separated by a line holding a single form
    feed (``DOC_SEPARATOR``); a file without one is a single document;
  - JSONL (``.jsonl``/``.json``, optionally ``.gz``): one object a line, ``{"text": ...}`` or
    ``{"prompt": ..., ["response": ...]}``. Prompts are wrapped in the tokenizer's chat template
    (``runtime.text.Text``) and may get their responses regenerated greedily by the target.

Every document ends with the document-end token and the stream is cut into windows of ``seq_len``
tokens (packing, as in pretraining: a window may span two documents).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from xcompile.compile.errors import CompileError
from xcompile.compile.hf_config import read_json
from xcompile.runtime.common import logs
from xcompile.runtime.enginedir.text import Text

DOC_SEPARATOR = "\n\f\n"
TEXT_KEYS, PROMPT_KEYS, RESPONSE_KEYS = ("text",), ("prompt",), ("response", "completion")


@dataclass(frozen=True)
class Record:
    """One training document: ``text`` alone, or a chat ``prompt`` with an optional ``response``."""

    text: str = ""
    prompt: str | None = None
    response: str | None = None


def _open_text(path: Path) -> str:
    if not path.is_file():
        raise CompileError(f"{path}: data file not found")
    try:
        raw = path.read_bytes()
        return (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise CompileError(f"{path}: cannot read as UTF-8 text ({e})") from None


def _string_field(obj, keys: tuple[str, ...]) -> str | None:
    return next((obj[k] for k in keys if isinstance(obj, dict) and isinstance(obj.get(k), str)), None)


def read_records(path: str | Path) -> list[Record]:
    """Plain text split at form-feed lines, or JSONL with ``text`` or ``prompt`` fields."""
    path = Path(path)
    text = _open_text(path)
    if not {".jsonl", ".json"} & set(path.suffixes):
        return [Record(text=d.strip()) for d in text.split(DOC_SEPARATOR) if d.strip()]
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CompileError(f"{path}:{n}: not valid JSON ({e})") from None
        if (t := _string_field(obj, TEXT_KEYS)) is not None:
            records.append(Record(text=t))
        elif (p := _string_field(obj, PROMPT_KEYS)) is not None:
            records.append(Record(prompt=p, response=_string_field(obj, RESPONSE_KEYS)))
        else:
            raise CompileError(f"{path}:{n}: expected an object with a string 'text' or 'prompt' field")
    if not records:
        raise CompileError(f"{path}: no records")
    return records


def doc_end_id(text: Text) -> int:
    """The token that ends every document: tokenizer_config.json's eos_token (Qwen3 base:
    <|endoftext|>, instruct: <|im_end|>), else the first eos id of generation_config.json / config.json."""
    eos = text.config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    found = text.tokenizer.token_to_id(eos) if isinstance(eos, str) else None
    if found is None:
        gen = text.directory / "generation_config.json"
        ids = read_json(gen if gen.is_file() else text.directory / "config.json").get("eos_token_id")
        found = ids[0] if isinstance(ids, list) and ids else ids
    if not isinstance(found, int):
        raise CompileError(f"{text.directory / 'tokenizer_config.json'}: no eos_token (nor eos_token_id in "
                           "generation_config.json/config.json) to end documents with")
    return found


def tokenize(records: list[Record], text: Text, responses: bool = True) -> list[list[int]]:
    """Token ids per record: the text, or the prompt under the chat template followed by its response
    (when ``responses`` and the record has one; pass False to regenerate responses with the target)."""
    plain = [e.ids for e in text.tokenizer.encode_batch([r.text for r in records], add_special_tokens=False)]
    out = []
    for r, ids in zip(records, plain):
        if r.prompt is not None:
            ids = text.chat(r.prompt) + (text.encode(r.response) if responses and r.response else [])
        out.append(ids)
    return out


def pack(sequences: list[list[int]], doc_end_id: int, seq_len: int) -> torch.Tensor:
    """Documents + document-end tokens, concatenated and cut into windows [N, seq_len] (int64)."""
    stream = [t for seq in sequences for t in (*seq, doc_end_id)]
    n = len(stream) // seq_len
    if n == 0:
        raise CompileError(f"the data holds {len(stream)} tokens, fewer than one window of --seq-len {seq_len}")
    return torch.tensor(stream[: n * seq_len], dtype=torch.int64).view(n, seq_len)


def batches(windows: torch.Tensor, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch, seq_len] batches: seeded shuffles, one epoch after another, last partial batch
    dropped (fixed shapes). Windows repeat within a batch only if there are fewer than ``batch``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(windows), generator=g)
        if len(order) < batch:
            order = order.repeat(-(-batch // len(order)))
        for i in range(0, len(order) - batch + 1, batch):
            yield windows[order[i:i + batch]]


@torch.no_grad()
def greedy_complete(target, prompts: list[list[int]], stop_ids: set[int], max_new_tokens: int,
                    batch: int = 16) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by a ``models.qwen3.Qwen3`` target, batched (the runtime's
    Generator decodes one sequence at a time; regenerating a data set wants many at once).

    Prompts are right-padded into one prefill; each row then decodes at its own ``write_index``, so
    the padding's cache rows are overwritten before they are ever attended to. A continuation stops
    after a stop id (kept) or ``max_new_tokens``."""
    device = next(target.parameters()).device
    out: list[list[int]] = []
    for i in logs.each(range(0, len(prompts), batch), "regenerate", "batches"):
        keep = max(1, target.max_seq_len - max_new_tokens)          # leave room for the continuation
        chunk = [p[-keep:] for p in prompts[i:i + batch]]
        b, width = len(chunk), max(len(p) for p in chunk)
        ids = torch.zeros(b, width, dtype=torch.int64)
        for r, p in enumerate(chunk):
            ids[r, :len(p)] = torch.tensor(p)
        lens = torch.tensor([len(p) for p in chunk], device=device)
        kv = target.new_kv(b, device=device)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(b, -1, -1)
        pos = torch.arange(width, device=device).expand(b, -1)
        logits = target(ids.to(device), pos, torch.zeros_like(lens), causal, (lens - 1)[:, None], *kv)[0]
        new, done = [], torch.zeros(b, dtype=torch.bool, device=device)
        stop = torch.tensor(sorted(stop_ids), device=device)
        one = torch.ones(b, 1, 1, dtype=torch.bool, device=device)
        for _ in range(min(max_new_tokens, target.max_seq_len - width)):
            token = logits[:, -1].argmax(-1)
            new.append(token)
            done |= torch.isin(token, stop)
            if bool(done.all()):
                break
            logits = target(token[:, None], lens[:, None], lens, one, torch.zeros_like(lens)[:, None], *kv)[0]
            lens = lens + 1
        rows = torch.stack(new, 1).tolist() if new else [[] for _ in chunk]
        for row in rows:
            end = next((k + 1 for k, t in enumerate(row) if t in stop_ids), len(row))
            out.append(row[:end])
    return out
