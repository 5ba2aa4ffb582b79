"""The KV digest kernel against kernels.reference and against the digest's definition."""

from __future__ import annotations

import pytest
import torch

import kernels
import kernels.reference as reference
from tests.helpers.paged_inputs import DEVICE

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
MASK64 = (1 << 64) - 1


def random_pool(dtype: torch.dtype, num_blocks: int, num_heads: int, rest: tuple[int, ...]) -> torch.Tensor:
    """A rank's KV pool ``[num_blocks, num_heads, *rest]`` of random bit patterns (NaNs included)."""
    pool = torch.empty(num_blocks, num_heads, *rest, dtype=dtype, device=DEVICE)
    raw = pool.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=DEVICE))
    return pool


def definition(span: torch.Tensor) -> int:
    """The digest of one span, from its definition: sum of int32 words times 2i + 1, mod 2**64."""
    words = span.contiguous().view(-1).view(torch.int32).tolist()
    return sum(w * (2 * i + 1) for i, w in enumerate(words)) & MASK64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rest", [(2, 2, 4, 8), (9, 2, 32, 128)], ids=["small", "split-spans"])
def test_kernel_matches_reference_on_a_pools_head_slice(dtype: torch.dtype, rest: tuple[int, ...]) -> None:
    """On a strided view (KV heads 1..3 of a rank's pool, as a TP rank reads its slice) and
    shuffled block ids: the same digests and non-finite counts, bit for bit; the second shape's
    float32 spans (73 728 words) are summed by two programs each."""
    pool = random_pool(dtype, 9, 4, rest)
    if dtype != torch.float8_e4m3fn:  # e4m3fn has no infinity
        pool[2, 1].view(-1)[5] = float("inf")
    view = pool[:, 1:4]
    ids = torch.tensor([7, 2, 0, 5], dtype=torch.int64, device=DEVICE)
    got_digests, got_nonfinite = kernels.kv_digests(view, ids)
    want_digests, want_nonfinite = reference.kv_digests(view, ids)
    assert torch.equal(got_digests, want_digests)
    assert torch.equal(got_nonfinite, want_nonfinite)
    assert got_nonfinite[1, 0] >= (0 if dtype == torch.float8_e4m3fn else 1)
    assert (got_digests[2, 2].item() & MASK64) == definition(view[0, 2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_every_single_bit_flip_and_a_word_swap_change_the_digest(dtype: torch.dtype) -> None:
    """Any change inside one 32-bit word, and any swap of two different words, changes the
    digest (the weights are odd and distinct): checked for every bit of a small span."""
    block = random_pool(dtype, 1, 1, (2, 2, 2, 4)).nan_to_num(0.0) if dtype != torch.float8_e4m3fn \
        else random_pool(dtype, 1, 1, (2, 2, 2, 4))
    ids = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    clean = reference.kv_digests(block, ids)[0].item()
    raw = block.view(torch.uint8).view(-1)
    for bit in range(raw.numel() * 8):
        raw[bit // 8] ^= 1 << (bit % 8)
        assert reference.kv_digests(block, ids)[0].item() != clean, f"bit {bit}"
        raw[bit // 8] ^= 1 << (bit % 8)
    words = block.view(-1).view(torch.int32)
    i, j = 0, words.numel() - 1
    if words[i] != words[j]:
        words[i], words[j] = words[j].clone(), words[i].clone()
        assert kernels.kv_digests(block, ids)[0].item() != clean


def test_finite_blocks_count_no_nonfinite_and_the_count_finds_each_nan() -> None:
    pool = torch.randn(3, 2, 2, 2, 4, 8, device=DEVICE).to(torch.bfloat16)
    ids = torch.arange(3, device=DEVICE)
    assert not kernels.kv_digests(pool, ids)[1].any()
    pool[1, 0, 1, 0, 2, 3] = float("nan")
    pool[1, 0, 0, 1, 0, 0] = -float("inf")
    assert kernels.kv_digests(pool, ids)[1].tolist() == [[0, 0], [2, 0], [0, 0]]


def test_a_span_that_is_not_whole_words_is_refused() -> None:
    with pytest.raises(ValueError, match="32-bit words"):
        reference.kv_digests(torch.zeros(2, 1, 3, dtype=torch.float8_e4m3fn), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="KV digests read"):
        reference.kv_digests(torch.zeros(2, 1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
