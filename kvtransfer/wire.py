"""KV blocks as protobuf chunks: raw tensor bytes with dtype, shape, a CRC-32 and the blocks'
end-to-end digests (:mod:`kvtransfer.digest`), nothing pickled.

A block is ``[num_kv_heads, num_layers, 2, block_size, head_dim]``, C-contiguous: every KV head of
the model, whatever the tensor-parallel sizes of the workers (:mod:`kvtransfer.pool`). A chunk (``tandem.v1.KVChunk``) carries ``num_blocks >= 1`` blocks of one request at
consecutive positions. Bytes are the tensor's own, read through a ``uint8`` view, so every dtype
(bfloat16 and float8 included, which numpy lacks) round-trips bit-exact. Byte order is the
host's; every supported host (x86-64, aarch64) is little-endian, as the wire format states.
"""

from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass

import grpc
import torch

from kvtransfer.digest import block_digests
from protos.status import StatusError
from protos.tandem.v1 import kvtransfer_pb2

# An allowlist, never getattr(torch, name): the name comes off the network.
KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_DTYPE_NAMES = {dtype: name for name, dtype in KV_DTYPES.items()}


@dataclass(frozen=True)
class BlockLayout:
    """The format of one KV block.

    Attributes:
        dtype: element type, one of ``KV_DTYPES``.
        block_shape: ``(num_kv_heads, num_layers, 2, block_size, head_dim)``.

    Raises:
        ValueError: ``dtype`` is not a supported KV dtype, or a dimension is < 1.
    """

    dtype: torch.dtype
    block_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype {self.dtype} is not one of {sorted(KV_DTYPES)}")
        if not self.block_shape or min(self.block_shape) < 1:
            raise ValueError(f"block_shape must have dimensions >= 1, got {self.block_shape}")

    @property
    def dtype_name(self) -> str:
        """The dtype's wire name, e.g. ``"bfloat16"``."""
        return _DTYPE_NAMES[self.dtype]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block."""
        return math.prod(self.block_shape) * self.dtype.itemsize

    def to_proto(self) -> kvtransfer_pb2.KVBlockLayout:
        """This layout as ``tandem.v1.KVBlockLayout``."""
        return kvtransfer_pb2.KVBlockLayout(dtype=self.dtype_name, block_shape=self.block_shape)

    @classmethod
    def from_proto(cls, message: kvtransfer_pb2.KVBlockLayout) -> BlockLayout:
        """Parse ``tandem.v1.KVBlockLayout``.

        Raises:
            StatusError: ``INVALID_ARGUMENT``, unknown dtype or an empty/zero dimension.
        """
        if message.dtype not in KV_DTYPES:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown KV dtype {message.dtype!r}")
        try:
            return cls(KV_DTYPES[message.dtype], tuple(message.block_shape))
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc


def crc32(data: bytes) -> int:
    """CRC-32 (zlib, IEEE polynomial) of ``data``, as an unsigned 32-bit int."""
    return zlib.crc32(data) & 0xFFFFFFFF


def blocks_crc32(blocks: torch.Tensor) -> int:
    """CRC-32 of ``blocks`` ``[n, *block_shape]`` one after the other, as their raw bytes (what a
    chunk of them carries as ``data``); copies them to the host."""
    return crc32(blocks.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())


def encode_chunk(
    blocks: torch.Tensor, *, reservation_id: str, request_id: str, first_block_index: int
) -> kvtransfer_pb2.KVChunk:
    """Pack consecutive blocks of one request into a chunk.

    Args:
        blocks: ``[num_blocks, *block_shape]``, a supported KV dtype, any device (copied to host).
        reservation_id: the destination reservation.
        request_id: the request the blocks belong to.
        first_block_index: position of ``blocks[0]`` within the request's blocks.

    Returns:
        The chunk, with ``data`` (``blocks.nbytes`` bytes), its CRC-32 and the blocks' digests
        (computed on ``blocks``' device, before the host copy).
    """
    layout = BlockLayout(blocks.dtype, tuple(blocks.shape[1:]))
    digests = block_digests(blocks)
    data = blocks.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return kvtransfer_pb2.KVChunk(
        reservation_id=reservation_id, request_id=request_id,
        first_block_index=first_block_index, num_blocks=blocks.shape[0],
        layout=layout.to_proto(), data=data, crc32=crc32(data), block_digests=digests,
    )


def decode_chunk(chunk: kvtransfer_pb2.KVChunk, expected: BlockLayout) -> torch.Tensor:
    """Check a chunk's format against ``expected`` and view its blocks as a tensor.

    Checks, in order: ``num_blocks >= 1``, dtype, block shape, byte length, CRC-32. Nothing
    about the reservation is checked here (``KVReceiver.install`` does that).

    Args:
        chunk: as received.
        expected: the receiving cache's block layout.

    Returns:
        ``[num_blocks, *expected.block_shape]`` of ``expected.dtype`` on the CPU, a read-only
        view of ``chunk.data``: copy from it, never write to it.

    Raises:
        StatusError: ``INVALID_ARGUMENT`` for a count, dtype, shape or length mismatch,
            ``DATA_LOSS`` for a checksum mismatch.
    """
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    where = f"chunk at block {chunk.first_block_index} of reservation {chunk.reservation_id!r}"
    if chunk.num_blocks < 1:
        raise StatusError(invalid, f"{where}: num_blocks must be >= 1, got {chunk.num_blocks}")
    if chunk.layout.dtype != expected.dtype_name:
        raise StatusError(
            invalid, f"{where}: dtype {chunk.layout.dtype!r} != expected {expected.dtype_name!r}")
    if tuple(chunk.layout.block_shape) != expected.block_shape:
        raise StatusError(
            invalid, f"{where}: block_shape {list(chunk.layout.block_shape)} != expected "
                     f"{list(expected.block_shape)}")
    want = chunk.num_blocks * expected.block_nbytes
    if len(chunk.data) != want:
        raise StatusError(
            invalid, f"{where}: {len(chunk.data)} bytes != {chunk.num_blocks} blocks x "
                     f"{expected.block_nbytes} = {want}")
    if crc32(chunk.data) != chunk.crc32:
        raise StatusError(
            grpc.StatusCode.DATA_LOSS,
            f"{where}: CRC-32 {crc32(chunk.data):#010x} != sent {chunk.crc32:#010x}")
    with warnings.catch_warnings():
        # ``bytes`` is immutable; the view is only ever read (copied into the cache).
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(chunk.data, dtype=torch.uint8)
    return raw.view(expected.dtype).view(chunk.num_blocks, *expected.block_shape)
