"""KV blocks moved by NIXL: GPU to GPU (CUDA IPC / NVLink on one host), shared memory or RDMA.

Every worker registers its whole KV pool with its NIXL agent once (:class:`NixlAgent`). The
**decode worker reads**: the prefill worker announces, on the ``TransferKV`` stream, which of
its blocks hold which positions of the request (``KVChunk.source_block_ids``, its pool's
address and agent metadata in the stream's opening message), and the decode worker pulls them
with a NIXL READ straight into its reserved slots. Reading rather than having the prefill
worker write is the safer and simpler choice: the receiver checks every position against its
reservation before any byte lands (as on the gRPC path), only the receiver knows where its
slots are, and a faulty or hostile sender cannot write anywhere into the decode worker's pool
(vLLM's NIXL connector reads for the same reasons). The overlap with prefill is kept: blocks
are announced as soon as the chunk that fills them is computed, and read while the prefill
goes on.

Runs of blocks adjacent on both sides travel as one descriptor (a block-major pool makes a run
one span of bytes; the block pool allocates in runs where it can).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from protos.status import StatusError
from protos.tandem.v1 import kvtransfer_pb2

logger = logging.getLogger(__name__)

# A read's completion is polled from the event loop: first soon, then at most every 0.5 ms.
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 5e-4

# UCX turns CUDA IPC reads (get zero-copy) off on GPUs without an active NVLink (openucx/ucx#7566:
# reads were slower than writes on some PCIe platforms), and a read then falls back to active
# messages over TCP through host memory: 0.45 GB/s between two processes on one H100 against
# 1 TB/s for a write (measured with UCX 1.23 from nixl-cu13 1.5.1). The decode side reads, so it
# asks for them back; a value the operator set wins.
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def nixl_importable() -> bool:
    """Whether the ``nixl`` package (with a CUDA or CPU backend build) can be imported here."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class _Peer:
    """A sender's pool as the receiver's agent knows it."""

    name: str
    metadata: bytes
    base_address: int
    num_blocks: int
    memory_type: str
    device_id: int


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group ``src[i] -> dst[i]`` block copies into runs adjacent on both sides.

    Returns:
        ``(first_src, first_dst, length)`` per run, in order.
    """
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class NixlAgent:
    """This worker's NIXL agent, its KV pool registered once.

    Args:
        name: the agent's name, unique in the cluster (a worker's id and a random suffix).
        kv_cache: the pool, ``[num_blocks, *block_shape]``, contiguous, on the GPU or in host
            memory.

    Raises:
        RuntimeError: NIXL is not importable, or its UCX backend could not start.
    """

    def __init__(self, name: str, kv_cache: torch.Tensor) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if not kv_cache.is_contiguous():
            raise RuntimeError("the KV pool must be contiguous to register with NIXL")
        if kv_cache.is_cuda:  # (UCX warns of a CUDA setting where it has no CUDA transport)
            for key, value in UCX_DEFAULTS.items():
                os.environ.setdefault(key, value)  # read by UCX when the agent's backend starts
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL's UCX backend is not available")
        self.name = name
        self.kv_cache = kv_cache
        self.block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        self.memory_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = kv_cache.get_device() if kv_cache.is_cuda else 0
        self._registration = self.agent.register_memory(kv_cache)
        self._metadata = self.agent.get_agent_metadata()  # fixed once the pool is registered
        self._peers: dict[str, _Peer] = {}

    def source(self) -> kvtransfer_pb2.NixlSource:
        """What a receiver needs to read from this worker's pool."""
        return kvtransfer_pb2.NixlSource(
            agent_metadata=self._metadata, agent_name=self.name,
            base_address=self.kv_cache.data_ptr(), num_blocks=self.kv_cache.shape[0],
            memory_type=self.memory_type, device_id=self.device_id)

    def add_peer(self, source: kvtransfer_pb2.NixlSource) -> _Peer:
        """Know a sender's agent (once per agent; its metadata is checked on every stream).

        Raises:
            StatusError: ``INVALID_ARGUMENT``, malformed source or a memory type NIXL lacks.
        """
        if source.memory_type not in ("VRAM", "DRAM") or not source.agent_name or not source.num_blocks:
            raise StatusError.invalid_argument("nixl_source", "agent_name, num_blocks and memory_type VRAM or DRAM "
                                                              "are required")
        peer = self._peers.get(source.agent_name)
        if peer is None or peer.metadata != source.agent_metadata:
            if peer is not None:
                self.agent.remove_remote_agent(peer.name)
            try:
                name = self.agent.add_remote_agent(source.agent_metadata)
            except Exception as exc:  # nixl raises its own binding errors for bad metadata
                raise StatusError.invalid_argument("nixl_source.agent_metadata", f"refused by NIXL: {exc}") from None
            name = name.decode() if isinstance(name, bytes) else name
            if name != source.agent_name:
                raise StatusError.invalid_argument("nixl_source.agent_name", f"is {source.agent_name!r} but the "
                                                   f"metadata names {name!r}")
            peer = _Peer(name, source.agent_metadata, source.base_address, source.num_blocks,
                         source.memory_type, source.device_id)
            self._peers[name] = peer
        return peer

    async def read(self, peer: _Peer, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """Copy ``peer``'s blocks ``src_blocks[i]`` into this pool's ``dst_blocks[i]``.

        Runs to completion even if the caller is cancelled meanwhile only when shielded: callers
        hold the destination blocks until this returns.

        Raises:
            StatusError: ``INVALID_ARGUMENT`` for a source block outside the peer's pool,
                ``UNAVAILABLE`` when NIXL reports the transfer failed (peer gone).
        """
        bad = [b for b in src_blocks if not 0 <= b < peer.num_blocks]
        if bad:
            raise StatusError.invalid_argument("source_block_ids", f"{bad[:4]} outside the sender's pool of "
                                                                   f"{peer.num_blocks} blocks")
        runs = coalesce(src_blocks, dst_blocks)
        nb = self.block_nbytes
        local = np.array([[self.kv_cache.data_ptr() + d * nb, n * nb, self.device_id] for _, d, n in runs],
                         dtype=np.uint64)
        remote = np.array([[peer.base_address + s * nb, n * nb, peer.device_id] for s, _, n in runs],
                          dtype=np.uint64)
        handle = self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(local, self.memory_type),
            self.agent.get_xfer_descs(remote, peer.memory_type), peer.name)
        try:
            state, delay = self.agent.transfer(handle), _POLL_MIN_S
            while state == "PROC":
                await asyncio.sleep(delay)
                delay = min(2 * delay, _POLL_MAX_S)
                state = self.agent.check_xfer_state(handle)
        finally:
            self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"NIXL read from {peer.name} failed ({state})")

    def close(self) -> None:
        """Forget every peer and deregister the pool."""
        for name in list(self._peers):
            self.agent.remove_remote_agent(name)
        self._peers.clear()
        self.agent.deregister_memory(self._registration)
