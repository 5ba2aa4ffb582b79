"""Rotary position embedding (RoFormer, Su et al., 2021), rotate-half layout, applied to the
query and key heads of a step in one launch instead of a dozen slicing and arithmetic ops; and
fused with the KV cache write (the rotated keys go straight to their slots, one launch a layer
fewer: an eager step is bound by its launches, docs/engine.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import KernelLaunch, check_cache, check_device, next_power_of_2
from kernels.cache_write import saturate_at, store_heads

__all__ = ["RotaryWriteKVLaunch", "rotary_embedding", "rotary_write_kv_cache"]


@triton.jit
def _rotated_halves(src, stride_h, cos, sin, offs_h, offs_d, mask, HALF: tl.constexpr):
    x1 = tl.load(src + offs_h * stride_h + offs_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + offs_h * stride_h + HALF + offs_d, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotate(src, dst, stride_sh, stride_dh, cos, sin, offs_h, offs_d, mask, HALF: tl.constexpr):
    y1, y2 = _rotated_halves(src, stride_sh, cos, sin, offs_h, offs_d, mask, HALF)
    ty = dst.dtype.element_ty
    tl.store(dst + offs_h * stride_dh + offs_d, y1.to(ty), mask=mask)
    tl.store(dst + offs_h * stride_dh + HALF + offs_d, y2.to(ty), mask=mask)


@triton.jit
def _rotate_query(q_ptr, q_out_ptr, cos_ptr, sin_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh,
                  stride_ct, stride_st, NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate one token's query heads into ``q_out``; return its angles and the head and
    half-dimension offsets (with the latter's mask) for its key heads."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + token * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate(q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh, stride_qoh, cos, sin,
            offs_h, offs_d, (offs_h < NUM_Q_HEADS) & d_mask, HALF)
    return cos, sin, offs_h, offs_d, d_mask


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_ct, stride_st,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin, offs_h, offs_d, d_mask = _rotate_query(q_ptr, q_out_ptr, cos_ptr, sin_ptr, token, stride_qt, stride_qh,
                                                     stride_qot, stride_qoh, stride_ct, stride_st,
                                                     NUM_Q_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate(k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_kh, stride_koh, cos, sin,
            offs_h, offs_d, (offs_h < NUM_KV_HEADS) & d_mask, HALF)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_ct, stride_st,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, SATURATE_AT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin, offs_h, offs_d, d_mask = _rotate_query(q_ptr, q_out_ptr, cos_ptr, sin_ptr, token, stride_qt, stride_qh,
                                                     stride_qot, stride_qoh, stride_ct, stride_st,
                                                     NUM_Q_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # slot -1: padding token, nothing to write
        block = slot // PAGE
        row = slot % PAGE
        mask = (offs_h < NUM_KV_HEADS) & d_mask
        # The key is rounded to its own dtype first, as the unfused rotary's output is: the cache
        # holds the same bits either way.
        k1, k2 = _rotated_halves(k_ptr + token * stride_kt, stride_kh, cos, sin, offs_h, offs_d, mask, HALF)
        k_dst = k_cache_ptr + block * stride_kcb + row * stride_kct
        ty = k_ptr.dtype.element_ty
        store_heads(k_dst, k1.to(ty), offs_h, offs_d, mask, stride_kch, stride_kcd, SATURATE_AT)
        store_heads(k_dst + HALF * stride_kcd, k2.to(ty), offs_h, offs_d, mask, stride_kch, stride_kcd, SATURATE_AT)
        v_src = v_ptr + token * stride_vt + offs_h * stride_vh + offs_d
        v_dst = v_cache_ptr + block * stride_vcb + row * stride_vct
        store_heads(v_dst, tl.load(v_src, mask=mask), offs_h, offs_d, mask, stride_vch, stride_vcd, SATURATE_AT)
        store_heads(v_dst + HALF * stride_vcd, tl.load(v_src + HALF, mask=mask), offs_h, offs_d, mask,
                     stride_vch, stride_vcd, SATURATE_AT)


def _check_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise ValueError unless q ``[T, Hq, D]``, k ``[T, Hkv, D]`` and cos, sin ``[T, 1, D // 2]``
    fit, D even, each last dimension contiguous."""
    num_tokens, _, head_dim = q.shape
    if (k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2
            or cos.shape != (num_tokens, 1, head_dim // 2) or sin.shape != cos.shape
            or q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(2) != 1 or sin.stride(2) != 1):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} "
                         "do not fit (last dimensions must be contiguous)")


def _num_warps(device: torch.device, block_h: int, block_half: int) -> int:
    return max(1, min(8, block_h * block_half // 512)) if device.type == "cuda" else 1


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
    _check_rotary(q, k, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    q_out = torch.empty(q.shape, dtype=q.dtype, device=device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=device)
    if num_tokens:
        block_h = next_power_of_2(max(num_q_heads, k.shape[1]))
        block_half = next_power_of_2(half)
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), sin.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=k.shape[1], HALF=half,
            BLOCK_H=block_h, BLOCK_HALF=block_half,
            num_warps=_num_warps(device, block_h, block_half),
        )
    return q_out, k_out


class RotaryWriteKVLaunch:
    """:func:`rotary_write_kv_cache`'s launch for one shape, prepared once and run per call (the
    checks, the tile sizes and the integer arguments worked out here, as
    :class:`kernels.decode_attention.PagedDecodeLaunch` does for the layers of one engine step).

    Args:
        q, k, v, k_cache, v_cache, q_out: examples of what each call passes (shapes, strides,
            dtypes and device; not kept), as :func:`rotary_write_kv_cache` takes them; ``q_out``
            is where the rotated query goes, ``[num_tokens, num_q_heads, head_dim]`` in q's dtype,
            contiguous last dimension.
        cos, sin, slot_mapping: as :func:`rotary_write_kv_cache`; the same for every call.

    Raises:
        ValueError, RuntimeError: as :func:`rotary_write_kv_cache`.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 q_out: torch.Tensor) -> None:
        device = check_device(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_out)
        check_cache(k_cache, v_cache)
        _check_rotary(q, k, cos, sin)
        num_tokens, num_q_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if (v.shape != k.shape or v.stride(2) != 1 or k_cache.shape[2:] != k.shape[1:]
                or slot_mapping.shape != (num_tokens,)):
            raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} "
                             f"do not fit cache {tuple(k_cache.shape)} (v's last dimension must be contiguous)")
        if q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.stride(2) != 1:
            raise ValueError(f"q_out {tuple(q_out.shape)} {q_out.dtype} must be like q {tuple(q.shape)} {q.dtype}, "
                             "its last dimension contiguous")
        self.num_tokens = num_tokens
        block_h = next_power_of_2(max(num_q_heads, num_kv_heads))
        block_half = next_power_of_2(head_dim // 2)
        self.angles = (cos, sin)
        self.slot_mapping = slot_mapping
        self.args = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                     q_out.stride(0), q_out.stride(1), cos.stride(0), sin.stride(0),
                     *k_cache.stride(), *v_cache.stride())
        self.launch = KernelLaunch(_rotary_write_kv_kernel, (num_tokens,), dict(
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, PAGE=k_cache.shape[1],
            BLOCK_H=block_h, BLOCK_HALF=block_half, SATURATE_AT=saturate_at(k_cache.dtype),
            num_warps=_num_warps(device, block_h, block_half),
        ))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, q_out: torch.Tensor) -> None:
        """Rotate ``q`` into ``q_out`` and write the rotated ``k`` and ``v`` into the caches:
        tensors like the examples this was prepared with, unchecked."""
        if self.num_tokens:
            self.launch(q, k, v, q_out, *self.angles, k_cache, v_cache, self.slot_mapping, *self.args)


def rotary_write_kv_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """:func:`rotary_embedding` of q and k, the rotated k and v written into the paged cache as
    :func:`kernels.cache_write.write_kv_cache` writes them (the same bits), in one launch (Triton).

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``, any strides but a contiguous last dimension
            (e.g. a view of the fused QKV projection).
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, likewise.
        cos, sin: ``[num_tokens, 1, head_dim // 2]``, contiguous last dimension, any float dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides,
            float32/float16/bfloat16 or float8_e4m3fn (saturating at ±448).
        slot_mapping: ``[num_tokens]`` int64; slot = block * block_size + offset; -1 skips the token.

    Returns:
        The rotated query, a new contiguous ``[num_tokens, num_q_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: shapes that do not fit together.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    RotaryWriteKVLaunch(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_out)(q, k, v, k_cache, v_cache, q_out)
    return q_out
