"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.ops import ops_for


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension.

    Args:
        size: the normalised (last) dimension.
        eps: added to the mean square.

    On CPU, ``F.rms_norm`` (one fused op, faster than HF's composite formula) reduces in
    float32: identical to HF in float32; in half precision it rounds once after the weight
    multiply where HF rounds twice, so results may differ from HF's by one ulp. On CUDA one
    Triton kernel (:func:`kernels.rms_norm`) does the residual add and the norm.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` ``[..., size]``.

        With ``residual`` (same shape), first forms ``x + residual`` and returns
        ``(norm(x + residual), x + residual)``: the pre-norm decoder's add-then-norm in one call.
        """
        return ops_for(x.device).rms_norm(x, self.weight, self.eps, residual)
