"""Gated activation of the fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``[..., 2 * d]`` (gate then up) -> ``silu(gate) * up`` ``[..., d]``, same dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
