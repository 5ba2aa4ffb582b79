"""Rotary position embedding (RoPE), rotate-half ("neox") layout as in HF Llama.

The cos/sin table is computed once in float32 for every position up to
``max_position_embeddings`` and indexed by each token's position, so a flattened batch of
prefill chunks and decode tokens at arbitrary positions costs one gather per step. Each layer
then rotates its query and key heads in one call (one fused kernel on CUDA).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.layers.ops import ops_for


def _inverse_frequencies(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None, max_position: int
) -> torch.Tensor:
    """Return ``[head_dim // 2]`` float32 inverse frequencies, scaled as ``rope_scaling`` says.

    Raises:
        ValueError: ``rope_scaling`` names a type other than ``linear`` or ``llama3``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    factor = rope_scaling.get("factor", 1.0)
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_context = rope_scaling.get("original_max_position_embeddings", max_position)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (use 'linear' or 'llama3')")


class RotaryEmbedding(nn.Module):
    """The RoPE table of a model; gives each step's ``(cos, sin)`` for :func:`apply_rotary_emb`.

    Args:
        head_dim: rotary dimension (the whole head).
        max_position: positions ``0 .. max_position - 1`` are valid.
        theta: RoPE base.
        rope_scaling: ``None`` or an HF rope-scaling dict (``linear`` or ``llama3``).

    Raises:
        ValueError: unsupported ``rope_scaling`` type.

    The table is the non-persistent float32 buffer ``cos_sin_cache`` ``[max_position, head_dim]``
    (cos in the first half, sin in the second), built on the default device. A model built on
    the meta device calls :meth:`build_cache` once its parameters are materialised.
    """

    def __init__(
        self, head_dim: int, max_position: int, theta: float, rope_scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.rope_scaling = rope_scaling
        device = torch.get_default_device()
        # On the meta device only the shape: computing it there imported torch._dynamo (2-3 s).
        table = torch.empty(max_position, head_dim) if device.type == "meta" else self._table(device)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def _table(self, device: torch.device) -> torch.Tensor:
        inv_freq = _inverse_frequencies(self.head_dim, self.theta, self.rope_scaling, self.max_position)
        positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]  # [max_position, head_dim // 2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def build_cache(self, device: torch.device | str) -> None:
        """Recompute ``cos_sin_cache`` on ``device`` (after ``to_empty`` left it uninitialised)."""
        self.cos_sin_cache = self._table(torch.device(device))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Look up ``(cos, sin)``, each ``[T, 1, head_dim // 2]`` in ``dtype``, for ``positions``
        ``[T]`` int64 (each ``< max_position``): once per step, shared by every layer."""
        cos_sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1)
        return cos_sin.chunk(2, dim=-1)


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query heads ``q`` ``[T, Hq, head_dim]`` and key heads ``k`` ``[T, Hkv, head_dim]`` by
    ``cos``/``sin`` ``[T, 1, head_dim // 2]``.

    Rotate-half RoPE, ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` without the cats;
    returns new tensors in the inputs' dtype (:func:`kernels.reference.rotary_embedding`, or the
    fused Triton kernel on CUDA).
    """
    return ops_for(q.device).rotary_embedding(q, k, cos, sin)
