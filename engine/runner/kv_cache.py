"""The KV cache memory: one block-major tensor per worker (per rank under tensor parallelism).

Layout ``[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]`` (docs/architecture.md,
"KV cache layout"): one physical block holds K and V of ``block_size`` tokens for every layer in
one contiguous span of bytes, which makes a block the unit of transfer, hashing and freeing. The
KV heads are the block's outermost dimension, so any range of heads is one contiguous span of it
too: a rank of a tensor-parallel worker holds its heads' slice of every block, and a KV transfer
between workers of different TP sizes moves each rank's head range of a block as one piece.
Kernels see per-layer strided views ``[num_blocks, block_size, num_kv_heads, head_dim]``.

The cache's dtype is the model's, or float8 e4m3 (``kv_cache_dtype="fp8_e4m3"``,
``torch.float8_e4m3fn``): one byte per value, half a bfloat16 block's bytes. An fp8 cache
stores K and V with one fixed per-tensor scale of 1.0 for each (vLLM's default ``k_scale`` /
``v_scale`` for a checkpoint that has none; Tandem reads none), for three reasons:

- KV bytes move between workers (a prefill worker's blocks are a decode worker's), so both
  must read them with the same scale; a constant needs no agreement, no message and no
  calibration, and cannot drift between workers or between the blocks of a prefix cache;
- e4m3's relative precision (3 mantissa bits: a rounding error of at most 2^-4, about 6%, of
  a normal value) does not depend on a scale: a scale only moves the range, and 1.0 already
  spans ±448, normal down to 2^-6 (SmolLM2-135M's K and V, measured: |x| <= 20, 1-4% of them
  below 2^-6);
- values beyond ±448 saturate to ±448 when written (a saturating cast:
  :func:`kernels.reference.to_cache_dtype`), rather than becoming NaN and poisoning attention.

Reads upcast fp8 exactly to float32 (CPU) or the query's dtype (the Triton kernels).
"""

from __future__ import annotations

import torch

from engine.loading.model_config import ModelConfig


class KVCache:
    """Owns (or views) the KV cache tensor of one worker rank.

    Args:
        config: the model as this rank holds it (layers, this rank's KV heads, head_dim).
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        dtype: cache dtype: the model's, or ``torch.float8_e4m3fn`` (scale 1.0, see above).
        device: where the cache lives.
        tensor: memory to use instead of allocating it, of :meth:`shape` and ``dtype`` on
            ``device`` (a pool another process allocated and shares, :mod:`engine.parallel.shared_memory`).

    A tensor allocated here is zero-filled so that never-written slots hold finite values (masked
    attention multiplies them by zero, and 0 * NaN would poison the output); a given one must be
    zero-filled too.

    Raises:
        ValueError: ``tensor`` has another shape, dtype or device.
    """

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int,
        dtype: torch.dtype, device: torch.device | str, tensor: torch.Tensor | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = config.num_hidden_layers
        shape = self.shape(config, num_blocks, block_size)
        if tensor is None:
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != torch.device(device):
            raise ValueError(f"KV cache tensor {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} is not "
                             f"{shape} {dtype} on {device}")
        self.tensor = tensor
        # the per-layer views, made once: a step asks for each layer's (four view ops each time)
        self._layers = [(tensor[:, :, i, 0].transpose(1, 2), tensor[:, :, i, 1].transpose(1, 2))
                        for i in range(self.num_layers)]

    @staticmethod
    def shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``(num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim)``."""
        return (num_blocks, config.num_key_value_heads, config.num_hidden_layers, 2, block_size, config.head_dim)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block: all layers' K and V for ``block_size`` tokens."""
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return layer ``index``'s ``(k_cache, v_cache)`` views, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` (block stride = one whole block,
        head stride = one head's slice of the block)."""
        return self._layers[index]

    def block(self, block_id: int) -> torch.Tensor:
        """Return block ``block_id``: ``[num_kv_heads, num_layers, 2, block_size, head_dim]``, contiguous."""
        return self.tensor[block_id]
