"""A worker's KV memory as the data plane sees it: one tensor per tensor-parallel rank.

A block's layout on the wire is the model's, whatever the worker's tensor-parallel size:
``[num_kv_heads, num_layers, 2, block_size, head_dim]``. Rank ``r`` of a worker holds KV heads
``[first_head_r, first_head_r + heads_r)`` of every block, in a tensor
``[num_blocks, heads_r, num_layers, 2, block_size, head_dim]`` (``engine.runner.kv_cache``); the ranks
share block ids. Heads are the block's outermost dimension, so a rank's part of a block is one
contiguous span of bytes, and so is any head range of it: what one rank of another worker
(another tensor-parallel size) owns of it. The gRPC transport moves whole blocks
(:meth:`KVPool.gather`, :meth:`KVPool.scatter`); NIXL reads each rank's head range straight
from the rank that holds it (:mod:`kvtransfer.nixl`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer.wire import BlockLayout


@dataclass(frozen=True)
class RankPart:
    """One rank's tensor of a pool and the KV heads it holds."""

    tensor: torch.Tensor
    first_head: int

    @property
    def num_heads(self) -> int:
        return self.tensor.shape[1]


class KVPool:
    """The KV cache tensors of a worker's ranks, in rank order.

    Args:
        tensors: rank ``r``'s ``[num_blocks, heads_r, *rest]``, contiguous; every rank the same
            ``num_blocks``, ``rest`` and dtype.

    Raises:
        ValueError: the tensors do not fit together.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        first = tensors[0]
        if any(t.shape[0] != first.shape[0] or t.shape[2:] != first.shape[2:] or t.dtype != first.dtype
               or not t.is_contiguous() for t in tensors):
            raise ValueError("the KV pool's rank tensors must be contiguous, of one dtype and one block shape "
                             f"but their heads: {[(tuple(t.shape), t.dtype) for t in tensors]}")
        heads = 0
        self.ranks: list[RankPart] = []
        for tensor in tensors:
            self.ranks.append(RankPart(tensor, heads))
            heads += tensor.shape[1]
        self.num_blocks = first.shape[0]
        self.layout = BlockLayout(first.dtype, (heads, *first.shape[2:]))
        self.head_nbytes = math.prod(first.shape[2:]) * first.element_size()

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Blocks ``block_ids`` whole: ``[len(block_ids), *layout.block_shape]``, on rank 0's device
        (a view when there is one rank and the ids are a run)."""
        ids = list(block_ids)
        if len(self.ranks) == 1 and ids == list(range(ids[0], ids[0] + len(ids))):
            return self.ranks[0].tensor[ids[0]:ids[0] + len(ids)]
        device = self.ranks[0].tensor.device
        return torch.cat([part.tensor[torch.tensor(ids, device=part.tensor.device)].to(device) for part in self.ranks],
                         dim=1)

    def scatter(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write ``blocks`` ``[len(block_ids), *layout.block_shape]`` of ``layout.dtype`` (any device) into blocks
        ``block_ids``, each rank its heads; returns once every rank's copy has landed (another
        process computes on the other ranks' tensors)."""
        for part in self.ranks:
            tensor = part.tensor
            index = torch.tensor(list(block_ids), dtype=torch.long, device=tensor.device)
            heads = blocks[:, part.first_head:part.first_head + part.num_heads].to(tensor.device)
            # Copied as bytes, the same copy for every dtype: index_copy_ has no float8 kernel.
            tensor.view(torch.uint8).index_copy_(0, index, heads.view(torch.uint8))
            if tensor.is_cuda and part is not self.ranks[0]:
                torch.cuda.synchronize(tensor.device)

    def scrub(self, block_ids: Sequence[int]) -> None:
        """Zero blocks ``block_ids`` on every rank: bytes refused by a transfer's check (which may
        hold NaN) never stay in a slot the pool hands out again, where a later request's last,
        partly written block would keep them past its tokens."""
        for part in self.ranks:
            index = torch.tensor(list(block_ids), dtype=torch.long, device=part.tensor.device)
            part.tensor.view(torch.uint8).index_fill_(0, index, 0)
            if part.tensor.is_cuda and part is not self.ranks[0]:
                torch.cuda.synchronize(part.tensor.device)
