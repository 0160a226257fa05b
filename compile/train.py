"""What every drafter trainer shares (``xcompile train-eagle3``, ``xcompile train-mtp``): the loop, the files-in /
dir-out path; the "training-time test" pieces are in ttt.py, the acceptance check through the runtime in
acceptance.py.

The TTT recipe (docs/eagle3.md §8; EAGLE ``traineagle3/cnets.py``): the frozen target gives logits and its taps
for a window of tokens x; ``ttt_steps`` unrolled draft steps, step j at index t reading token x_{t+1+j} and
predicting x_{t+2+j}, attending to step-0 keys at indices <= t and to steps 1..j keys at index t only (what a
draft chain sees at inference); loss_j = soft cross-entropy against the target's distribution at t+1+j;
total = sum_j 0.8^j loss_j. Each drafter's module gives its unrolled forward and its loss (``StepLoss``), and a
``Recipe`` its taps, files and reload.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from xcompile.compile import data as textdata
from xcompile.compile.acceptance import measure_acceptance
from xcompile.compile.build import available_memory
from xcompile.compile.checkpoint import load_qwen3, resolve
from xcompile.compile.config import Qwen3Config
from xcompile.compile.errors import CompileError, CompileOptionError
from xcompile.compile.hf_config import parse_generation_config, parse_qwen3, read_json
from xcompile.runtime.common import files, logs
from xcompile.runtime.enginedir.text import Text

HEAD_INIT_STD = 0.02        # HF initializer_range, as the reference trainers build the draft


@dataclass(frozen=True)
class TrainOptions:
    """Knobs of one distillation run. ``steps``, ``tokens`` and ``seconds`` bound the run (the first
    reached ends it; the LR schedule follows the same progress); none given = one pass over the data."""

    ttt_steps: int = 7                  # unrolled draft steps (EAGLE3 ``length``)
    steps: int | None = None
    tokens: int | None = None
    seconds: float | None = None
    lr: float = 1e-3
    warmup: float = 0.05                # fraction of the run spent ramping the LR up
    min_lr_ratio: float = 0.1           # cosine decay floor
    weight_decay: float = 0.0           # EAGLE/SpecForge train the head without weight decay
    grad_clip: float = 0.5              # EAGLE/SpecForge max grad norm
    batch: int = 8
    seq_len: int = 512
    draft_vocab: int = 32000            # the draft vocabulary (an MTP module's: the whole one where N reaches it)
    seed: int = 0
    device: str = "cuda"
    log_every: int = 10
    eval_every: int = 0                 # optimizer steps between held-out evaluations (0 = at the end only)
    acceptance_prompts: int = 8         # prompts to measure real acceptance on after training (0 = skip)


class Schedule:
    """Warmup + cosine LR over the run's progress in [0, 1]: the largest of steps done / step
    budget and seconds spent / time budget (so a time-bounded run still decays to its floor)."""

    def __init__(self, lr: float, steps: int | None, seconds: float | None, warmup: float, min_ratio: float):
        if steps is None and seconds is None:
            raise CompileError("a training run needs a step, token or time budget")
        self.lr, self.steps, self.seconds, self.warmup, self.min_ratio = lr, steps, seconds, warmup, min_ratio
        self.start = time.perf_counter()

    def progress(self, step: int) -> float:
        p = step / self.steps if self.steps else 0.0
        if self.seconds:
            p = max(p, (time.perf_counter() - self.start) / self.seconds)
        return p

    def lr_at(self, p: float) -> float:
        ramp = min(1.0, p / self.warmup) if self.warmup > 0 else 1.0
        return self.lr * ramp * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


def autocast(device: torch.device):
    """bf16 autocast on CUDA; plain fp32 elsewhere (CPU bf16 matmuls are slow and not needed)."""
    return torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def optimizer(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW with betas (0.9, 0.95) as EAGLE's ds_config; fused kernels on CUDA."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=device.type == "cuda")


# one training or held-out step: token windows [B, T] and the target's KV for them -> (weighted total loss,
# per-step losses [J], per-step top-1 accuracy against the target [J])
StepLoss = Callable[[torch.Tensor, list[torch.Tensor]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@torch.no_grad()
def evaluate(target, loss: StepLoss, windows: torch.Tensor, opts: TrainOptions) -> dict:
    """Held-out TTT loss and per-step top-1 accuracy over ``windows`` (in batches of opts.batch)."""
    device = next(target.parameters()).device
    total_loss, losses, accs, n = 0.0, 0.0, 0.0, 0
    for i in logs.each(range(0, len(windows), opts.batch), "held-out", "batches"):
        ids = windows[i:i + opts.batch].to(device)
        with autocast(device):
            total, step_losses, step_accs = loss(ids, target.new_kv(len(ids), device=device))
        w = len(ids)
        total_loss, losses, accs, n = total_loss + total * w, losses + step_losses * w, accs + step_accs * w, n + w
    return {"loss": float(total_loss / n), "step_loss": [round(float(x), 4) for x in losses / n],
            "step_acc": [round(float(x), 4) for x in accs / n]}


@dataclass
class TrainResult:
    """What a trainer returns."""

    head: torch.nn.Module                                   # the trained drafter, fp32 master weights
    history: list[dict] = field(default_factory=list)       # one row per log/eval point
    heldout: dict | None = None
    acceptance: dict | None = None                          # measure_acceptance's report


def check_target(target, windows: torch.Tensor, opts: TrainOptions, what: str) -> None:
    """What a TTT run needs of the frozen target and the windows."""
    device = next(target.parameters()).device
    if device.type == "cuda" and target.lm_head.weight.dtype != torch.bfloat16:
        # the target's KV writes do not cast: under autocast an fp32 target's keys and values differ in dtype
        raise CompileError(f"{what} on CUDA wants the target in bfloat16, got {target.lm_head.weight.dtype}")
    if windows.shape[1] < opts.ttt_steps + 2:
        raise CompileError(f"--seq-len {windows.shape[1]} is too short for --ttt-steps {opts.ttt_steps}")
    target.eval().requires_grad_(False)


def check_memory(c: Qwen3Config, opts: TrainOptions, dtype: torch.dtype, device: torch.device) -> None:
    """A --batch whose KV buffers alone (Qwen3.new_kv at --seq-len) exceed the free memory is refused before the
    target loads; a step that runs out anyway is refused in train_head (activations and gradients come on top)."""
    kv = (2 * c.num_hidden_layers * opts.batch * c.num_key_value_heads * opts.seq_len * c.head_dim
          * dtype.itemsize)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    if free is not None and kv > free:
        raise CompileOptionError(f"--batch {opts.batch}: the target's KV buffers alone take {kv / 2**30:.1f} GiB, "
                                 f"{free / 2**30:.1f} GiB are free on {device}; lower --batch or --seq-len")


def train_head(target, head: torch.nn.Module, loss_of: StepLoss, windows: torch.Tensor, opts: TrainOptions,
               heldout: torch.Tensor | None = None, log: Callable[[str], None] = print) -> TrainResult:
    """The loop every drafter's TTT recipe shares: AdamW on ``head``'s own parameters (not the target's shared
    embedding or lm_head), warmup + cosine LR over the run's budget, a log line every ``log_every`` steps and
    held-out evaluations."""
    device = next(target.parameters()).device
    shared = {id(p) for p in target.parameters()}
    # not the target's tensors, nor what the head keeps frozen (an MTP module's copy of draft-vocabulary head rows)
    params = [p for p in head.parameters() if id(p) not in shared and p.requires_grad]
    opt = optimizer(params, opts.lr, opts.weight_decay, device)
    per_step = opts.batch * windows.shape[1]
    steps = opts.steps or (-(-opts.tokens // per_step) if opts.tokens else None)
    if steps is None and opts.seconds is None:
        steps = max(1, len(windows) // opts.batch)                              # one pass
    sched = Schedule(opts.lr, steps, opts.seconds, opts.warmup, opts.min_lr_ratio)
    log(f"{len(windows)} windows x {windows.shape[1]} tokens, {sum(p.numel() for p in params) / 1e6:.2f}M "
        f"trainable params, {opts.ttt_steps} TTT steps, batch {opts.batch}, budget "
        f"{steps or '-'} steps / {f'{opts.seconds:.0f}' if opts.seconds else '-'} s")
    data, kv = textdata.batches(windows, opts.batch, opts.seed), target.new_kv(opts.batch, device=device)
    result, meter, step, t0 = TrainResult(head), [], 0, time.perf_counter()
    # the bar counts steps, or seconds for a time-only budget; its loss note changes with each log line
    with logs.progress("train", steps or opts.seconds, "steps" if steps else "s") as bar:
        while (p := sched.progress(step)) < 1.0:
            for group in opt.param_groups:
                group["lr"] = sched.lr_at(p)
            ids = next(data).to(device, non_blocking=True)
            try:
                with autocast(device):
                    loss, step_losses, step_accs = loss_of(ids, kv)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                    raise
                raise CompileOptionError(f"--batch {opts.batch}: out of memory on {device} at step {step + 1} "
                                         f"({str(e).splitlines()[0][:120]}); lower --batch or --seq-len") from None
            torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
            opt.step()
            step += 1
            meter.append(torch.cat((loss.detach()[None], step_accs)))
            bar.update(completed=step if steps else time.perf_counter() - t0)
            done = sched.progress(step) >= 1.0
            if step % opts.log_every == 0 or done:
                m = torch.stack(meter).mean(0).tolist()                               # one host sync per log line
                meter.clear()
                row = {"step": step, "tokens": step * per_step, "seconds": round(time.perf_counter() - t0, 1),
                       "lr": sched.lr_at(p), "loss": round(m[0], 4), "step_acc": [round(a, 3) for a in m[1:]]}
                result.history.append(row)
                log(f"step {step:6d}  loss {m[0]:.4f}  acc " + " ".join(f"{a:.2f}" for a in m[1:])
                    + f"  lr {row['lr']:.2e}  {row['tokens'] / max(row['seconds'], 1e-9):,.0f} tok/s")
                bar.update(note=f"loss {m[0]:.4f}")
            if heldout is not None and (done or (opts.eval_every and step % opts.eval_every == 0)):
                ev = evaluate(target, loss_of, heldout, opts)
                result.history.append({"step": step, "heldout": ev})
                result.heldout = ev
                log(f"step {step:6d}  held-out loss {ev['loss']:.4f}  acc "
                    + " ".join(f"{a:.2f}" for a in ev["step_acc"]))
    return result


@dataclass(frozen=True)
class Recipe:
    """What a drafter's trainer adds to the shared files-in, dir-out path (``train_files``)."""

    command: str                                            # "train-eagle3", for the staging lock and logs
    taps: Callable[[Qwen3Config], tuple[int, ...]]          # the target layers the drafter reads
    train: Callable[..., TrainResult]                       # (target, windows, opts, heldout, log)
    save: Callable[..., Path]                               # (head, out, metadata=)
    load: Callable[[Path, object], torch.nn.Module]         # (written dir, target) -> the head as deployed


def train_files(recipe: Recipe, model: str | Path, data: str | Path, out: str | Path, opts: TrainOptions,
                heldout_data: str | Path | None = None, regenerate: bool = False, max_new_tokens: int = 256,
                log: Callable[[str], None] = print, revision: str | None = None, force: bool = False) -> TrainResult:
    """Load the target checkpoint and its tokenizer, read and pack the data (regenerating prompt responses
    greedily with the target when asked), train, write the drafter's dir (plus xcompile_train.json with the
    options, the log and the measured acceptance), reload it as deployed and measure acceptance on prompts cut
    from the held-out (else training) windows.

    ``out`` is staged (runtime/common/files.py): locked and checked against the inputs before the target
    loads, written only when everything succeeded; an existing dir needs ``force`` and must be one
    xcompile wrote."""
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CompileOptionError("--device cuda (the default): torch sees no CUDA device here; pass --device cpu "
                                 "(fine for a small model such as the demo's)")
    model_dir = resolve(str(model), revision)
    with files.staged_dir(out, f"xcompile {recipe.command}", inputs=(model_dir, data, heldout_data),
                          replace=force) as tmp:
        result = _train_into(recipe, tmp, model, model_dir, data, opts, heldout_data, regenerate, max_new_tokens,
                             log, revision)
    log(f"wrote {out}")
    return result


def _holds_prompts(path: str | Path) -> bool:
    """Whether ``path`` holds a chat prompt (True where it does not parse: that is reported, with its option, where
    the data is read)."""
    try:
        return any(r.prompt is not None for r in textdata.read_records(path))
    except CompileError:
        return True


def _train_into(recipe: Recipe, out: Path, model: str | Path, model_dir: Path, data: str | Path, opts: TrainOptions,
                heldout_data: str | Path | None, regenerate: bool, max_new_tokens: int,
                log: Callable[[str], None], revision: str | None = None) -> TrainResult:
    """``train_files``' work, writing the drafter into the staging dir ``out``."""
    device = torch.device(opts.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # max_seq_len = seq_len: training windows are whole prefills; generation stays inside it too
    cfg = parse_qwen3(model_dir / "config.json")
    if opts.seq_len > cfg.context_length:
        raise CompileOptionError(f"--seq-len {opts.seq_len} is past the {cfg.context_length} positions {model}'s RoPE covers "
                           "(max_position_embeddings in its config.json); give at most that")
    if regenerate and not _holds_prompts(data):
        raise CompileOptionError(f"--regenerate: {data} holds no prompts (JSONL records with a prompt or messages), "
                                 "so no response would be regenerated; drop --regenerate or give chat data")
    check_memory(cfg, opts, dtype, device)
    taps = recipe.taps(cfg)
    target = load_qwen3(model_dir, max_seq_len=opts.seq_len, taps=taps, dtype=dtype, device=device)
    text = Text(model_dir)
    doc_end = textdata.doc_end_id(text)

    def windows_of(path: str | Path, option: str) -> torch.Tensor:
        try:
            return _windows(path)
        except CompileError as e:                       # which of the two files, where the message names none
            raise type(e)(str(e) if str(path) in str(e) else f"{option} {path}: {e}") from None

    def _windows(path: str | Path) -> torch.Tensor:
        records = textdata.read_records(path)
        seqs = textdata.tokenize(records, text, responses=not regenerate)
        if regenerate:
            chat = [i for i, r in enumerate(records) if r.prompt is not None]
            log(f"regenerating {len(chat)} responses greedily with the target (max {max_new_tokens} tokens)")
            gen = parse_generation_config(model_dir / "generation_config.json", read_json(model_dir / "config.json"))
            stops = {doc_end, *gen.eos_token_ids}
            for i, resp in zip(chat, textdata.greedy_complete(target, [seqs[i] for i in chat], stops, max_new_tokens)):
                seqs[i] = seqs[i] + resp
        return textdata.pack(seqs, doc_end, opts.seq_len)

    windows = windows_of(data, "--data")
    heldout = windows_of(heldout_data, "--heldout") if heldout_data is not None else None
    result = recipe.train(target, windows, opts, heldout, log)
    meta = {"target": str(model), "revision": revision, "data": str(data), "heldout_data": str(heldout_data) if heldout_data else None,
            "regenerate": regenerate, "tap_layers": list(target.taps), "options": asdict(opts),
            # the head's draft vocabulary as built (None: the whole vocabulary, where --draft-vocab reached it)
            "draft_vocab": int(result.head.d2t.numel()) if hasattr(result.head, "d2t") else None,
            "heldout": result.heldout, "history": result.history}
    recipe.save(result.head, out, metadata=meta)
    if opts.acceptance_prompts:
        source = heldout if heldout is not None else windows
        prompts = source[:opts.acceptance_prompts, :opts.seq_len // 4].tolist()
        head = recipe.load(Path(out), target)                               # as deployed: the written file
        result.acceptance = measure_acceptance(target, head, prompts, min(128, opts.seq_len // 2))
        result.acceptance["prompts_from"] = "heldout" if heldout is not None else "train"
        meta["acceptance"] = result.acceptance
        (Path(out) / "xcompile_train.json").write_text(json.dumps(meta, indent=2) + "\n")
        a = result.acceptance
        log(f"acceptance ({a['prompts']} {a['prompts_from']} prompts, chain k={a['k']}, {a['new_tokens']} new tokens): "
            f"tau {a['tau']:.2f}, by depth {a['acceptance_by_position']}, output == plain greedy for "
            f"{a['match_plain']:.0%} of prompts")
    return result

