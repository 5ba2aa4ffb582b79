"""End-to-end KV digests: what the sender computes over the blocks it hands to a transport, and
the receiver recomputes over the blocks where they landed, before they are counted in.

One digest per block and KV head (``kernels.kv_digest``: a position-weighted sum of the span's
32-bit words mod 2**64), computed on the device that holds the bytes (the Triton kernel on a
GPU, ``kernels.reference`` on the CPU). Per head, so a receiving tensor-parallel rank checks
exactly the head range it holds, whatever the sender's ranks (heterogeneous TP). On the wire
(``KVChunk.block_digests``) they are little-endian 64-bit values, block-major: block ``j``'s
head ``h`` is value ``j * num_kv_heads + h``; they stay tensors on both sides (no Python int per
value), and the receiver compares on the device, with one host sync per rank. The receiver also
refuses a block holding a NaN or an infinity: KV the model computed is finite, and random bytes
read as a float dtype are not.
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


def block_digests(blocks: torch.Tensor) -> bytes:
    """The wire digests of ``blocks`` ``[n, num_kv_heads, ...]`` (whole blocks, e.g. a gRPC chunk's
    before its host copy): ``n * num_kv_heads`` little-endian 64-bit values, block-major."""
    return span_digests(blocks, range(blocks.shape[0]))[0].cpu().numpy().tobytes()


def pool_digests(pool: KVPool, block_ids: Sequence[int]) -> bytes:
    """The wire digests of ``pool``'s blocks ``block_ids``, each rank over its heads on its
    device, without gathering: ``len(block_ids) * num_kv_heads`` little-endian 64-bit values."""
    parts = [span_digests(part.tensor, block_ids)[0].cpu() for part in pool.ranks]
    return torch.cat(parts, dim=1).numpy().tobytes()


def compile_digests(pool: KVPool) -> None:
    """Digest one block of ``pool`` once, so that the kernel's compilation for this pool's layout
    (about a second of Triton's JIT on a GPU) happens at start-up, not in a first request's
    transfer."""
    pool_digests(pool, [0])


def check_digest_count(digests: bytes, num_blocks: int, num_heads: int) -> None:
    """Refuse a chunk whose digests do not cover its blocks (before any write).

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``block_digests``.
    """
    if len(digests) != 8 * num_blocks * num_heads:
        raise StatusError.invalid_argument(
            "block_digests", f"has {len(digests) / 8:g} digests; one per block and KV head expected "
                             f"({num_blocks} x {num_heads})")


def verify_landed(pool: KVPool, block_ids: Sequence[int], digests: bytes, where: str) -> None:
    """Recompute the digests of ``pool``'s blocks ``block_ids`` where they landed, each rank over
    its own heads on its device, and compare them there with the sender's ``digests`` (the wire
    format, every KV head); check that every value is finite.

    Args:
        where: names the blocks in the error (positions, reservation, transport).

    Raises:
        KVIntegrityError: a digest differs or a value is NaN / infinite (the first one named).
    """
    sent = torch.frombuffer(bytearray(digests), dtype=torch.int64).view(len(block_ids), -1)
    for part in pool.ranks:
        heads = slice(part.first_head, part.first_head + part.num_heads)
        got, nonfinite = span_digests(part.tensor, block_ids)
        expected = sent[:, heads].to(got.device)
        if not ((got != expected) | (nonfinite != 0)).any():  # (the one host sync of a clean check)
            continue
        got, expected, nonfinite = got.cpu(), expected.cpu(), nonfinite.cpu()
        bad = (got != expected).nonzero()
        if len(bad):
            j, h = bad[0].tolist()
            raise KVIntegrityError(
                f"KV digest mismatch in {len(bad)} of {got.numel()} (block, head) spans of {where}, first at "
                f"block {j} of them, head {part.first_head + h}: {got[j, h].item() & _MASK64:#018x} != sent "
                f"{expected[j, h].item() & _MASK64:#018x}")
        j, h = nonfinite.nonzero()[0].tolist()
        raise KVIntegrityError(
            f"{int(nonfinite.sum())} non-finite KV values in {where}, first in block {j} of them, head "
            f"{part.first_head + h}")
