"""Token sampling in one pass over the logits: greedy, and the exponential race with counter-based noise.

One program per row streams the row's logits once and keeps three running reductions: the
argmax (greedy), the log-sum-exp (the sampled token's log-probability under the untempered
distribution), and for random rows the race ``argmax(logit / T + g)`` over the tokens that pass
the row's filter threshold, where ``g = -log(-log u)`` is Gumbel noise: the Gumbel-max trick,
equal to the exponential race ``argmax(p / E)`` with ``E = -log u``.

The uniform ``u`` of token ``t`` is a hash, not a generator's state (a counter-based generator,
as Philox is in Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): the row
key is a chain of MurmurHash3 ``fmix32`` finalizers (Appleby, SMHasher; bijective, full
avalanche) over the words ``(seed_lo, seed_hi, sample_index, position)``, and token ``t`` gets
``fmix32((fmix32(key1 ^ t) + key1) ^ key2)`` with ``key2 = fmix32(key1 ^ GOLDEN)``. A seeded
request's noise therefore depends only on its seed, which sample it is and the position of the
token being sampled: the same in any batch, graph or eager step, worker, process or GPU.
:func:`kernels.reference.sample_tokens` computes the same bits with int64 tensor arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device

__all__ = ["sample_tokens"]

GOLDEN = tl.constexpr(0x9E3779B9)  # 2^32 / golden ratio: the chain's starting value (a constexpr: kernels read no other globals)


@triton.jit
def _fmix32(h):
    """MurmurHash3's 32-bit finalizer on uint32 values."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


# The step seed changes every step: no value specialization; the per-row settings are rows of the
# caller's packed arrays, whose alignment moves with the batch size: no alignment specialization.
# So the compiled variants are the two values of RANDOM.
@triton.jit(do_not_specialize=["step_seed_lo", "step_seed_hi"],
            do_not_specialize_on_alignment=["temperature_ptr", "threshold_ptr", "seeds_ptr", "sample_indices_ptr",
                                            "positions_ptr"])
def _sample_kernel(
    logits_ptr, stride_row, temperature_ptr, threshold_ptr, seeds_ptr, sample_indices_ptr,
    positions_ptr, token_ids_ptr, logprobs_ptr, lse_ptr, step_seed_lo, step_seed_hi, vocab_size,
    RANDOM: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)  # running max
    s = tl.zeros([], tl.float32)  # running sum of exp(x - m)
    best = tl.zeros([], tl.int32)  # running argmax
    if RANDOM:
        temperature = tl.load(temperature_ptr + row)
        inv_t = 1.0 / tl.where(temperature > 0, temperature, 1.0)
        threshold = tl.load(threshold_ptr + row)
        seed = tl.load(seeds_ptr + row)
        unseeded = seed < 0
        seed_lo = tl.where(unseeded, step_seed_lo.to(tl.uint32), seed.to(tl.uint32))
        seed_hi = tl.where(unseeded, step_seed_hi.to(tl.uint32), (seed >> 32).to(tl.uint32))
        # An unseeded row is told apart from its batch mates by its row.
        index = tl.where(unseeded, row, tl.load(sample_indices_ptr + row).to(tl.int32)).to(tl.uint32)
        position = tl.load(positions_ptr + row).to(tl.uint32)
        key1 = _fmix32(tl.full([], GOLDEN, tl.uint32) ^ seed_lo)
        key1 = _fmix32(key1 ^ seed_hi)
        key1 = _fmix32(key1 ^ index)
        key1 = _fmix32(key1 ^ position)
        key2 = _fmix32(key1 ^ GOLDEN)
        race = tl.full([], float("-inf"), tl.float32)
        race_best = tl.zeros([], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        tokens = start + offs
        in_vocab = tokens < vocab_size
        x = tl.load(base + tokens, mask=in_vocab, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, 0)
        best = tl.where(chunk_max > m, start + tl.argmax(x, 0), best)
        m_new = tl.maximum(m, chunk_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        if RANDOM:
            bits = _fmix32((_fmix32(key1 ^ tokens.to(tl.uint32)) + key1) ^ key2)
            # An odd 24-bit integer over 2^24: exactly representable, strictly inside (0, 1).
            u = ((bits >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
            key = x * inv_t - tl.log(-tl.log(u))
            key = tl.where(in_vocab & (x >= threshold), key, float("-inf"))
            chunk_race = tl.max(key, 0)
            race_best = tl.where(chunk_race > race, start + tl.argmax(key, 0), race_best)
            race = tl.maximum(race, chunk_race)
    token = best
    if RANDOM:
        token = tl.where(temperature > 0, race_best, best)
    lse = m + tl.log(s)
    chosen = tl.load(base + token).to(tl.float32)
    tl.store(token_ids_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - lse)
    tl.store(lse_ptr + row, lse)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    thresholds: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
    positions: torch.Tensor,
    step_seed: tuple[int, int],
    random: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row in one pass over the logits (Triton).

    Args:
        logits: ``[n, vocab]`` float32 (last dimension contiguous).
        temperature: ``[n]`` float32; rows with 0 take the argmax.
        thresholds: ``[n]`` float32; a random row draws only among tokens whose logit is at least
            its threshold (``-inf``: no filter; see ``engine.runner.sampler.filter_thresholds``).
        seeds: ``[n]`` int64 request seed in ``[0, 2^63)``, or -1 for an unseeded row.
        sample_indices: ``[n]`` int64, which of its request's samples each row is.
        positions: ``[n]`` int64 position (in its sequence) of the token being sampled.
        step_seed: two ints in ``[0, 2^31)`` that stand in for the seed of unseeded rows, which
            also hash their row number instead of their sample index.
        random: False when every row is greedy (the noise is then never computed).

    Returns:
        ``(token_ids [n] int64, logprobs [n] float32, lse [n] float32)``: the sampled tokens, their
        log-probabilities under the untempered distribution, and each row's log-sum-exp.

    Raises:
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    device = check_device(logits, temperature, thresholds, seeds, sample_indices, positions)
    num_rows, vocab_size = logits.shape
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    lse = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows == 0:
        return token_ids, logprobs, lse
    on_gpu = device.type == "cuda"
    _sample_kernel[(num_rows,)](
        logits, logits.stride(0), temperature, thresholds, seeds, sample_indices, positions,
        token_ids, logprobs, lse, step_seed[0], step_seed[1], vocab_size,
        RANDOM=random, BLOCK_V=2048 if on_gpu else 256, num_warps=8 if on_gpu else 1,
    )
    return token_ids, logprobs, lse
