"""The KV cache memory: one block-major tensor per worker.

Layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (docs/architecture.md, "KV cache
layout"): one physical block holds K and V of ``block_size`` tokens for every layer in one
contiguous span of bytes, which makes a block the unit of transfer, hashing and freeing.
Kernels see per-layer strided views ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch

from engine.model_config import ModelConfig


class KVCache:
    """Owns the KV cache tensor of one worker.

    Args:
        config: the model (layers, KV heads, head_dim).
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        dtype: cache dtype.
        device: where the cache lives.

    The tensor is zero-filled so that never-written slots hold finite values (masked
    attention multiplies them by zero, and 0 * NaN would poison the output).
    """

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = config.num_hidden_layers
        self.tensor = torch.zeros(
            num_blocks, config.num_hidden_layers, 2, block_size,
            config.num_key_value_heads, config.head_dim, dtype=dtype, device=device,
        )

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block: all layers' K and V for ``block_size`` tokens."""
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return layer ``index``'s ``(k_cache, v_cache)`` views, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` (block stride = one whole block)."""
        return self.tensor[:, index, 0], self.tensor[:, index, 1]

    def block(self, block_id: int) -> torch.Tensor:
        """Return block ``block_id``: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``, contiguous."""
        return self.tensor[block_id]
