"""Tiny random HF-format checkpoints for tests and demos.

A Qwen3 target (config.json, generation_config.json, a real WordLevel tokenizer), an EAGLE3 head in
the AngelSlim layout, and a small draft Qwen3 sharing the target's vocabulary. Tensor names are
written here from the HF / AngelSlim layouts, independently of xcompile's modules, so loading these
checkpoints also tests our key maps. Each tensor is seeded by (seed, name); std 0.2 and norm
weights 1 ± 0.1 keep logits well apart (std ~1.6, no argmax ties) while fp32 parity holds to ~1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

STD, NORM_STD = 0.2, 0.1

# config.json fields of the tiny target; head_dim 16 = hidden / heads, GQA 2
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}

# a smaller draft model over the same vocabulary (tied, like Qwen3-0.6B)
TINY_DRAFT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "tie_word_embeddings": True}

TINY_DRAFT_VOCAB = 64

SPECIALS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = ("the a an and or but if then else when where what who how why is are was were be been have has had do "
         "does did not no yes i you he she it we they me him her us them my your his its our their this that "
         "these those here there now one two three four five six seven eight nine ten cat dog bird fish tree "
         "sky sun moon star water fire earth air red green blue black white big small good bad new old hello "
         "world user assistant system question answer , . ! ? : ; ' \" ( ) - + = * / 0 1 2 3 4 5 6 7 8 9").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def _randn(seed: int, name: str, shape, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return std * torch.randn(shape, generator=g)


def _norm(seed: int, name: str, dim: int) -> torch.Tensor:
    return 1.0 + _randn(seed, name, (dim,), NORM_STD)


def qwen3_config(overrides: dict | None = None) -> dict:
    cfg = {**TINY_QWEN3, **(overrides or {})}
    if "rope_parameters" in cfg:        # transformers 5 style: theta only under rope_parameters
        cfg.pop("rope_theta", None)
    return cfg


def qwen3_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF Qwen3ForCausalLM state dict for a config.json dict (no lm_head when tied)."""
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
        if cfg.get("attention_bias"):
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    tensors = {name: _randn(seed, name, shape, STD) for name, shape in shapes.items()}
    norms = {"model.norm.weight": h}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        norms |= {p + "input_layernorm.weight": h, p + "post_attention_layernorm.weight": h,
                  p + "self_attn.q_norm.weight": d, p + "self_attn.k_norm.weight": d}
    return tensors | {name: _norm(seed, name, dim) for name, dim in norms.items()}


def eagle3_config(target_cfg: dict, overrides: dict | None = None) -> dict:
    """AngelSlim-layout head config.json (docs/eagle3.md §6.1) for a target config.json dict."""
    cfg = {
        "architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama", "target_model_type": "qwen3",
        "hidden_size": target_cfg["hidden_size"], "intermediate_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": target_cfg["num_attention_heads"],
        "num_key_value_heads": target_cfg["num_key_value_heads"],
        "head_dim": target_cfg.get("head_dim"), "vocab_size": target_cfg["vocab_size"],
        "draft_vocab_size": TINY_DRAFT_VOCAB, "rms_norm_eps": 1e-6,
        "rope_theta": target_cfg.get("rope_theta", 10000.0), "rope_scaling": None,
        "max_position_embeddings": target_cfg["max_position_embeddings"], "tie_word_embeddings": False,
        "torch_dtype": "float32", "hidden_act": "silu",
    }
    return cfg | (overrides or {})


def eagle3_tensors(cfg: dict, seed: int = 2, t2d: bool = True) -> dict[str, torch.Tensor]:
    h, i, v, dv = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["draft_vocab_size"]
    th = cfg.get("target_hidden_size", h)
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"fc.weight": (h, 3 * th), "lm_head.weight": (dv, h),
              "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
              "midlayer.mlp.down_proj.weight": (h, i)}
    tensors = {name: _randn(seed, name, shape, STD) for name, shape in shapes.items()}
    for name in ("norm.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.post_attention_layernorm.weight"):
        tensors[name] = _norm(seed, name, h)
    # draft vocabulary = dv distinct target ids, sorted; d2t holds offsets (EAGLE scandata)
    ids = torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:dv].sort().values
    tensors["d2t"] = ids - torch.arange(dv)
    if t2d:
        tensors["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    return tensors


def write_weights(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1, fmt: str = "safetensors") -> None:
    """Save as model.safetensors, N shards + model.safetensors.index.json, or pytorch_model.bin."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    if fmt == "bin":
        torch.save(tensors, path / "pytorch_model.bin")
        return
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k] for k in part}, path / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A real WordLevel tokenizer of exactly ``vocab_size`` ids: words, fillers w<N>, then the
    Qwen-style specials last. Saved as tokenizer.json + tokenizer_config.json with a chat template."""
    words = WORDS[: vocab_size - len(SPECIALS)]
    fillers = [f"w{n}" for n in range(vocab_size - len(words) - len(SPECIALS))]
    vocab = {tok: n for n, tok in enumerate([*words, *fillers, *SPECIALS])}
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(Path(path) / "tokenizer.json"))
    _write_json(Path(path) / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "add_bos_token": False,
        "unk_token": "<unk>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    })


def eos_ids(vocab_size: int) -> list[int]:
    """<|im_end|> and <|endoftext|>, as Qwen3's generation_config.json lists them."""
    return [vocab_size - 1, vocab_size - 3]


def write_qwen3_checkpoint(path: Path, overrides: dict | None = None, seed: int = 0, shards: int = 1,
                           fmt: str = "safetensors", tokenizer: bool = True) -> Path:
    """A tiny HF Qwen3ForCausalLM checkpoint dir (config, generation config, tokenizer, weights)."""
    path = Path(path)
    cfg = qwen3_config(overrides)
    path.mkdir(parents=True, exist_ok=True)
    eos = eos_ids(cfg["vocab_size"])
    _write_json(path / "config.json", cfg | {"bos_token_id": eos[1], "eos_token_id": eos[0]})
    _write_json(path / "generation_config.json", {"bos_token_id": eos[1], "eos_token_id": eos, "do_sample": False})
    if tokenizer:
        write_tokenizer(path, cfg["vocab_size"])
    write_weights(path, qwen3_tensors(cfg, seed), shards, fmt)
    return path


def write_draft_checkpoint(path: Path, overrides: dict | None = None, seed: int = 1, shards: int = 1) -> Path:
    """A smaller Qwen3 over the target's vocabulary (and tokenizer): the draft-model drafter."""
    return write_qwen3_checkpoint(path, TINY_DRAFT | (overrides or {}), seed, shards)


def write_eagle3_checkpoint(path: Path, target_overrides: dict | None = None, overrides: dict | None = None,
                            seed: int = 2, fmt: str = "safetensors", t2d: bool = True) -> Path:
    """An AngelSlim-layout EAGLE3 head for the target written with ``target_overrides``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = eagle3_config(qwen3_config(target_overrides), overrides)
    _write_json(path / "config.json", cfg)
    write_weights(path, eagle3_tensors(cfg, seed, t2d), fmt=fmt)
    return path


def save_manifest(manifest, root: Path) -> Path:
    """Save a hand-made manifest into ``root`` with the records (sizes, hashes) of every file there,
    as the exporter would have written them (runtime/enginedir/integrity.py)."""
    from xcompile.runtime.enginedir.integrity import record_file

    manifest.files = {p.name: record_file(p) for p in sorted(Path(root).iterdir()) if p.is_file()
                      and p.name not in ("manifest.json", ".xcompile")}
    manifest.save(root)
    return root


class Child:
    """A command in a child process (``*command``: its argv); its output, stdout and stderr together, is
    collected line by line as it comes, so a test can inject a fault once a step has begun."""

    def __init__(self, *command, env: dict | None = None):
        self.proc = subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {text!r}: {''.join(self.lines)}"
            assert time.monotonic() < end, f"no {text!r} after {timeout} s: {''.join(self.lines)}"
            time.sleep(0.05)

    def interrupt(self, sig: int) -> tuple[int, float]:
        """Send ``sig``; (exit code, seconds until the process ended)."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        code = self.proc.wait(60)
        return code, time.monotonic() - start

    def finish(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)


def staging_leftovers(parent: Path) -> list[str]:
    """Staging dirs/files and lock files of xcompile writers in ``parent`` (runtime/common/files.py)."""
    return sorted(p.name for p in Path(parent).iterdir() if p.name.startswith(".") and
                  p.name.endswith((".partial", ".old", ".lock")))


def write_mtp_checkpoint(path: Path, target_dir: Path, seed: int = 0, std: float = 0.2,
                         draft_vocab: int | None = None) -> Path:
    """A random MTP module for the checkpoint ``target_dir`` written as ``xcompile train-mtp`` writes one (fp32;
    every term non-trivial: matrices at ``std``, norms at 1 +- 0.1); ``draft_vocab``: with a draft vocabulary
    of that many tokens, the most frequent of random windows."""
    from xcompile.compile.checkpoint import load_qwen3
    from xcompile.compile.train_mtp import new_mtp, save_mtp

    layers = json.loads((Path(target_dir) / "config.json").read_text())["num_hidden_layers"]
    target = load_qwen3(target_dir, 64, (layers - 1,))
    g = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, target.cfg.vocab_size, (8, 64), generator=g)
    module = new_mtp(target, 64, seed, windows, draft_vocab)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name not in ("embed_tokens.weight", "shared_head.head.weight"):
                noise = torch.randn(p.shape, generator=g)
                p.copy_(std * noise if p.dim() == 2 else 1 + 0.1 * noise)
    return save_mtp(module, path, dtype=torch.float32)


def step_inputs(ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Contract step inputs for ``ids`` [B, S] written at ``start``, on ``ids``'s device: causal unless
    ``tree_mask`` [B, S, S] (eagle3: [B, S, W >= S]) is given, positions start.. unless given, logits for every row unless ``rows``."""
    b, s = ids.shape
    dev = ids.device
    if positions is None:
        positions = (start + torch.arange(s, device=dev)).expand(b, s)
    if tree_mask is None:
        tree_mask = torch.ones(s, s, dtype=torch.bool, device=dev).tril().expand(b, s, s)
    if rows is None:
        rows = torch.arange(s, device=dev).expand(b, s)
    return {"input_ids": ids, "position_ids": positions,
            "write_index": torch.full((b,), start, dtype=torch.int64, device=dev), "tree_mask": tree_mask,
            "logit_rows": rows}


def refused(result, *needles: str, code: int = 2) -> str:
    """A click CliRunner result that failed as xcompile's CLIs promise: one `error:` line on stderr naming
    what is wrong (each of ``needles``), exit ``code`` (2: a bad option, 1: a bad request), nothing on
    stdout, no traceback. Returns the line."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in result.output and result.stdout == ""
    return lines[0]


def exported_dir(tmp_path_factory, name: str, **request) -> Path:
    """An engine dir exported once per session under ``name`` (max_seq_len 64 unless the request says),
    shared by every test file that asks for the same name."""
    from xcompile.compile.pipeline import ExportRequest, export_engine_dir

    out = tmp_path_factory.getbasetemp() / name
    if not (out / "manifest.json").is_file():
        export_engine_dir(ExportRequest(out=out, **{"max_seq_len": 64, **request}))
    return out
