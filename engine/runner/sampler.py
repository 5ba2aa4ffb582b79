"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

One call of :func:`kernels.sample_tokens` (Triton on CUDA, :mod:`kernels.reference` elsewhere)
samples every row: the argmax for greedy rows, the Gumbel-max race for random rows, with noise
hashed from (seed, sample index, position, token) instead of drawn from a generator. A seeded
request's samples therefore depend on nothing but its own seed and tokens: not on its batch
mates, not on whether the step ran from a CUDA graph, not on which worker or process computes
it (a decode worker continuing a request samples position ``p`` exactly as the engine that
prefilled it would have). Unseeded rows hash a fresh per-step seed from the engine's generator.
Top-k / top-p / min-p become one threshold per row on the logits (below). Before both, the
rows that ask for it have their logits processed (structured output, bad words, ``min_tokens``,
``logit_bias``, penalties: :mod:`engine.runner.logits_processors`); log-probabilities stay the
model's, computed from the logits as they came.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.core.sequence import Sequence
from engine.layers.ops import ops_for
from engine.runner.logits_processors import LogitsBatch

# Seeds are hashed as two 32-bit words of an int64; larger ones are taken modulo 2^63.
_SEED_MODULUS = 1 << 63


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors on the logits' device.

    Attributes:
        temperature: ``[n]`` float32; rows with 0 are greedy.
        top_p: ``[n]`` float32 in (0, 1].
        top_k: ``[n]`` int64; -1 disables.
        min_p: ``[n]`` float32 in [0, 1].
        seeds: ``[n]`` int64 request seed modulo 2^63, -1 for unseeded rows.
        sample_indices: ``[n]`` int64, which of its request's samples each row is.
        positions: ``[n]`` int64 position (in its sequence) of the token being sampled.
        max_logprobs: the largest ``logprobs`` of any row (host int).
        all_greedy: host bool, every row greedy (the kernel then skips the noise).
        filter_rows: ``[k]`` int64 rows that are random and use top-k, top-p or min-p, or
            ``None`` when there are none.
        processing: the rows' logit processing, or ``None`` when no row has any.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    sample_indices: torch.Tensor
    positions: torch.Tensor
    max_logprobs: int
    all_greedy: bool
    filter_rows: torch.Tensor | None
    processing: LogitsBatch | None = None

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], positions: torch.Tensor,
                       processing: LogitsBatch | None = None) -> SamplingBatch:
        """Gather the settings of ``seqs`` (one row each) into one host array and copy it to
        ``positions``' device at once (every copy is a call that gives up the GIL and has to win
        it back; see :mod:`engine.runner.input_buffers`).

        Args:
            seqs: the sampled sequences, in row order.
            positions: ``[len(seqs)]`` int64 on the device, the positions being sampled.
            processing: the rows' logit processing (``LogitsProcessors.batch``).
        """
        params = [s.params for s in seqs]
        n = len(seqs)
        filtered = [i for i, p in enumerate(params)
                    if not p.greedy and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0)]
        ints = np.array([*(p.top_k for p in params),
                         *(-1 if p.seed is None else p.seed % _SEED_MODULUS for p in params),
                         *(s.index for s in seqs), *filtered], dtype=np.int64)
        floats = np.array([[p.temperature for p in params], [p.top_p for p in params],
                           [p.min_p for p in params]], dtype=np.float32).reshape(3, n)
        host = np.concatenate([ints.view(np.uint8), floats.view(np.uint8).ravel()])  # int64s first: aligned
        device = torch.from_numpy(host).to(positions.device, non_blocking=True)
        ints_d = device[:ints.nbytes].view(torch.int64)
        floats_d = device[ints.nbytes:].view(torch.float32).view(3, n)
        return cls(
            temperature=floats_d[0], top_p=floats_d[1], min_p=floats_d[2],
            top_k=ints_d[:n], seeds=ints_d[n:2 * n], sample_indices=ints_d[2 * n:3 * n], positions=positions,
            max_logprobs=max(p.logprobs for p in params),
            all_greedy=all(p.greedy for p in params),
            filter_rows=ints_d[3 * n:] if filtered else None, processing=processing,
        )


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


def filter_thresholds(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Per row, the smallest raw logit a random row may still sample (``-inf``: no filter).

    Each of top-k, top-p (Holtzman et al., 2020: keep a token while the tempered probability
    mass before it is below ``top_p``, so the top token always survives) and min-p (keep tokens
    whose probability is at least ``min_p`` times the top one) keeps a prefix of the tokens
    sorted by logit, so their intersection is one prefix too; its last logit is the threshold.
    Tokens tied with it are kept as well. Only the rows in ``batch.filter_rows`` are sorted.

    Args:
        logits: ``[n, vocab]`` float32.
        batch: the rows' settings.

    Returns:
        ``[n]`` float32.
    """
    thresholds = torch.full((logits.shape[0],), float("-inf"), device=logits.device)
    rows = batch.filter_rows
    if rows is None:
        return thresholds
    sorted_logits = logits.index_select(0, rows).sort(dim=-1, descending=True).values
    vocab = logits.shape[1]
    probs = (sorted_logits / batch.temperature[rows, None]).softmax(dim=-1)
    top_k = batch.top_k[rows]
    ranks = torch.arange(vocab, device=logits.device)
    keep = ranks[None, :] < torch.where(top_k > 0, top_k, vocab)[:, None]
    keep &= probs.cumsum(dim=-1) - probs < batch.top_p[rows, None]
    keep &= probs >= batch.min_p[rows, None] * probs[:, :1]
    last = keep.sum(dim=-1, keepdim=True) - 1  # >= 0: the top token passes all three
    thresholds[rows] = sorted_logits.gather(1, last).squeeze(1)
    return thresholds


def sample(logits: torch.Tensor, batch: SamplingBatch, step_seed: tuple[int, int],
           bitmask: torch.Tensor | None = None) -> SamplerOutput:
    """Pick one token per row (the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``, in its
    Gumbel-max form ``argmax(log p + g)``, for random rows), after the rows' logit processing.

    Args:
        logits: ``[n, vocab]`` float32; the processed rows are changed in place.
        batch: the rows' settings.
        step_seed: two ints in ``[0, 2^31)``, the seed of this step's unseeded rows.
        bitmask: the structured rows' token bitmask on the device
            (``LogitsProcessors.fill_bitmask``), ``None`` without any.

    Returns:
        The sampled tokens and their log-probabilities under the model's logits (before any
        processing, as the rows without processing have them).
    """
    processing = batch.processing
    if processing is not None:
        model_lse, raw = processing.apply(logits, batch.positions, bitmask, keep_rows=batch.max_logprobs > 0)
    thresholds = filter_thresholds(logits, batch)
    token_ids, logprobs, lse = ops_for(logits.device).sample_tokens(
        logits, batch.temperature, thresholds, batch.seeds, batch.sample_indices, batch.positions, step_seed,
        random=not batch.all_greedy,
    )
    model_logits = logits
    if processing is not None:
        rows = processing.rows
        sampled = token_ids.index_select(0, rows)
        # A mask or a ban never takes the sampled token: its logit is the model's but for a bias
        # or a penalty, whose rows ``apply`` returned as they came.
        chosen = (raw.gather(1, sampled[:, None]).squeeze(1) if raw is not None else logits[rows, sampled])
        logprobs = logprobs.index_copy(0, rows, chosen - model_lse)
        if batch.max_logprobs:
            lse = lse.index_copy(0, rows, model_lse)
            model_logits = logits.index_copy(0, rows, raw)
    top_ids = top_logprobs = None
    if batch.max_logprobs:
        values, top_ids = model_logits.topk(batch.max_logprobs, dim=-1)
        top_logprobs = values - lse[:, None]
    return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs)
