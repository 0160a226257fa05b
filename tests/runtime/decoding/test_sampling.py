"""The sampler (runtime/decoding/sampling.py): parameter checks, warping against transformers' warpers, the
counter-based random stream, and draws against their distribution.

Distribution checks use a total-variation bound derived from the sample count (``tv_bound``): for N
draws from p over K outcomes, E[TV] <= 1/2 sum_k sqrt(p_k (1 - p_k) / N), and TV moves by at most 1/N
per draw, so by McDiarmid's inequality TV exceeds that mean by sqrt(ln(1/delta) / 2N) with
probability < delta = 1e-6. Seeds are fixed, so the tests are deterministic; the bound says a
correct sampler passes them for all but a one-in-a-million seed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.sampling import GREEDY, Sampler, SamplingParams, generation_defaults, sampling_params

DELTA = 1e-6


def tv_bound(p: torch.Tensor, n: int) -> float:
    """TV distance that n draws from p exceed with probability < DELTA (module docstring)."""
    p = p.double().flatten()
    return float(0.5 * torch.sqrt(p * (1 - p) / n).sum() + math.sqrt(math.log(1 / DELTA) / (2 * n)))


def tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Total variation between the empirical law of ``samples`` (outcome ids) and p."""
    counts = torch.bincount(samples.flatten(), minlength=p.numel()).double()
    return float(0.5 * (counts / samples.numel() - p.double().flatten()).abs().sum())


def sampler(params: SamplingParams, batch: int = 1) -> Sampler:
    s = Sampler("cpu", batch)
    s.reset(params)
    return s


# parameters --------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, r"temperature must be 0 \(greedy\) or in \[1e-05, 100\]"),
    ("temperature", 1e-44, "temperature"),             # logits / T: inf, every token NaN
    ("temperature", 1e39, "temperature"),              # past float32: the sampler's buffer overflowed
    ("temperature", float("nan"), "temperature"),
    ("temperature", float("inf"), "temperature"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.01, "top_p"),
    ("top_k", -1, "top_k must be an integer >= 0"),
    ("top_k", 2.5, "top_k"),
    ("min_p", -0.01, r"min_p must be in \[0, 1\]"),
    ("min_p", 1.5, "min_p"),
    ("n", 0, "n must be an integer >= 1"),
    ("seed", -1, "seed must be an integer"),
    ("seed", 2**63, "seed"),
    ("temperature", True, "temperature"),
])
def test_bad_values_are_rejected(field, value, message):
    with pytest.raises(EngineError, match=message):
        SamplingParams(**{field: value})


def test_the_cli_repeats_the_temperature_bounds():
    # cli/options.py cannot import sampling.py (torch, on every --help): its copy of the bounds is checked here
    from xcompile.runtime.cli.options import Temperature
    from xcompile.runtime.decoding.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE
    assert (Temperature.low, Temperature.high) == (MIN_TEMPERATURE, MAX_TEMPERATURE)


def test_defaults_are_greedy():
    assert GREEDY.greedy and SamplingParams(top_k=5).greedy and not SamplingParams(temperature=0.5).greedy
    SamplingParams(temperature=1, top_k=0, top_p=1, min_p=1, seed=2**63 - 1, n=8)     # the edges are fine
    SamplingParams(temperature=1e-5), SamplingParams(temperature=100.0)


def test_generation_config_values_and_overrides(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}))
    assert generation_defaults(tmp_path) == dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0)
    assert sampling_params(tmp_path, sample=True) == SamplingParams(0.6, 20, 0.95)
    assert sampling_params(tmp_path, sample=True, top_k=0, temperature=None) == SamplingParams(0.6, 0, 0.95)
    assert sampling_params(tmp_path, temperature=0.7) == SamplingParams(0.7)          # without --sample: none read
    # fields the file leaves out take transformers' defaults
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_p": None}))
    assert sampling_params(tmp_path, sample=True) == SamplingParams(1.0, 50, 1.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(EngineError, match="temperature must be .*generation_config.json"):
        sampling_params(tmp_path, sample=True)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(EngineError, match="generation_config.json: unreadable"):
        sampling_params(tmp_path, sample=True)
    with pytest.raises(EngineError, match="missing"):
        sampling_params(tmp_path / "nowhere", sample=True)


# warping -----------------------------------------------------------------------------------------


def hf_warped(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order, then softmax: the oracle."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        warpers.append(MinPLogitsWarper(p.min_p))
    scores = logits.clone()
    for w in warpers:
        scores = w(None, scores)
    return torch.softmax(scores, -1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95),          # Qwen3's generation_config
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.5),                      # top-p alone: the sorted path
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.8, min_p=0.2),
    SamplingParams(temperature=2.0, top_k=3, top_p=0.3, min_p=0.5),
    SamplingParams(temperature=1.0, top_k=500),                      # k larger than the vocabulary
])
def test_warp_matches_transformers(params):
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 7, 300, generator=g)
    want = hf_warped(logits.view(-1, 300), params).view(2, 7, 300)
    got = sampler(params, 2).warp(logits).probs()
    assert torch.equal(got > 0, want > 0)                            # the same kept sets
    assert torch.allclose(got, want, atol=1e-6)


def test_top_k_keeps_ties_and_the_warp_helpers():
    logits = torch.tensor([[[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]]])
    params = SamplingParams(temperature=1.0, top_k=2)
    w = sampler(params).warp(logits)
    want = hf_warped(logits[0], params)[0]                          # transformers keeps every tie of the k-th
    assert torch.allclose(w.probs()[0, 0], want, atol=1e-7) and int((want > 0).sum()) == 4
    # row / prob_at read the same distribution
    assert torch.allclose(w.row(torch.tensor([0])).probs()[0], want)
    assert torch.allclose(w.prob_at(torch.tensor([[0, 0]]), torch.tensor([[1, 5]]))[0], want[[1, 5]])


def test_top_p_boundary_and_ties():
    # probs 0.5, 0.25, 0.125, 0.125: top_p 0.75 keeps the first two (the mass before the third is 0.75,
    # not < 0.75), top_p 0.76 the tied pair as well
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    for top_p, kept in ((0.5, 1), (0.75, 2), (0.76, 4), (1.0, 4)):
        w = sampler(SamplingParams(temperature=1.0, top_p=top_p)).warp(logits)
        assert int((w.probs() > 0).sum()) == kept, top_p


# the random stream -------------------------------------------------------------------------------


def test_uniforms_are_uniform_and_in_range():
    s = sampler(SamplingParams(temperature=1.0, seed=3))
    u = s.uniform(200_000)[0]
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert int(s.counter) == 1
    bins = 100
    counts = torch.bincount((u * bins).long(), minlength=bins).double()
    expected = u.numel() / bins
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 170                       # chi-square, 99 dof: P(chi2 > 170) < 1e-5 under uniformity
    v = s.uniform(200_000)[0]               # the next draw: uncorrelated with the first, element by element
    assert abs(float(torch.corrcoef(torch.stack((u, v)))[0, 1])) < 0.015
    assert abs(float(torch.corrcoef(torch.stack((u[:-1], u[1:])))[0, 1])) < 0.015


def test_streams_are_reproducible_and_distinct():
    a, b = sampler(SamplingParams(temperature=1.0, seed=7), 3), sampler(SamplingParams(temperature=1.0, seed=7), 3)
    x, y = a.uniform(64), b.uniform(64)
    assert torch.equal(x, y)                                          # same seed, same numbers
    assert not torch.equal(x[0], x[1]) and not torch.equal(x[1], x[2])  # batch rows: separate streams
    assert not torch.equal(a.uniform(64), x)                          # each draw advances the counter
    c = Sampler("cpu", 1)
    assert c.reset(SamplingParams(temperature=1.0, seed=7), index=1) == 7
    assert torch.equal(c.uniform(64)[0], x[1])                       # sample index i is row i's stream
    c.reset(SamplingParams(temperature=1.0, seed=8))
    assert not torch.equal(c.uniform(64)[0], x[0])
    assert c.reset(SamplingParams(temperature=1.0)) is not None       # no seed: a fresh one, reported
    assert c.reset(GREEDY) is None


def test_global_torch_rng_is_not_used():
    s = sampler(SamplingParams(temperature=1.0, top_k=3, seed=1))
    logits = torch.randn(1, 5, 50)
    torch.manual_seed(0)
    first = s.sample(logits)
    s.reset(SamplingParams(temperature=1.0, top_k=3, seed=1))
    torch.manual_seed(1)
    assert torch.equal(s.sample(logits), first)


# draws -------------------------------------------------------------------------------------------


def test_greedy_sample_is_argmax():
    logits = torch.randn(1, 9, 1000)
    assert torch.equal(sampler(GREEDY).sample(logits), logits.argmax(-1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.5, top_k=4, seed=2),
    SamplingParams(temperature=1.5, top_p=0.8, min_p=0.1, seed=3),
])
def test_draws_follow_the_warped_distribution(params):
    n, v = 50_000, 12
    logits = torch.randn(1, 1, v, generator=torch.Generator().manual_seed(5)).expand(1, n, v)
    s = sampler(params)
    p = s.warp(logits[:, :1]).probs()[0, 0]
    draws = s.sample(logits)[0]                         # n rows of one draw: n independent tokens
    assert tv(draws, p) < tv_bound(p, n)
    assert bool((p[draws] > 0).all())                   # never a filtered-out token
