"""KV cache write: scatter the new tokens' K and V into their PagedAttention slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_cache, check_device, next_power_of_2
from kernels.reference import FP8_E4M3_MAX

__all__ = ["write_kv_cache"]


@triton.jit
def store_heads(dst, x, offs_h, offs_d, mask, stride_h, stride_d, SATURATE_AT: tl.constexpr):
    """Store ``x`` ``[BLOCK_H, BLOCK_D]`` (one token's heads) at ``dst`` in the cache's dtype; to
    fp8 clamped in float32 first, as :func:`kernels.reference.to_cache_dtype`, never NaN."""
    if SATURATE_AT > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -SATURATE_AT), SATURATE_AT)
    tl.store(dst + offs_h * stride_h + offs_d * stride_d, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE_AT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // PAGE
    row = slot % PAGE
    if slot >= 0:  # slot -1: padding token, nothing to write
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=mask)
        store_heads(k_cache_ptr + block * stride_kcb + row * stride_kct, k, offs_h, offs_d, mask,
                     stride_kch, stride_kcd, SATURATE_AT)
        store_heads(v_cache_ptr + block * stride_vcb + row * stride_vct, v, offs_h, offs_d, mask,
                     stride_vch, stride_vcd, SATURATE_AT)


def saturate_at(cache_dtype: torch.dtype) -> float:
    """The magnitude a write into a cache of ``cache_dtype`` clamps to: fp8's largest value, else
    0 (no clamp)."""
    return FP8_E4M3_MAX if cache_dtype == torch.float8_e4m3fn else 0.0


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K and V into the paged cache, in place (Triton; PagedAttention layout).

    One program per token writes all its KV heads; a token whose slot is -1 is skipped.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any strides; cast to the cache dtype
            (to float8 e4m3 saturating at ±448, bit for bit :func:`kernels.reference.to_cache_dtype`).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides,
            float32/float16/bfloat16 or float8_e4m3fn.
        slot_mapping: ``[num_tokens]`` int64; slot = block * block_size + offset; -1 skips the token.

    Raises:
        ValueError: shapes that do not fit together.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    check_device(key, value, k_cache, v_cache, slot_mapping)
    check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != key.shape[1:] or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)}, slot_mapping {tuple(slot_mapping.shape)} "
            f"do not fit cache {tuple(k_cache.shape)}"
        )
    if num_tokens == 0:
        return
    block_h = next_power_of_2(num_kv_heads)
    block_d = next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=block_d, SATURATE_AT=saturate_at(k_cache.dtype),
        num_warps=max(1, min(8, block_h * block_d // 256)) if key.device.type == "cuda" else 1,
    )
