"""Rotary position embedding (RoFormer, Su et al., 2021), rotate-half layout, applied to the
query and key heads of a step in one launch instead of a dozen slicing and arithmetic ops."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device

__all__ = ["rotary_embedding"]


@triton.jit
def _rotate(src, dst, stride_sh, stride_dh, cos, sin, offs_h, offs_d, mask, HALF: tl.constexpr):
    x1 = tl.load(src + offs_h * stride_sh + offs_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + offs_h * stride_sh + HALF + offs_d, mask=mask, other=0.0).to(tl.float32)
    ty = dst.dtype.element_ty
    tl.store(dst + offs_h * stride_dh + offs_d, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + offs_h * stride_dh + HALF + offs_d, (x2 * cos + x1 * sin).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_ct, stride_st,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + token * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate(q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh, stride_qoh, cos, sin,
            offs_h, offs_d, (offs_h < NUM_Q_HEADS) & d_mask, HALF)
    _rotate(k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_kh, stride_koh, cos, sin,
            offs_h, offs_d, (offs_h < NUM_KV_HEADS) & d_mask, HALF)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key heads by their tokens' angles (Triton), in float32, rounded once.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``, any strides but a contiguous last dimension
            (e.g. a view of the fused QKV projection).
        k: ``[num_tokens, num_kv_heads, head_dim]``, likewise.
        cos, sin: ``[num_tokens, 1, head_dim // 2]`` (from ``RotaryEmbedding``), contiguous last
            dimension, any float dtype.

    Returns:
        New contiguous ``(q, k)``, rotated: ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``.

    Raises:
        ValueError: shapes that do not fit together.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    device = check_device(q, k, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    if (k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2
            or cos.shape != (num_tokens, 1, half) or sin.shape != cos.shape
            or q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(2) != 1 or sin.stride(2) != 1):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} "
                         "do not fit (last dimensions must be contiguous)")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=device)
    if num_tokens:
        block_h = triton.next_power_of_2(max(num_q_heads, k.shape[1]))
        block_half = triton.next_power_of_2(half)
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), sin.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=k.shape[1], HALF=half,
            BLOCK_H=block_h, BLOCK_HALF=block_half,
            num_warps=max(1, min(8, block_h * block_half // 512)) if device.type == "cuda" else 1,
        )
    return q_out, k_out
