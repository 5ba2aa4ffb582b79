"""Triton sampling kernel against kernels.reference, and the statistics of its noise."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import kernels.reference as reference
from tests.helpers.paged_inputs import DEVICE, gpu_test


def _batch(num_rows: int, vocab: int, seed: int, greedy_fraction: float = 0.3, filtered: bool = True):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(DEVICE)
    temperature = torch.rand(num_rows, generator=gen) * 1.5 + 0.1
    temperature[torch.rand(num_rows, generator=gen) < greedy_fraction] = 0.0
    # A threshold at some logit of the row (the k-th largest for a random k), or none.
    ranks = torch.randint(0, vocab, (num_rows,), generator=gen)
    thresholds = logits.cpu().sort(dim=-1, descending=True).values.gather(1, ranks[:, None]).squeeze(1)
    if not filtered:
        thresholds.fill_(float("-inf"))
    thresholds[torch.rand(num_rows, generator=gen) < 0.5] = float("-inf")
    seeds = torch.randint(0, 2**63 - 1, (num_rows,), generator=gen)
    seeds[torch.rand(num_rows, generator=gen) < 0.3] = -1
    sample_indices = torch.randint(0, 4, (num_rows,), generator=gen)
    positions = torch.randint(0, 100_000, (num_rows,), generator=gen)
    cols = [temperature, thresholds, seeds, sample_indices, positions]
    return logits, *[c.to(DEVICE) for c in cols]


def _check_against_reference(batch, step_seed, random=True):
    logits, temperature, thresholds, seeds, sample_indices, positions = batch
    args = (logits, temperature, thresholds, seeds, sample_indices, positions, step_seed)
    tokens, logprobs, lse = kernels.sample_tokens(*args, random=random)
    ref_tokens, ref_logprobs, ref_lse = reference.sample_tokens(*args, random=random)
    assert tokens.dtype == torch.int64 and logprobs.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # The race keys of the kernel's and the reference's picks may differ only by float rounding
    # of the logs (a near tie); everywhere else the tokens are identical.
    rows = torch.arange(logits.shape[0], device=logits.device)
    noise = reference.gumbel_noise(logits.shape[1], rows, seeds, sample_indices, positions, step_seed)
    keys = torch.where(temperature[:, None] > 0, logits / temperature.clamp(min=1e-30)[:, None] + noise, logits)
    keys = torch.where((temperature[:, None] > 0) & (logits < thresholds[:, None]), float("-inf"), keys)
    differ = tokens != ref_tokens
    gap = (keys.gather(1, ref_tokens[:, None]) - keys.gather(1, tokens[:, None])).abs().squeeze(1)
    assert (gap[differ] < 1e-4).all(), (tokens[differ], ref_tokens[differ], gap[differ])
    assert differ.float().mean() <= 0.05
    same = ~differ
    torch.testing.assert_close(logprobs[same], ref_logprobs[same], rtol=1e-5, atol=1e-5)
    return tokens, ref_tokens


@settings(max_examples=15, deadline=None)
@given(num_rows=st.integers(1, 6), vocab=st.integers(2, 700), seed=st.integers(0, 2**16),
       step_lo=st.integers(0, 2**31 - 1), step_hi=st.integers(0, 2**31 - 1))
def test_kernel_matches_reference(num_rows, vocab, seed, step_lo, step_hi):
    _check_against_reference(_batch(num_rows, vocab, seed), (step_lo, step_hi))


def test_greedy_variant_takes_the_first_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [5.0, 1.0, 5.0, 5.0]], device=DEVICE)
    zeros = torch.zeros(2, device=DEVICE)
    ints = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    tokens, logprobs, _ = kernels.sample_tokens(logits, zeros, zeros - math.inf, ints - 1, ints, ints, (1, 2),
                                                random=False)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))


def test_noise_is_a_function_of_seed_index_and_position():
    vocab = 64
    rows = torch.arange(3)
    seeds = torch.tensor([7, 7, 7])
    base = reference.gumbel_noise(vocab, rows, seeds, torch.tensor([0, 0, 0]), torch.tensor([5, 5, 5]), (1, 2))
    # Seeded rows ignore their row number and the step seed.
    assert torch.equal(base[0], base[1]) and torch.equal(base[0], base[2])
    moved = reference.gumbel_noise(vocab, torch.tensor([9]), seeds[:1], torch.tensor([0]), torch.tensor([5]), (3, 4))
    assert torch.equal(moved[0], base[0])
    for other in [(torch.tensor([8]), torch.tensor([0]), torch.tensor([5])),  # seed
                  (seeds[:1], torch.tensor([1]), torch.tensor([5])),  # sample index
                  (seeds[:1], torch.tensor([0]), torch.tensor([6]))]:  # position
        assert not torch.equal(reference.gumbel_noise(vocab, rows[:1], *other, (1, 2))[0], base[0])
    # Unseeded rows take the step seed and their row number.
    unseeded = reference.gumbel_noise(vocab, rows[:2], torch.tensor([-1, -1]), torch.tensor([0, 0]),
                                      torch.tensor([5, 5]), (1, 2))
    assert not torch.equal(unseeded[0], unseeded[1])


def test_noise_is_gumbel_distributed():
    rows = torch.arange(64)
    noise = reference.gumbel_noise(4096, rows, torch.full((64,), -1), torch.zeros(64, dtype=torch.int64),
                                   torch.arange(64), (123, 456)).double()
    euler_gamma = 0.5772156649
    assert abs(noise.mean().item() - euler_gamma) < 0.01
    assert abs(noise.var().item() - math.pi ** 2 / 6) < 0.03


def test_race_samples_the_tempered_distribution():
    """Frequencies of many unseeded draws from one row match softmax(logits / T) (chi-square)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    temperature, draws = 0.7, 20000
    probs = (logits / temperature).softmax(-1)
    tokens, _, _ = reference.sample_tokens(
        logits.expand(draws, -1).contiguous(), torch.full((draws,), temperature), torch.full((draws,), -math.inf),
        torch.full((draws,), -1), torch.zeros(draws, dtype=torch.int64), torch.zeros(draws, dtype=torch.int64), (5, 6))
    counts = torch.bincount(tokens, minlength=5).double()
    chi2 = ((counts - draws * probs.double()) ** 2 / (draws * probs.double())).sum().item()
    assert chi2 < 20.0, (counts, probs)  # 4 degrees of freedom: p < 0.001


def test_threshold_filters_tokens():
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0]] * 200, device=DEVICE)
    n = logits.shape[0]
    tokens, _, _ = kernels.sample_tokens(
        logits, torch.full((n,), 50.0, device=DEVICE), torch.full((n,), 2.9, device=DEVICE),
        torch.arange(n, device=DEVICE), torch.zeros(n, dtype=torch.int64, device=DEVICE),
        torch.zeros(n, dtype=torch.int64, device=DEVICE), (0, 0))
    assert set(tokens.tolist()) == {0, 1}


@gpu_test
@pytest.mark.parametrize("num_rows,vocab", [(256, 128256), (7, 49152)])
def test_kernel_matches_reference_at_model_sizes(num_rows, vocab):
    tokens, ref_tokens = _check_against_reference(_batch(num_rows, vocab, seed=num_rows), (11, 22))
    assert (tokens == ref_tokens).float().mean() > 0.95
