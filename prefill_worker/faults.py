"""Test-only fault injection for end-to-end tests of failure handling.

``TANDEM_TEST_CORRUPT_KV=<tag>``: for requests whose id contains ``<tag>``, the prefill worker
flips one byte of the first KV chunk *after* its CRC-32 was computed, so the decode worker's
receiver refuses the stream with ``DATA_LOSS`` (and the prefill worker passes that on). Never
set it in production.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import grpc
import torch

from kvtransfer import GRPC_MESSAGE_OPTIONS, GrpcKVSender, KVDestination, send_blocks
from protos.tandem.v1 import kvtransfer_pb2, worker_pb2_grpc

CORRUPT_KV_ENV = "TANDEM_TEST_CORRUPT_KV"


def make_sender(timeout_s: float) -> GrpcKVSender:
    """The gRPC sender, or the corrupting one when ``TANDEM_TEST_CORRUPT_KV`` is set."""
    tag = os.environ.get(CORRUPT_KV_ENV, "")
    return CorruptingKVSender(tag, timeout_s=timeout_s) if tag else GrpcKVSender(timeout_s=timeout_s)


class CorruptingKVSender(GrpcKVSender):
    """``GrpcKVSender`` that corrupts the first chunk of requests whose id contains ``tag``."""

    def __init__(self, tag: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tag = tag

    async def send(self, kv_cache: torch.Tensor, block_ids: Sequence[int], destination: KVDestination,
                   request_id: str) -> int:
        if self.tag not in request_id:
            return await super().send(kv_cache, block_ids, destination, request_id)
        async with grpc.aio.insecure_channel(destination.address, options=GRPC_MESSAGE_OPTIONS) as channel:
            return await send_blocks(
                _CorruptingStub(worker_pb2_grpc.DecodeWorkerStub(channel)), kv_cache, block_ids,
                reservation_id=destination.reservation_id, request_id=request_id,
                max_chunk_bytes=self.max_chunk_bytes, timeout_s=self.timeout_s)


class _CorruptingStub:
    def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub) -> None:
        self.stub = stub

    def TransferKV(self, **kwargs):  # noqa: N802 (gRPC method name)
        return _CorruptingCall(self.stub.TransferKV(**kwargs))


class _CorruptingCall:
    def __init__(self, call) -> None:
        self.call, self.first = call, True

    async def write(self, chunk: kvtransfer_pb2.KVChunk) -> None:
        if self.first and chunk.data:
            data = bytearray(chunk.data)
            data[0] ^= 0xFF
            chunk.data = bytes(data)
        self.first = False
        await self.call.write(chunk)

    async def done_writing(self) -> None:
        await self.call.done_writing()

    def cancel(self) -> bool:
        return self.call.cancel()

    def __await__(self):
        return self.call.__await__()
