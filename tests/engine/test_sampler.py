"""The batched sampler: filters as thresholds, seeds that make rows independent of their batch."""

import math

import torch

from engine.runner.sampler import SamplingBatch, filter_thresholds, sample
from engine.sampling_params import SamplingParams
from engine.core.sequence import Sequence


def _batch(params: list[SamplingParams], positions: list[int], indices: list[int] | None = None) -> SamplingBatch:
    seqs = [Sequence(f"r{i}", (indices or [0] * len(params))[i], [1], 1, p, 0) for i, p in enumerate(params)]
    return SamplingBatch.from_sequences(seqs, torch.tensor(positions, dtype=torch.int64))


def _kept_by_masks(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens the top-k / top-p / min-p definitions keep, by sorting one row."""
    probs = (logits / p.temperature).softmax(-1)
    order = probs.argsort(descending=True)
    kept, mass = set(), 0.0
    for rank, token in enumerate(order.tolist()):
        if (p.top_k > 0 and rank >= p.top_k) or mass >= p.top_p or probs[token] < p.min_p * probs[order[0]]:
            break
        kept.add(token)
        mass += probs[token].item()
    return kept


def test_thresholds_keep_exactly_the_filtered_tokens():
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=1.3, top_p=0.7),
              SamplingParams(temperature=0.5, min_p=0.2), SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0, top_k=3)]
    logits = torch.randn(len(params), 300, generator=gen) * 2
    batch = _batch(params, [0] * len(params))
    thresholds = filter_thresholds(logits, batch)
    for row, p in enumerate(params):
        kept = set(torch.nonzero(logits[row] >= thresholds[row]).squeeze(1).tolist())
        if p.greedy or (p.top_k < 0 and p.top_p == 1 and p.min_p == 0):
            assert thresholds[row] == -math.inf
        else:
            assert kept == _kept_by_masks(logits[row], p), row


def test_seeded_row_ignores_batch_mates_and_row():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 1000, generator=gen)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[2:3], _batch([seeded], [17]), (1, 2)).token_ids
    mates = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), seeded, SamplingParams(top_k=3)]
    batched = sample(logits, _batch(mates, [5, 9, 17, 3]), (3, 4)).token_ids
    assert batched[2] == alone[0]


def test_seeded_draws_move_with_position_and_sample_index():
    logits = torch.zeros(64, 5000)  # uniform: every token as likely
    seeded = [SamplingParams(temperature=1.0, seed=7)] * 64
    by_position = sample(logits, _batch(seeded, list(range(64))), (0, 0)).token_ids
    by_index = sample(logits, _batch(seeded, [3] * 64, list(range(64))), (0, 0)).token_ids
    assert len(set(by_position.tolist())) > 50 and len(set(by_index.tolist())) > 50


def test_unseeded_rows_differ_within_a_step_and_across_steps():
    logits = torch.zeros(32, 5000)
    batch = _batch([SamplingParams(temperature=1.0)] * 32, [8] * 32)
    first = sample(logits, batch, (10, 20)).token_ids
    again = sample(logits, batch, (11, 20)).token_ids
    assert len(set(first.tolist())) > 25
    assert (first != again).float().mean() > 0.9


def test_logprobs_are_untempered_and_top_n_matches():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 50, generator=gen)
    params = [SamplingParams(temperature=0, logprobs=4), SamplingParams(temperature=2.0, seed=1, logprobs=2),
              SamplingParams(temperature=0.5)]
    out = sample(logits, _batch(params, [1, 2, 3]), (0, 0))
    reference = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (3, 4)
    torch.testing.assert_close(out.top_logprobs, reference.topk(4, dim=-1).values)
    assert out.token_ids[0] == logits[0].argmax()
