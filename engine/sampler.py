"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors on the logits' device.

    Attributes:
        temperature: ``[n]`` float32; rows with 0 are greedy.
        top_p: ``[n]`` float32 in (0, 1].
        top_k: ``[n]`` int64; -1 disables.
        min_p: ``[n]`` float32 in [0, 1].
        generators: per row, the request's ``torch.Generator`` or ``None`` (shared randomness).
        max_logprobs: the largest ``logprobs`` of any row (host int).
        all_greedy: host bool, every row greedy (skips the random path entirely).
        needs_filter: host bool, some random row uses top-k, top-p or min-p.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    generators: list[torch.Generator | None]
    max_logprobs: int
    all_greedy: bool
    needs_filter: bool


@dataclass
class SamplerOutput:
    """Sampled tokens and their log-probabilities under the model's (untempered) distribution.

    Attributes:
        token_ids: ``[n]`` int64.
        logprobs: ``[n]`` float32, log-probability of each sampled token.
        top_ids, top_logprobs: ``[n, max_logprobs]`` (``None`` when no row asked).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask logits outside each row's top-k, top-p nucleus (Holtzman et al., 2020) and min-p
    threshold with -inf. ``logits``: ``[n, vocab]`` float32, already divided by temperature."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    top_k = torch.where(batch.top_k > 0, batch.top_k, vocab)
    drop = ranks[None, :] >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass before it is below top_p: the top token always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= batch.top_p[:, None]
    drop |= probs < batch.min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential(rows: int, vocab: int, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` Exp(1) noise; a seeded row draws only from its own generator, so its
    samples do not depend on its batch mates."""
    noise = torch.empty(rows, vocab, device=device)
    noise.exponential_()
    for row, gen in enumerate(batch.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return noise


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick one token per row.

    Random rows use the exponential race (Gumbel-max in another form): ``argmax(p / E)`` with
    ``E ~ Exp(1)`` samples from ``p`` without a cumulative-sum search, batch-wide in one pass.

    Args:
        logits: ``[n, vocab]`` float32.
        batch: the rows' settings.

    Returns:
        The sampled tokens and log-probabilities.
    """
    logprobs_all = logits.log_softmax(dim=-1)
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        token_ids = greedy_ids
    else:
        temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
        scaled = logits / temperature[:, None]
        if batch.needs_filter:
            scaled = _filter(scaled, batch)
        probs = scaled.softmax(dim=-1)
        noise = _exponential(*logits.shape, batch, logits.device)
        random_ids = (probs / noise).argmax(dim=-1)
        token_ids = torch.where(batch.temperature > 0, random_ids, greedy_ids)
    token_logprobs = logprobs_all.gather(-1, token_ids[:, None]).squeeze(-1)
    top_ids = top_logprobs = None
    if batch.max_logprobs:
        top_logprobs, top_ids = logprobs_all.topk(batch.max_logprobs, dim=-1)
    return SamplerOutput(token_ids, token_logprobs, top_ids, top_logprobs)
