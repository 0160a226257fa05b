"""Train the demo pair from scratch: a small Qwen3 target on CPython's own documentation, then its
EAGLE3 head with ``xcompile train-eagle3``'s function. Both are written as HF-format checkpoint dirs.
With --draft-only, train instead a small draft Qwen3 on the demo target's tokenizer; with --mtp-only, an MTP
module for the demo target with ``xcompile train-mtp``'s function.

    python scripts/train_demo.py --device cuda --out demo --minutes 5     # one H200: ~5 minutes
    python scripts/train_demo.py --tiny --device cpu --out /tmp/demo       # smoke check, ~1 minute
    python scripts/train_demo.py --draft-only --distil --device cpu --out /tmp/demo-draft --minutes 12  # 2 cores
    python scripts/train_demo.py --mtp-only --device cpu --out /tmp/demo-mtp --minutes 25   # 2 cores

Steps: byte-level BPE tokenizer on data/corpus.train.txt (scripts/make_corpus.py) -> target trained
as a causal LM (bf16 autocast, fused AdamW, warmup + cosine, the held-out best kept) -> written to
OUT/target -> head distilled from that checkpoint on the same text -> OUT/eagle3. Held-out loss and
accuracy of both are printed and recorded in OUT/demo.json.

--draft-only: the tokenizer of --target (default: the packaged demo target, tokenizer not retrained)
-> the DRAFT sizes trained by the same function as the target, on the text or (--distil) on the
target's greedy next tokens -> OUT/draft, with its held-out figures in OUT/draft/train_demo.json.

--mtp-only: an MTP module (one layer of the target's shape over its last hidden) for --target, on the same text
-> OUT/mtp, its log and measured acceptance in OUT/mtp/xcompile_train.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from xcompile.compile import data as textdata
from xcompile.compile.checkpoint import load_qwen3, module_state
from xcompile.compile.config import Qwen3Config
from xcompile.compile.hf_config import parse_qwen3
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.compile.train import Schedule, TrainOptions, autocast, optimizer
from xcompile.compile.train_eagle3 import train_eagle3_files
from xcompile.compile.train_mtp import train_mtp_files
from xcompile.runtime.enginedir.text import Text

REPO = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO / "compile" / "demo" / "target"     # the packaged target: --draft-only's default
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")       # Qwen's names; <|endoftext|> ends documents
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INIT_STD = 0.02             # HF initializer_range


@dataclass(frozen=True)
class Demo:
    """Sizes and budgets. Full: 6.9M params (13.9 MB bf16, tied embeddings) + a 2.0M-param head;
    head_dim 64 for TensorRT-RTX's attention kernels; 8 layers so the taps (1, 3, 4) are distinct."""

    vocab: int = 6144
    hidden: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 640
    seq_len: int = 1024
    rope_theta: float = 10_000.0
    batch: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.1
    target_epochs: float = 16.0         # the corpus is small (~0.7M tokens): the held-out best is kept
    target_share: float = 0.45          # of --minutes; the head gets what is left
    eval_every: int = 50
    head_batch: int = 16
    head_seq_len: int = 1024
    head_lr: float = 2e-3
    head_epochs: float = 40.0
    head_eval_every: int = 250
    draft_vocab: int = 4096             # the EAGLE3 head's, not the draft model's (which is the target's)
    docs: int | None = None             # use only the first N train documents (tiny)


TINY = Demo(vocab=512, hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, intermediate=128, seq_len=64,
            batch=8, target_epochs=1.0, eval_every=25, head_batch=8, head_seq_len=64, head_epochs=0.5,
            draft_vocab=256, docs=16)

# --draft-only: a draft model for the demo target (compile/demo/draft). 0.39M non-embedding params plus
# the tied 6144 x 128 embedding (1.18M in all); 2 layers so a draft step is ~1/4 of a target step. Sized
# for ~12 minutes on 2 CPU cores (~9k tokens/s there, ~7 epochs): batch 8 gives more steps from the same tokens.
# Its vocab is replaced by the tokenizer's; the target_* budget fields apply to it.
DRAFT = Demo(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384, batch=8, eval_every=25)


def train_tokenizer(docs: list[str], vocab: int, out: Path, seq_len: int) -> None:
    """Byte-level BPE (GPT-2/Qwen style) -> tokenizer.json + tokenizer_config.json (chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len, "add_bos_token": False,
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")


def qwen3_config(d: Demo) -> Qwen3Config:
    return Qwen3Config(vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.intermediate,
                       num_hidden_layers=d.layers, num_attention_heads=d.heads, num_key_value_heads=d.kv_heads,
                       head_dim=d.head_dim, rope_theta=d.rope_theta, max_position_embeddings=d.seq_len,
                       tie_word_embeddings=True)


def init_weights(model: Qwen3) -> None:
    """N(0, 0.02) everywhere; the projections into the residual stream scaled by 1/sqrt(2L) (GPT-2)."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            scaled = name.endswith(("o_proj.weight", "down_proj.weight"))
            torch.nn.init.normal_(p, std=INIT_STD / (math.sqrt(2 * model.cfg.num_hidden_layers) if scaled else 1))


def train_kv(model: Qwen3, batch: int, device: torch.device) -> list[torch.Tensor]:
    """Fresh caches for one training forward (write_kv scatters into them and autograd records the
    write, so they cannot be reused). write_kv does not cast, so each cache takes its tensor's dtype:
    under bf16 autocast the keys leave k_norm in fp32 (its weight is the fp32 master) and the values
    leave v_proj in bf16; SDPA then autocasts all three to bf16."""
    c = model.cfg
    shape = (batch, c.num_key_value_heads, model.max_seq_len, c.head_dim)
    values = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [torch.zeros(shape, device=device, dtype=values if i % 2 else torch.float32)
            for i in range(2 * c.num_hidden_layers)]


def lm_logits(model: Qwen3, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of a causal forward over windows [B, T]."""
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril().expand(b, t, t)
    kv = train_kv(model, b, ids.device)
    return model(ids, positions, torch.zeros(b, dtype=torch.int64, device=ids.device), causal, positions, *kv)[0]


def lm_loss(model: Qwen3, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and top-1 accuracy of one batch: windows [B, T], whose labels are the next tokens,
    or [B, 2, T], windows and a label per position (--distil: the target's greedy next tokens)."""
    ids, labels = (batch[:, 0], batch[:, 1, :-1]) if batch.dim() == 3 else (batch, batch[:, 1:])
    logits = lm_logits(model, ids)[:, :-1].float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return loss, (logits.argmax(-1) == labels).float().mean()


@torch.no_grad()
def with_target_labels(target: Qwen3, windows: torch.Tensor, batch: int) -> torch.Tensor:
    """[N, 2, T]: ``windows`` [N, T] and, at each position, the target's greedy next token, so that
    the draft learns to agree with the target (what speculative decoding accepts), not with the text."""
    device = next(target.parameters()).device
    labels = []
    for i in range(0, len(windows), batch):
        with autocast(device):
            labels.append(lm_logits(target, windows[i:i + batch].to(device)).argmax(-1).cpu())
    return torch.stack((windows, torch.cat(labels)), 1)


@torch.no_grad()
def evaluate(model: Qwen3, windows: torch.Tensor, batch: int) -> tuple[float, float]:
    device = next(model.parameters()).device
    loss = acc = 0.0
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch].to(device)
        with autocast(device):
            l, a = lm_loss(model, ids)
        loss, acc = loss + float(l) * len(ids), acc + float(a) * len(ids)
    return loss / len(windows), acc / len(windows)


def train_lm(d: Demo, train: torch.Tensor, heldout: torch.Tensor, device: torch.device, seconds: float,
             seed: int, name: str = "target") -> tuple[Qwen3, dict]:
    """A Qwen3 of ``d``'s sizes trained as a causal LM on ``train`` (windows [N, seq_len], or with labels
    [N, 2, seq_len]: see ``lm_loss``) for ``d.target_epochs`` or ``seconds``, whichever ends first; the
    held-out best is returned."""
    torch.manual_seed(seed)
    model = Qwen3(qwen3_config(d), d.seq_len).to(device)
    init_weights(model)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = optimizer([{"params": decay, "weight_decay": d.weight_decay}, {"params": other, "weight_decay": 0.0}],
                    d.lr, d.weight_decay, device)
    steps = max(1, round(d.target_epochs * len(train) / d.batch))
    sched = Schedule(d.lr, steps, seconds, warmup=0.05, min_ratio=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n_params / 1e6:.2f}M params, {len(train)} windows x {d.seq_len}, "
          f"budget {steps} steps / {seconds:.0f} s")
    data = textdata.batches(train, d.batch, seed)
    best, best_state, step, t0, meter = (math.inf, 0.0), None, 0, time.perf_counter(), []
    while (p := sched.progress(step)) < 1.0:
        for group in opt.param_groups:
            group["lr"] = sched.lr_at(p)
        with autocast(device):
            loss, acc = lm_loss(model, next(data).to(device, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        meter.append(torch.stack((loss.detach(), acc)))
        if step % d.eval_every == 0 or sched.progress(step) >= 1.0:
            tl, ta = torch.stack(meter).mean(0).tolist()
            meter.clear()
            hl, ha = evaluate(model, heldout, d.batch)
            if hl < best[0]:         # keep the held-out best: the corpus is small enough to overfit
                best, best_state = (hl, ha), {k: v.detach().clone() for k, v in model.state_dict().items()}
            print(f"{name} step {step:5d} ({step * d.batch / len(train):.1f} epochs, "
                  f"{time.perf_counter() - t0:.0f} s)  "
                  f"train loss {tl:.3f} acc {ta:.3f}  held-out loss {hl:.3f} acc {ha:.3f}", flush=True)
    model.load_state_dict(best_state)
    return model, {"params": n_params, "steps": step, "heldout_loss": best[0], "heldout_acc": best[1],
                   "seconds": round(time.perf_counter() - t0, 1)}


def save_lm(model: Qwen3, out: Path, eos: list[int]) -> None:
    """HF Qwen3ForCausalLM layout, bf16 safetensors; tied: lm_head.weight is not written."""
    from safetensors.torch import save_file

    c = model.cfg
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": True, "attention_bias": False,
        "use_sliding_window": False, "bos_token_id": eos[0], "eos_token_id": eos[0]}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos[0], "eos_token_id": eos, "do_sample": False}, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in module_state(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def read_corpus(data: Path, d: Demo) -> tuple[list[textdata.Record], list[textdata.Record]]:
    """Train and held-out documents (the first ``d.docs`` train documents and a quarter as many held-out)."""
    records = textdata.read_records(data / "corpus.train.txt")[: d.docs]
    heldout = textdata.read_records(data / "corpus.heldout.txt")
    if d.docs is not None:
        heldout = heldout[: max(1, d.docs // 4)]
    return records, heldout


def pack_corpus(records: list[textdata.Record], heldout_records: list[textdata.Record], text: Text, d: Demo,
                start: float) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Train and held-out windows [N, seq_len] and the EOS ids (<|endoftext|>, <|im_end|>)."""
    doc_end = textdata.doc_end_id(text)
    eos = [doc_end, text.tokenizer.token_to_id("<|im_end|>")]
    train = textdata.pack(textdata.tokenize(records, text), doc_end, d.seq_len)
    heldout = textdata.pack(textdata.tokenize(heldout_records, text), doc_end, d.seq_len)
    print(f"corpus: {len(records)} documents, {train.numel():,} train / {heldout.numel():,} held-out tokens "
          f"(vocab {text.tokenizer.get_vocab_size()}, {time.perf_counter() - start:.0f} s)", flush=True)
    return train, heldout, eos


def train_draft(args: argparse.Namespace, d: Demo, device: torch.device) -> None:
    """--draft-only: OUT/draft, a Qwen3 of ``d``'s sizes with --target's tokenizer (copied, not retrained)
    and vocabulary, trained with ``train_lm`` like the target, on the text or (--distil) on the target's
    greedy next tokens; its record, with held-out top-1 agreement with the target, in OUT/draft/train_demo.json."""
    start, budget = time.perf_counter(), args.minutes * 60
    d = replace(d, vocab=parse_qwen3(args.target / "config.json").vocab_size)
    draft_dir = args.out / "draft"
    draft_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(args.target / name, draft_dir / name)
    records, heldout_records = read_corpus(args.data, d)
    train, heldout, eos = pack_corpus(records, heldout_records, Text(draft_dir), d, start)
    target = load_qwen3(args.target, d.seq_len, device=device)
    agree = with_target_labels(target, heldout, d.batch)          # held-out windows + the target's tokens
    if args.distil:
        train = with_target_labels(target, train, d.batch)
        print(f"target's greedy tokens: {time.perf_counter() - start:.0f} s", flush=True)
    del target
    left = budget - (time.perf_counter() - start) - 10            # for the final evaluation and saving
    model, stats = train_lm(d, train, agree if args.distil else heldout, device, max(left, 10.0), args.seed, "draft")
    save_lm(model, draft_dir, eos)
    size = (draft_dir / "model.safetensors").stat().st_size
    (loss, acc), (_, agreement) = evaluate(model, heldout, d.batch), evaluate(model, agree, d.batch)
    summary = {"draft": asdict(d), "target": str(args.target), "distil": args.distil, "train": stats,
               "heldout": {"loss": loss, "acc": acc, "target_agreement": agreement}, "bytes": size,
               "seconds": round(time.perf_counter() - start, 1), "device": str(device),
               "threads": torch.get_num_threads()}
    (draft_dir / "train_demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\ndraft  {stats['params'] / 1e6:.2f}M params, {size / 1e6:.1f} MB: held-out loss {loss:.3f}, "
          f"next-token acc {acc:.3f}, top-1 agreement with the target {agreement:.3f}")
    print(f"done in {summary['seconds']:.0f} s -> {draft_dir}")


def train_pair(args: argparse.Namespace, d: Demo, device: torch.device) -> None:
    """The target (tokenizer trained here) -> OUT/target, then its EAGLE3 head -> OUT/eagle3."""
    start, budget = time.perf_counter(), args.minutes * 60
    train_path, heldout_path = args.data / "corpus.train.txt", args.data / "corpus.heldout.txt"
    records, heldout_records = read_corpus(args.data, d)
    target_dir, head_dir = args.out / "target", args.out / "eagle3"
    target_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer([r.text for r in records], d.vocab, target_dir, d.seq_len)
    train, heldout, eos = pack_corpus(records, heldout_records, Text(target_dir), d, start)

    model, target_stats = train_lm(d, train, heldout, device, d.target_share * budget, args.seed)
    save_lm(model, target_dir, eos)
    del model

    # the head trains on the written checkpoint (bf16 on CUDA), exactly as `xcompile train-eagle3` would
    left = budget - (time.perf_counter() - start) - 30          # for the final eval, saving, acceptance
    head_windows = len(train) * d.seq_len // d.head_seq_len
    opts = TrainOptions(steps=max(1, round(d.head_epochs * head_windows / d.head_batch)), seconds=max(left, 10.0),
                        lr=d.head_lr, batch=d.head_batch, seq_len=d.head_seq_len, draft_vocab=d.draft_vocab,
                        seed=args.seed, device=args.device, log_every=20, eval_every=d.head_eval_every, warmup=0.03)
    if d.docs is None:
        result = train_eagle3_files(target_dir, train_path, head_dir, opts, heldout_data=heldout_path)
    else:                                   # --tiny: the slice of the corpus actually used
        args.out.joinpath("train.txt").write_text(textdata.DOC_SEPARATOR.join(r.text for r in records))
        args.out.joinpath("heldout.txt").write_text(textdata.DOC_SEPARATOR.join(r.text for r in heldout_records))
        result = train_eagle3_files(target_dir, args.out / "train.txt", head_dir, opts,
                                    heldout_data=args.out / "heldout.txt")

    sizes = {path.name: (path / "model.safetensors").stat().st_size for path in (target_dir, head_dir)}
    summary = {"demo": asdict(d), "target": target_stats, "head_heldout": result.heldout,
               "acceptance": result.acceptance, "bytes": sizes,
               "seconds": round(time.perf_counter() - start, 1), "device": str(device)}
    (args.out / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\ntarget  {target_stats['params'] / 1e6:.2f}M params, {sizes['target'] / 1e6:.1f} MB: held-out loss "
          f"{target_stats['heldout_loss']:.3f}, next-token acc {target_stats['heldout_acc']:.3f}")
    print(f"eagle3  {sizes['eagle3'] / 1e6:.1f} MB: held-out TTT loss {result.heldout['loss']:.3f}, "
          f"top-1 acc vs target per step {result.heldout['step_acc']}")
    a = result.acceptance
    print(f"speculative (torch backend, chain k={a['k']}, {a['prompts']} held-out prompts): tau {a['tau']:.2f} "
          f"tokens per target pass, acceptance by depth {a['acceptance_by_position']}, "
          f"== plain greedy {a['match_plain']:.0%}")
    print(f"done in {summary['seconds']:.0f} s -> {args.out}")


# --mtp-only: the demo target's MTP module (compile/demo/mtp). Sized for 25 minutes on 2 CPU cores (1.3k tokens/s
# there with 4 TTT steps at 256 tokens a window: 968 steps, about 2.9 passes over the 0.7M-token corpus).
MTP_OPTIONS = TrainOptions(ttt_steps=4, lr=2e-3, batch=8, seq_len=256, warmup=0.03, log_every=20, eval_every=0)


def train_mtp(args: argparse.Namespace) -> None:
    """An MTP module for --target on the corpus -> OUT/mtp (``xcompile train-mtp``'s function)."""
    opts = replace(MTP_OPTIONS, seconds=args.minutes * 60, seed=args.seed, device=args.device)
    result = train_mtp_files(args.target, args.data / "corpus.train.txt", args.out / "mtp", opts,
                             heldout_data=args.data / "corpus.heldout.txt")
    a = result.acceptance
    print(f"mtp  held-out TTT loss {result.heldout['loss']:.3f}, top-1 acc vs target per step "
          f"{result.heldout['step_acc']}; chain k={a['k']}: tau {a['tau']:.2f}, acceptance by depth "
          f"{a['acceptance_by_position']}, == plain greedy {a['match_plain']:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--minutes", type=float, default=5.0, help="total budget (target + head, or the draft)")
    ap.add_argument("--data", type=Path, default=REPO / "data")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and a slice of the corpus (CPU smoke check)")
    ap.add_argument("--draft-only", action="store_true",
                    help="train only a draft model with --target's tokenizer and vocabulary -> OUT/draft")
    ap.add_argument("--mtp-only", action="store_true", help="train only an MTP module for --target -> OUT/mtp")
    ap.add_argument("--target", type=Path, default=DEMO_TARGET,
                    help="with --draft-only: the target checkpoint dir whose tokenizer the draft shares; with "
                         "--mtp-only: the target the module is for")
    ap.add_argument("--distil", action="store_true",
                    help="with --draft-only: learn the target's greedy next tokens instead of the text's")
    ap.add_argument("--target-epochs", type=float,
                    help=f"corpus passes for the target or the draft (default {Demo.target_epochs})")
    ap.add_argument("--head-epochs", type=float, help=f"corpus passes for the head (default {Demo.head_epochs})")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.mtp_only and (args.draft_only or args.tiny or args.distil or args.target_epochs or args.head_epochs):
        ap.error("--mtp-only trains the module alone (its budget is --minutes): --draft-only, --tiny, --distil, "
                 "--target-epochs and --head-epochs do nothing with it")
    d = TINY if args.tiny else DRAFT if args.draft_only else Demo()
    d = replace(d, target_epochs=args.target_epochs or d.target_epochs, head_epochs=args.head_epochs or d.head_epochs)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")         # TF32 for what autocast leaves in fp32
    if args.mtp_only:
        train_mtp(args)
    elif args.draft_only:
        train_draft(args, d, device)
    else:
        train_pair(args, d, device)


if __name__ == "__main__":
    main()
