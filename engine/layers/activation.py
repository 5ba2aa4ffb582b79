"""Gated activation of the fused gate/up projection."""

from __future__ import annotations

import torch

from engine.layers.ops import ops_for


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``[T, 2 * d]`` (gate then up) -> ``silu(gate) * up`` ``[T, d]``, same dtype; one
    fused kernel on CUDA."""
    return ops_for(x.device).silu_and_mul(x)
