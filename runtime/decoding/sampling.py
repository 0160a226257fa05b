"""Sampling: ``SamplingParams``, and the one ``Sampler`` that plain decoding, the drafters and verification use.

Warping follows transformers' order (generation/utils.py ``_get_logits_processor``): temperature, then
top-k, top-p, min-p. Each step keeps the tokens whose scaled logit reaches a threshold, so a warped
row is (scaled logits, one threshold, one log-normaliser) and never a sorted copy of the vocabulary:
top-k is ``torch.topk`` of a fixed k, top-p is computed over those k candidates (it can only remove
more), and only top-p without top-k sorts the row. Tokens tied at a cut are all kept or all dropped.

Randomness is counter-based: draw number c of a request hashes (key, c, element index) with integer
tensor ops into uniforms, and the counter is a device tensor advanced by one per draw. A round makes
a fixed sequence of draws, so it needs no host sync and no torch RNG, replays identically from a CUDA
graph, and the same seed on the same backend gives the same text. Samples are Gumbel-max:
argmax(log w + G), G = -log(-log U), exactly a draw from w / sum(w).

What a captured round depends on besides tensor values: ``Sampler.mode`` (greedy, top_k, whether
top-p is on). Temperature, top_p, min_p, the key and the counter live in device tensors.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.kernels import SAMPLE_MAX_K, use_fused

GENERATION_CONFIG = "generation_config.json"
# transformers' values for sampling fields a generation_config.json leaves out
# (GenerationConfig._get_default_generation_params; min_p unset means off)
HF_DEFAULTS = dict(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0)
_SEED_LIMIT = 2**63
# temperature: 0 (greedy) or within these. Below 1e-5, logits / T leaves float32 (at 1e-44, 1/T is inf and every
# token NaN: token 0 each step); 100 is far past any useful warp (logits / 100 are all but uniform) and keeps the
# sampler's float32 buffers finite (1e39 overflowed them). cli/options.py's TEMPERATURE repeats them.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. temperature 0 is greedy (the other fields are then ignored).

    top_k 0, top_p 1 and min_p 0 switch that filter off; seed None draws a fresh one per request;
    n is the number of independent samples of one prompt."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1

    def __post_init__(self):
        def number(name, value, ok, want):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise EngineError(f"{name} must be {want}, got {value!r}")

        number("temperature", self.temperature, lambda t: t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE,
               f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
        number("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1] (1: off)")
        number("min_p", self.min_p, lambda p: 0 <= p <= 1, "in [0, 1] (0: off)")
        for name, value, low in (("top_k", self.top_k, 0), ("n", self.n, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise EngineError(f"{name} must be an integer >= {low}" + (" (0: off)" if low == 0 else "") +
                                  f", got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < _SEED_LIMIT):
            raise EngineError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def generation_defaults(directory: Path | str) -> dict:
    """Sampling fields of an engine dir's generation_config.json (copied from the checkpoint at
    export), transformers' defaults for those it leaves out. Its do_sample is not read: whether to
    sample is the caller's choice (``xrun generate --sample``); temperature 0 still means greedy."""
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        raise EngineError(f"{path}: missing, so --sample has no checkpoint values; give --temperature etc. instead")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineError(f"{path}: unreadable ({e}); re-export the engine dir") from None
    if not isinstance(data, dict):
        raise EngineError(f"{path}: expected a JSON object; re-export the engine dir")
    return {k: default if data.get(k) is None else data[k] for k, default in HF_DEFAULTS.items()}


def sampling_params(directory: Path | str | None, sample: bool = False, **explicit) -> SamplingParams:
    """SamplingParams from explicit values (None: not given) over, with ``sample``, the dir's
    generation_config.json. Raises EngineError on bad values, before anything is loaded."""
    base = generation_defaults(directory) if sample else {}
    try:
        return SamplingParams(**{**base, **{k: v for k, v in explicit.items() if v is not None}})
    except EngineError as e:
        where = f" (with {Path(directory) / GENERATION_CONFIG})" if sample else ""
        raise EngineError(f"{e}{where}") from None


# ---------------------------------------------------------------------------------------------
# counter-based uniforms from int64 tensor ops (values kept in [0, 2^32), so nothing overflows)

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32): c and c - 2^32 agree mod 2^32, and |x * c| stays < 2^63."""
    return (x * (c - 2**32 if c >= 2**31 else c)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit hash (C. Wellons' "lowbias32": two xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@dataclass
class Warped:
    """Logits after temperature, top-k, top-p and min-p: token x is kept iff scaled[x] >= tau, with
    log-probability scaled[x] - logz. Leading dims are the logits' ([B, V] or [B, R, V])."""

    scaled: torch.Tensor    # [..., V] float32 logits / temperature
    tau: torch.Tensor       # [..., 1] smallest kept scaled logit
    logz: torch.Tensor      # [..., 1] log-sum-exp over the kept tokens

    def probs(self) -> torch.Tensor:
        """[..., V] the warped distribution (0 off the kept set)."""
        return torch.where(self.scaled >= self.tau, torch.exp(self.scaled - self.logz), 0.0)

    def prob_at(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[B, S] probability of token ids[b, i] in row rows[b, i] of a [B, R, V] warp."""
        v = self.scaled.shape[-1]
        s = self.scaled.flatten(1).gather(1, rows * v + ids)
        tau, logz = self.tau[..., 0].gather(1, rows), self.logz[..., 0].gather(1, rows)
        return torch.where(s >= tau, torch.exp(s - logz), 0.0)

    def row(self, index: torch.Tensor) -> "Warped":
        """Row index[b] of a [B, R, V] warp, as a [B, V] warp."""
        def pick(t):
            return t.gather(1, index[:, None, None].expand(-1, 1, t.shape[-1]))[:, 0]

        return Warped(pick(self.scaled), pick(self.tau), pick(self.logz))


class Sampler:
    """Warping and sampling for one request at a time; the random state lives on the device.

    One instance per Generator (fixed tensor addresses, so captured graphs stay valid); ``reset``
    loads a request's parameters and key. Every method takes [B, ..., V] rows (batch first). ``fused``
    (decoding/kernels.use_fused: default on a CUDA device) draws with top-k 1..SAMPLE_MAX_K by the kernels
    of decoding/kernels/sample.py: the same law in two launches."""

    def __init__(self, device: torch.device | str = "cpu", batch: int = 1, fused: bool | None = None):
        self.device = torch.device(device)
        self.fused = use_fused(fused, self.device)
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        self.params = GREEDY
        self.temperature = torch.ones(batch, **f32)
        self.top_p = torch.ones(batch, **f32)
        self.min_p = torch.zeros(batch, **f32)
        self.key = torch.zeros(batch, 2, **i64)      # two 32-bit words of the stream key
        self.counter = torch.zeros(batch, **i64)     # draws made so far in this request
        self._golden: dict[tuple[int, ...], torch.Tensor] = {}     # element index * golden ratio, per shape

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def mode(self) -> tuple[bool, int, bool]:
        """The static part of the configuration: (greedy, top_k, top-p on)."""
        p = self.params
        return p.greedy, p.top_k, p.top_p < 1

    def reset(self, params: SamplingParams, index: int = 0) -> int | None:
        """Load ``params`` for sample ``index`` of a request (batch row b: sample index + b); returns
        the seed used (None when greedy; a fresh one when params.seed is None)."""
        self.params = params
        if params.greedy:
            return None
        seed = secrets.randbelow(_SEED_LIMIT) if params.seed is None else params.seed
        self.temperature.fill_(params.temperature)
        self.top_p.fill_(params.top_p)
        self.min_p.fill_(params.min_p)
        # stream key of (seed, sample): two hash rounds over the seed's words and the sample index
        rows = index + torch.arange(self.counter.shape[0], device=self.device)
        k0 = _mix32(_mix32(rows & _M32) ^ (seed & _M32))
        self.key[:, 0] = k0
        self.key[:, 1] = _mix32(_mix32(k0 ^ 0x85EBCA6B) ^ (seed >> 32))
        self.counter.zero_()
        return seed

    # -- warping ---------------------------------------------------------------------------

    def warp(self, logits: torch.Tensor) -> Warped:
        """logits [B, ..., V] -> their warped distribution (module docstring: order and ties)."""
        def per_row(t):                                   # [B] -> [B, 1, ..., 1]
            return t.view(-1, *[1] * (logits.dim() - 1))

        s = logits.float() / per_row(self.temperature)
        top = s.amax(-1, keepdim=True)
        # min-p: p(x) >= min_p * p(top) <=> s(x) >= s(top) + log(min_p), whatever the normaliser
        tau = top + torch.log(per_row(self.min_p))
        _, k, top_p_on = self.mode
        if k or top_p_on:
            # the candidates in descending order: all that top-k leaves (more only on ties), or the row
            vals = s.topk(min(k, s.shape[-1]), dim=-1).values if k else s.sort(dim=-1, descending=True).values
            tau_k = vals[..., -1:] if k else torch.full_like(top, -math.inf)
            tau = torch.maximum(tau, tau_k)
            if top_p_on:
                # top-p on the top-k-renormalised distribution: keep x iff the mass strictly above x is
                # < top_p (transformers' rule, sorted ascending: drop while cumsum <= 1 - top_p)
                z = torch.where(s >= tau_k, torch.exp(s - top), 0.0).sum(-1, keepdim=True)
                pv = torch.exp(vals - top) / z
                before = pv.cumsum(-1) - pv
                n = torch.arange(vals.shape[-1], device=s.device)
                starts = torch.ones_like(vals, dtype=torch.bool)
                starts[..., 1:] = vals[..., 1:] != vals[..., :-1]
                first = torch.where(starts, n, 0).cummax(-1).values     # first index of each run of ties
                above = before.gather(-1, first)
                tau_p = torch.where(above < per_row(self.top_p), vals, math.inf).amin(-1, keepdim=True)
                tau = torch.maximum(tau, tau_p)
        kept = torch.where(s >= tau, torch.exp(s - top), 0.0)
        return Warped(s, tau, top + torch.log(kept.sum(-1, keepdim=True)))

    # -- drawing ---------------------------------------------------------------------------

    def uniform(self, *shape: int) -> torch.Tensor:
        """[B, *shape] uniforms in (0, 1) (24 bits), from the next draw of every row's stream: element
        e of draw c is mix(mix(e * golden ^ mix(c ^ key0)) ^ key1)."""
        index = self._golden.get(shape)
        if index is None:                   # made once per shape (before any capture replays it)
            index = _mul32(torch.arange(math.prod(shape), device=self.device), 0x9E3779B9).view(1, *shape)
            self._golden[shape] = index
        view = (-1, *[1] * len(shape))
        base = _mix32((self.counter & _M32) ^ self.key[:, 0]).view(view)
        x = _mix32(_mix32(index ^ base) ^ self.key[:, 1].view(view))
        self.counter.add_(1)
        return ((x >> 8).float() + 0.5) * 2.0**-24

    def gumbel_argmax(self, log_weights: torch.Tensor) -> torch.Tensor:
        """[B, ..., V] unnormalised log-weights (-inf: excluded) -> [B, ...] a draw from softmax of them."""
        u = self.uniform(*log_weights.shape[1:])
        return (log_weights - torch.log(-torch.log(u))).argmax(-1)

    def draw(self, w: Warped) -> torch.Tensor:
        """[B, ...] a token from each row of a warp."""
        return self.gumbel_argmax(torch.where(w.scaled >= w.tau, w.scaled, -math.inf))

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, ..., V] -> tokens [B, ...]: the argmax when greedy (exactly), else a warped draw."""
        if self.greedy:
            return logits.argmax(-1)
        if self.draws_by_kernel:
            from xcompile.runtime.decoding.kernels import sample

            return sample.sample(logits, self)
        return self.draw(self.warp(logits))

    @property
    def draws_by_kernel(self) -> bool:
        """Whether ``sample`` draws by the sampling kernels (fused, sampled, top-k 1..SAMPLE_MAX_K)."""
        return self.fused and not self.greedy and 0 < self.params.top_k <= SAMPLE_MAX_K


def with_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a fresh seed when it has none (so the n samples of a request share one)."""
    if params.greedy or params.seed is not None:
        return params
    return replace(params, seed=secrets.randbelow(_SEED_LIMIT))
