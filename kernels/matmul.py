"""A batch-invariant matmul: ``x @ W^T`` whose every output row is computed the same way,
whatever else shares the call.

cuBLAS (``torch.nn.functional.linear``) picks its kernel, tile shape and split-K by the
problem's M, so a row's rounding changes with how many rows come with it: a decode step of one
sequence and the verification of its eight drafts (nine rows) round differently, and in
bfloat16 a greedy near-tie can then flip (Horace He and Thinking Machines Lab, "Defeating
Nondeterminism in LLM Inference", 2025: batch invariance, kernel by kernel, is the cure; vLLM's
and SGLang's deterministic modes do the same). Here the tile shape, the order of the K loop, the
warp count and the stages are constants, and there is no split-K: an output element is the same
instructions over the same bytes at every M. Slower than cuBLAS (no per-shape tuning; programs =
tiles of M x tiles of N), so it serves ``EngineConfig.batch_invariant``, not the default path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import cdiv, check_device, dot_inputs

__all__ = ["matmul"]

# The one tile config (an H200's wgmma takes 64-row tiles; the interpreter any): never chosen
# per shape, or a row's result would depend on the batch again.
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 64, 64, 4, 3


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
                    mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :],
                    mask=(offs_n[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight^T + bias``, accumulated in float32, every row computed alike at any M (Triton).

    Args:
        x: ``[M, K]`` float32, float16 or bfloat16, rows contiguous (a row stride of its own).
        weight: ``[N, K]`` (a linear layer's), x's dtype, rows contiguous.
        bias: optional ``[N]``, added in float32 before the one rounding.
        out_dtype: the result's dtype; default x's.

    Returns:
        ``[M, N]``, a new tensor.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    device = check_device(x, weight) if bias is None else check_device(x, weight, bias)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    if x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x and weight must share a float32, float16 or bfloat16 dtype, got {x.dtype} and "
                         f"{weight.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [N] = [{weight.shape[0]}]")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must have contiguous rows (stride 1 along K)")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=device)
    if m and n:
        dot_dtype, precision = dot_inputs(x.dtype, x.dtype, device)
        _matmul_kernel[(cdiv(m, BLOCK_M), cdiv(n, BLOCK_N))](
            x, weight, bias if bias is not None else x, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
    return out
