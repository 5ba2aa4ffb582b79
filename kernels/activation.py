"""SwiGLU's gated activation ``silu(gate) * up`` over the fused gate/up projection: one launch
instead of a chunk, a SiLU and a multiply."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import cdiv, check_device

__all__ = ["silu_and_mul"]


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer, 2020): ``[num_tokens, 2 * d]`` (gate then up) -> ``silu(gate) * up``
    ``[num_tokens, d]`` in x's dtype, computed in float32 and rounded once (Triton).

    Raises:
        ValueError: x is not 2-D with an even, contiguous last dimension.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    device = check_device(x)
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * d] with a contiguous last dimension, got {tuple(x.shape)}")
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=device)
    if num_tokens:
        block = 1024 if device.type == "cuda" else 128
        _silu_and_mul_kernel[(num_tokens, cdiv(d, block))](
            x, out, x.stride(0), out.stride(0), d, BLOCK=block, num_warps=4 if device.type == "cuda" else 1,
        )
    return out
