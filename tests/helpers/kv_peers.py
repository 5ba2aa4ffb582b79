"""Two workers' KV data planes in one test process: small random KV pools (any tensor-parallel
size), a real grpc.aio ``DecodeWorker`` on loopback serving ``TransferKV`` into a pool, NIXL
agents over pools, and a sender's stream that a test can tamper with chunk by chunk."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import torch

from engine.loading.model_config import ModelConfig
from engine.parallel.tensor_parallel import shard_config
from engine.runner.kv_cache import KVCache
from kvtransfer import (
    DEFAULT_MAX_CHUNK_BYTES, GRPC_MESSAGE_OPTIONS, KVDestination, KVPool, KVReceiver, KVTransferClient,
    KVTransferServicer, KVTransferStream, ReservationTable,
)
from kvtransfer.nixl import NixlAgent
from protos.tandem.v1 import kvtransfer_pb2, worker_pb2_grpc

CONFIG = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4)  # head_dim 8
BLOCK_SIZE = 4
NUM_BLOCKS = 8
SRC_IDS = [5, 1, 2, 7]  # the request's blocks on the prefill worker, position order
DST_IDS = [3, 0, 6, 4]  # the reservation's blocks on the decode worker


def make_pool(dtype: torch.dtype, fill_random: bool, num_ranks: int = 1, config: ModelConfig = CONFIG) -> KVPool:
    """The KV pool of a worker of ``num_ranks`` tensor-parallel ranks (each its KV heads' part)."""
    shard = shard_config(config, num_ranks)
    tensors = [KVCache(shard, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu").tensor for _ in range(num_ranks)]
    if fill_random:
        for tensor in tensors:
            fill_finite_random(tensor)
    return KVPool(tensors)


def fill_finite_random(tensor: torch.Tensor) -> None:
    """Random bit patterns, the non-finite ones zeroed (a receiver refuses NaN and infinity):
    bit-exactness covers signed zeros, subnormals and every finite value's bits."""
    raw = tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    bits = tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])
    bits[~torch.isfinite(tensor.float())] = 0


def blocks(pool: KVPool, block_ids) -> torch.Tensor:
    """Whole blocks (every rank's heads) as bytes."""
    return as_bytes(pool.gather(list(block_ids)))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def untouched(pool: KVPool, written) -> list[int]:
    return sorted(set(range(NUM_BLOCKS)) - set(written))


class TransferOnlyDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """The decode worker's TransferKV, delegated as the real servicer will."""

    def __init__(self, receiver: KVReceiver, on_integrity_failure: Callable[[str], None]) -> None:
        self.kv = KVTransferServicer(receiver, on_integrity_failure)

    async def TransferKV(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        response, _ = await self.kv.transfer_kv(request_iterator, context)
        return response


@dataclass
class DecodePeer:
    address: str
    table: ReservationTable
    freed: list[int]
    stub: worker_pb2_grpc.DecodeWorkerStub
    server: grpc.aio.Server
    integrity_failures: list[str]  # the transport of each stream refused for its digests


@contextlib.asynccontextmanager
async def decode_worker(pool: KVPool, lease_s: float = 30.0, nixl: NixlAgent | None = None,
                        verify_checksums: bool = False) -> AsyncIterator[DecodePeer]:
    """A decode worker's ``TransferKV`` into ``pool`` on a free loopback port."""
    freed: list[int] = []
    integrity_failures: list[str] = []
    table = ReservationTable(freed.extend, lease_s=lease_s)
    server = grpc.aio.server(options=GRPC_MESSAGE_OPTIONS)
    receiver = KVReceiver(pool, table, nixl=nixl, verify_checksums=verify_checksums)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(TransferOnlyDecodeWorker(receiver, integrity_failures.append),
                                                       server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address, options=GRPC_MESSAGE_OPTIONS)
    try:
        yield DecodePeer(address, table, freed, worker_pb2_grpc.DecodeWorkerStub(channel), server, integrity_failures)
    finally:
        await channel.close()
        await server.stop(None)


Tamper = Callable[[int, kvtransfer_pb2.KVChunk], Awaitable[kvtransfer_pb2.KVChunk | None]]


async def send_blocks(stub, pool: KVPool, block_ids: list[int], *, reservation_id: str, request_id: str,
                      max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> int:
    """Open a transfer, send every block, wait for the acknowledgement (what a prefill worker does)."""
    async with KVTransferStream(stub, reservation_id, request_id, max_chunk_bytes=max_chunk_bytes) as transfer:
        await transfer.send(pool, 0, block_ids)
        return await transfer.finish()


class TamperingStub:
    """A test transport wrapper: passes each outgoing chunk of blocks through ``tamper(i, chunk)``,
    which may change it, drop it (``None``) or stall; the stream's opening message passes as is."""

    def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub, tamper: Tamper) -> None:
        self.stub, self.tamper = stub, tamper

    def TransferKV(self, **kwargs):  # noqa: N802
        return _TamperingCall(self.stub.TransferKV(**kwargs), self.tamper)


class _TamperingCall:
    def __init__(self, call, tamper: Tamper) -> None:
        self.call, self.tamper, self.count = call, tamper, 0

    async def write(self, chunk: kvtransfer_pb2.KVChunk) -> None:
        if chunk.num_blocks:
            chunk = await self.tamper(self.count, chunk)
            self.count += 1
        if chunk is not None:
            await self.call.write(chunk)

    async def done_writing(self) -> None:
        await self.call.done_writing()

    def cancel(self) -> bool:
        return self.call.cancel()

    def __await__(self):
        return self.call.__await__()


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)



_agents = iter(range(1_000_000))


def agent(pool: KVPool) -> NixlAgent:
    """A NIXL agent over ``pool`` with a name unique in this process."""
    return NixlAgent(f"test-agent-{next(_agents)}", pool)


@contextlib.asynccontextmanager
async def nixl_transfer(peer: DecodePeer, sender_agent: NixlAgent,
                        reservation_id: str) -> AsyncIterator[KVTransferStream]:
    """A NIXL transfer of request ``req-1`` into ``peer``'s reservation, opened as a prefill worker opens it."""
    channel = grpc.aio.insecure_channel(peer.address, options=GRPC_MESSAGE_OPTIONS)
    sender = KVTransferClient(lambda address: channel, transports=["nixl"], nixl=sender_agent)
    try:
        async with sender.open(KVDestination(peer.address, reservation_id, kv_transports=("nixl",)), "req-1") as transfer:
            yield transfer
    finally:
        await channel.close()
