"""RMSNorm (Zhang and Sennrich, 2019) with the pre-norm decoder's residual add fused in: one launch
instead of an add, a norm and their dtype casts."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, next_power_of_2

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro,
    SIZE: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < SIZE
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Rounded to the activation dtype before the norm, as the unfused ``x + residual`` is.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / SIZE + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / sqrt(mean(x**2) + eps)`` per row, in float32, rounded once (Triton).

    Args:
        x: ``[..., size]`` (one launch over all leading dimensions; a layout that cannot be
            viewed as ``[rows, size]`` rows is copied first).
        weight: ``[size]``.
        eps: added to the mean square.
        residual: optional, like ``x``: the norm is then taken of ``x + residual`` (rounded to
            x's dtype), which is returned too.

    Returns:
        ``norm(x)``, or ``(norm(x + residual), x + residual)``; new tensors in x's dtype.

    Raises:
        ValueError: shapes that do not fit together.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    tensors = (x, weight) if residual is None else (x, weight, residual)
    device = check_device(*tensors)
    size = x.shape[-1]
    if weight.shape != (size,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and residual "
                         f"{None if residual is None else tuple(residual.shape)} do not fit")
    shape = x.shape
    x = x.reshape(-1, size)
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None:
        residual = residual.reshape(-1, size).contiguous()
    num_tokens = x.shape[0]
    out = torch.empty(num_tokens, size, dtype=x.dtype, device=device)
    residual_out = torch.empty_like(out) if residual is not None else out
    if num_tokens:
        block = next_power_of_2(size)
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, residual_out, eps,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
            residual_out.stride(0),
            SIZE=size, BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=max(1, min(16, block // 512)) if device.type == "cuda" else 1,
        )
    out = out.view(shape)
    return out if residual is None else (out, residual_out.view(shape))
