"""End-to-end KV digests: what the sender computes over the blocks it hands to a transport, and
the receiver recomputes over the blocks where they landed, before they are counted in.

One digest per block and KV head (``kernels.kv_digest``: a position-weighted sum of the span's
32-bit words mod 2**64), computed on the device that holds the bytes (the Triton kernel on a
GPU, ``kernels.reference`` on the CPU). Per head, so a receiving tensor-parallel rank checks
exactly the head range it holds, whatever the sender's ranks (heterogeneous TP). On the wire
(``KVChunk.block_digests``) they are block-major: block ``j``'s head ``h`` is at
``j * num_kv_heads + h``, unsigned 64-bit. The receiver also refuses a block holding a NaN or
an infinity: KV the model computed is finite, and random bytes read as a float dtype are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
import torch

import kernels.reference
from protos.status import StatusError

if TYPE_CHECKING:  # (the pool's layout is the wire's, which digests its chunks)
    from kvtransfer.pool import KVPool

_MASK64 = (1 << 64) - 1


class KVIntegrityError(StatusError):
    """Blocks that landed differ from what the sender digested, or hold NaN / infinity.

    Code ``ABORTED``: a transfer failure, which the gateway retries on another path (another
    transfer, another prefill worker, a local prefill); the reservation has been released.
    """

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.ABORTED, message)


def span_digests(tensor: torch.Tensor, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_digests`` of ``tensor`` ``[num_blocks, num_heads, ...]``'s blocks ``block_ids``, on
    its device: ``(digests, nonfinite)``, ``[len(block_ids), num_heads]`` int64 and int32."""
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=tensor.device)
    if not tensor.is_cuda:
        return kernels.reference.kv_digests(tensor, ids)
    with torch.cuda.device(tensor.device):  # Triton launches on the current device
        return kernels.kv_digests(tensor, ids)  # (loads Triton, an optional dependency, on first use)


def block_digests(blocks: torch.Tensor) -> list[int]:
    """The wire digests of ``blocks`` ``[n, num_kv_heads, ...]`` (whole blocks, e.g. a gRPC chunk's
    before its host copy): ``n * num_kv_heads`` unsigned 64-bit ints, block-major."""
    return [d & _MASK64 for d in span_digests(blocks, range(blocks.shape[0]))[0].view(-1).tolist()]


def pool_digests(pool: KVPool, block_ids: Sequence[int]) -> list[int]:
    """The wire digests of ``pool``'s blocks ``block_ids``, each rank over its heads on its
    device, without gathering: ``len(block_ids) * num_kv_heads`` unsigned 64-bit ints."""
    parts = [span_digests(part.tensor, block_ids)[0].cpu() for part in pool.ranks]
    return [d & _MASK64 for d in torch.cat(parts, dim=1).view(-1).tolist()]


def check_digest_count(digests: Sequence[int], num_blocks: int, num_heads: int) -> None:
    """Refuse a chunk whose digests do not cover its blocks (before any write).

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``block_digests``.
    """
    if len(digests) != num_blocks * num_heads:
        raise StatusError.invalid_argument(
            "block_digests", f"has {len(digests)} digests; one per block and KV head expected "
                             f"({num_blocks} x {num_heads})")


def verify_landed(pool: KVPool, block_ids: Sequence[int], digests: Sequence[int], where: str) -> None:
    """Recompute the digests of ``pool``'s blocks ``block_ids`` where they landed, each rank over
    its own heads on its device, and compare them with the sender's ``digests`` (block-major,
    every KV head); check that every value is finite.

    Args:
        where: names the blocks in the error (positions, reservation, transport).

    Raises:
        KVIntegrityError: a digest differs or a value is NaN / infinite (the first one named).
    """
    num_heads = pool.layout.block_shape[0]
    sent = torch.tensor([d - (1 << 64) if d >> 63 else d for d in digests], dtype=torch.int64)
    sent = sent.view(len(block_ids), num_heads)
    for part in pool.ranks:
        got, nonfinite = (t.cpu() for t in span_digests(part.tensor, block_ids))
        heads = slice(part.first_head, part.first_head + part.num_heads)
        bad = (got != sent[:, heads]).nonzero()
        if len(bad):
            j, h = bad[0].tolist()
            raise KVIntegrityError(
                f"KV digest mismatch in {len(bad)} of {got.numel()} (block, head) spans of {where}, first at "
                f"block {j} head {part.first_head + h}: {got[j, h].item() & _MASK64:#018x} != sent "
                f"{sent[j, part.first_head + h].item() & _MASK64:#018x}")
        if nonfinite.any():
            j, h = nonfinite.nonzero()[0].tolist()
            raise KVIntegrityError(
                f"{int(nonfinite.sum())} non-finite KV values in {where}, first in block {j} head "
                f"{part.first_head + h}")
