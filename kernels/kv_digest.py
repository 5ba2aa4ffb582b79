"""KV block digests: one 64-bit digest and a non-finite count per (block, KV head) span, on the device.

The digest of a span of 32-bit words ``w_0 .. w_{m-1}`` (the span's bytes, little-endian,
read as signed int32) is ``sum_i w_i * (2 i + 1) mod 2**64``: a position-weighted sum with odd
weights, which integer addition makes independent of the order the words are summed in, so a
span is cut into pieces summed by separate programs and added with atomics. The odds it misses
corruption are in docs/architecture.md ("End-to-end KV digests"). The non-finite count
reads the same words as elements of the KV dtype (NaN or infinity: every exponent bit set).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device
from kernels.reference import NONFINITE_BITS, digest_words

__all__ = ["kv_digests"]

# Tuned on an H200 (Llama-3-8B blocks, 256 KiB a head): 2048-word steps, 8 warps and pieces of
# 64Ki words (a whole head of such a block) read 3.9 TB/s at 2048 blocks and 2.4 at 256, against
# 3.3 and 2.1 with 1024-word steps in pieces of 16Ki words.
_BLOCK = 2048  # words one program step loads
_SPLIT_WORDS = 32 * _BLOCK  # words of a span one program sums, at most
_NUM_WARPS = 8


@triton.jit
def _kv_digest_kernel(
    words_ptr, block_ids_ptr, digest_ptr, nonfinite_ptr,
    stride_block, stride_head, num_heads, num_words,
    ELEM_BITS: tl.constexpr, NONFINITE_MASK: tl.constexpr, BLOCK: tl.constexpr, SPLIT_WORDS: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.program_id(2).to(tl.int64) * SPLIT_WORDS
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    span = words_ptr + block * stride_block + head * stride_head
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, SPLIT_WORDS, BLOCK):
        offs = first + start + tl.arange(0, BLOCK)
        mask = offs < num_words
        w = tl.load(span + offs, mask=mask, other=0)
        acc += w.to(tl.int64) * (2 * offs + 1)  # wraps mod 2**64
        for e in tl.static_range(32 // ELEM_BITS):
            bits = (w >> (e * ELEM_BITS)) & NONFINITE_MASK
            bad += ((bits == NONFINITE_MASK) & mask).to(tl.int32)
    out = i * num_heads + head
    tl.atomic_add(digest_ptr + out, tl.sum(acc, 0))
    tl.atomic_add(nonfinite_ptr + out, tl.sum(bad, 0))


def kv_digests(blocks: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Digest and non-finite count of each KV head's span of blocks ``block_ids`` (Triton).

    Args:
        blocks: ``[num_blocks, num_heads, *rest]`` of a KV dtype (float32, float16, bfloat16,
            float8_e4m3fn, float8_e5m2), ``rest`` contiguous (one head of one block is one
            span of bytes, a multiple of 4 long); the strides of the first two dimensions are
            free (multiples of 4 bytes), e.g. a KV pool's rank tensor.
        block_ids: ``[k]`` int64, on ``blocks``' device.

    Returns:
        ``(digests, nonfinite)``: ``[k, num_heads]`` int64 (the digest of module docstring, as
        a two's-complement int64) and int32 (elements that are NaN or infinite), on the device.

    Raises:
        ValueError: a dtype or a layout the digest does not read (see ``blocks``).
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    check_device(blocks, block_ids)
    words = digest_words(blocks)
    elem_bits, mask = NONFINITE_BITS[blocks.dtype]
    k, num_heads, num_words = block_ids.shape[0], words.shape[1], words.shape[2]
    digests = torch.zeros(k, num_heads, dtype=torch.int64, device=blocks.device)
    nonfinite = torch.zeros(k, num_heads, dtype=torch.int32, device=blocks.device)
    if k == 0:
        return digests, nonfinite
    _kv_digest_kernel[(k, num_heads, triton.cdiv(num_words, _SPLIT_WORDS))](
        words, block_ids, digests, nonfinite, words.stride(0), words.stride(1), num_heads, num_words,
        ELEM_BITS=elem_bits, NONFINITE_MASK=mask, BLOCK=_BLOCK, SPLIT_WORDS=_SPLIT_WORDS,
        num_warps=_NUM_WARPS if blocks.device.type == "cuda" else 1,
    )
    return digests, nonfinite
