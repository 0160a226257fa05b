"""Tiny seeded reference modules (Qwen3 target, small Qwen3 draft, EAGLE3 head, MTP module) wrapped in TorchEngine.

The runtime tests import this as ``tiny_engines`` (pytest puts this folder on sys.path). Weights are
random but seeded: std 0.3 for matrices and norm weights 1 ± 0.1 keep greedy choices well apart, so
numerically different but equivalent computations (a verify block vs one token at a time) agree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from xcompile.compile.config import Eagle3Config, Qwen3Config, Yarn
from xcompile.compile.models.eagle3 import Eagle3
from xcompile.compile.models.mtp import MTP, mtp_config
from xcompile.compile.models.qwen3 import Qwen3
from xcompile.compile.reference import eagle3_engines, qwen3_engine, torch_engines
from xcompile.runtime.decoding.drafters import (
    DraftModelDrafter,
    Eagle3ChainDrafter,
    Eagle3TreeDrafter,
    MTPChainDrafter,
    MTPTreeDrafter,
    NoDrafter,
)
from xcompile.runtime.enginedir.contract import DRAFT
from xcompile.runtime.enginedir.contract import MTP as MTP_GRAPH
from xcompile.runtime.engines.torch_module import TorchEngine

VOCAB, DRAFT_VOCAB, EOS = 128, 64, 3
TARGET_CFG = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
DRAFT_CFG = Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, rope_theta=10000.0,
                        tie_word_embeddings=True)
EAGLE3_CFG = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=32,
                          rope_theta=10000.0)
TAPS = (0, 1, 2)
# the MTP module reads the last layer's output: the target's last tap, its columns of hidden_taps
MTP_COLUMNS = slice(2 * TARGET_CFG.hidden_size, 3 * TARGET_CFG.hidden_size)


def init_(module: torch.nn.Module, seed: int, std: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return module.eval()


@dataclass
class Tiny:
    target: Qwen3
    draft: Qwen3
    eagle3: Eagle3
    d2t: torch.Tensor
    max_seq_len: int
    mtp: MTP
    mtp_vocab: MTP                  # the same module with a draft vocabulary (the EAGLE3 head's, its head those rows)

    def target_engine(self) -> TorchEngine:
        return qwen3_engine(self.target)

    def draft_engine(self) -> TorchEngine:
        return qwen3_engine(self.draft, DRAFT)

    def self_draft_engine(self) -> TorchEngine:
        """The target itself under the ``draft`` graph: a drafter that is always right."""
        return qwen3_engine(self.target, DRAFT)

    def noisy_draft_engine(self, std: float = 0.03) -> TorchEngine:
        return qwen3_engine(noisy_copy(self.target, std), DRAFT)

    def eagle3_engines(self) -> tuple[TorchEngine, TorchEngine]:
        return eagle3_engines(self.eagle3, self.max_seq_len)

    def mtp_engine(self, vocab: bool = False) -> TorchEngine:
        return torch_engines(self.mtp_vocab if vocab else self.mtp, MTP_GRAPH, self.max_seq_len)[MTP_GRAPH]


def build(max_seq_len: int = 160, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
          head_dim: int = 8, rope_scaling: Yarn | None = None) -> Tiny:
    """head_dim and rope_scaling: of all three models (the fused kernels' attention needs head_dim >= 16)."""
    torch.manual_seed(seed)
    cfgs = [dataclasses.replace(c, head_dim=head_dim, rope_scaling=rope_scaling)
            for c in (TARGET_CFG, DRAFT_CFG, EAGLE3_CFG)]
    target = init_(Qwen3(cfgs[0], max_seq_len, taps=TAPS), seed)
    draft = init_(Qwen3(cfgs[1], max_seq_len), seed + 1)
    eagle3 = init_(Eagle3(cfgs[2], max_seq_len), seed + 2)
    eagle3.embed_tokens.weight = target.model.embed_tokens.weight       # the head uses the target's table
    g = torch.Generator().manual_seed(seed + 3)
    hot = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values  # draft vocab: a subset of the target's
    d2t = hot - torch.arange(DRAFT_VOCAB)
    eagle3.d2t.copy_(d2t)
    mtp = init_(MTP(mtp_config(cfgs[0]), max_seq_len), seed + 4)
    mtp.embed_tokens.weight, mtp.shared_head.head.weight = target.model.embed_tokens.weight, target.lm_head.weight
    mtp_vocab = MTP(mtp_config(cfgs[0]), max_seq_len, draft_vocab=DRAFT_VOCAB)
    own = {k: v for k, v in mtp.state_dict().items() if not k.startswith(("embed_tokens.", "shared_head.head."))}
    mtp_vocab.load_state_dict(own, strict=False)
    mtp_vocab.d2t.copy_(d2t)
    mtp_vocab.embed_tokens.weight = target.model.embed_tokens.weight
    mtp_vocab.shared_head.head.weight = torch.nn.Parameter(target.lm_head.weight.detach()[hot].clone())
    target, draft, eagle3, mtp, mtp_vocab = (m.to(device, dtype) for m in (target, draft, eagle3, mtp, mtp_vocab))
    return Tiny(target, draft, eagle3, d2t.to(device), max_seq_len, mtp, mtp_vocab)


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    """Prompts of these lengths, drawn in order from one seeded generator (ids 4..VOCAB-1: no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def greedy_reference(target: Qwen3, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding by re-running the whole sequence each step (no KV reuse at all)."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            s = len(seq)
            kv = target.new_kv()
            ids = torch.tensor([seq])
            logits = target(ids, torch.arange(s)[None], torch.zeros(1, dtype=torch.int64),
                            torch.ones(s, s, dtype=torch.bool).tril()[None], torch.tensor([[s - 1]]), *kv)[0]
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def noisy_copy(module: Qwen3, std: float, seed: int = 7) -> Qwen3:
    """The target with every weight perturbed: a draft model that agrees often, not always."""
    copy = Qwen3(module.cfg, module.max_seq_len).to(module.lm_head.weight.device, module.lm_head.weight.dtype)
    copy.load_state_dict(module.state_dict(), strict=False)          # no taps: same parameters
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(copy.named_parameters()):
            p.add_(std * torch.randn(p.shape, generator=g).to(p.device))
    return copy.eval()


class Emulated:
    """Stands in for ``CudaGraphCapture`` on CPU: "replay" re-runs the step on the static inputs and
    copies its results into the buffers produced at capture, as a graph writes its fixed outputs."""

    def __init__(self):
        self.captures = self.replays = 0

    def __call__(self, step, device):
        self.captures += 1
        out = step()

        def replay():
            self.replays += 1
            for name, t in step().items():
                out[name].copy_(t)

        return replay, out


class RoundRecorder:
    """Stands in for a whole-round capture on CPU: like a real capture, recording runs nothing; a
    "replay" runs the recorded round (which writes its outcome into the generator's static buffer)."""

    def __init__(self):
        self.captures = self.replays = 0

    def __call__(self, step, device):
        self.captures += 1

        def replay():
            self.replays += 1
            step()

        return replay, None


# one drafter of each kind over the tiny engines
DRAFTERS = {
    "none": lambda t: NoDrafter(),
    "draft": lambda t: DraftModelDrafter(t.noisy_draft_engine(), 3),
    "eagle3": lambda t: Eagle3ChainDrafter(*t.eagle3_engines(), t.d2t, 3),
    "eagle3-tree": lambda t: Eagle3TreeDrafter(*t.eagle3_engines(), t.d2t, 4, 3, 12),
    "mtp": lambda t: MTPChainDrafter(t.mtp_engine(), 3, MTP_COLUMNS),
    "mtp-tree": lambda t: MTPTreeDrafter(t.mtp_engine(), 4, 3, 12, columns=MTP_COLUMNS),
    "mtp-vocab": lambda t: MTPChainDrafter(t.mtp_engine(vocab=True), 3, MTP_COLUMNS, d2t=t.d2t),
    "mtp-vocab-tree": lambda t: MTPTreeDrafter(t.mtp_engine(vocab=True), 4, 3, 12, columns=MTP_COLUMNS, d2t=t.d2t),
}
