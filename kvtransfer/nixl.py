"""KV blocks moved by NIXL: GPU to GPU (CUDA IPC / NVLink on one host), shared memory or RDMA.

Every worker registers its whole KV pool (every tensor-parallel rank's part, all allocated by
the worker's process: :mod:`engine.parallel.shared_memory`) with its NIXL agent once (:class:`NixlAgent`).
The **decode worker reads**: the prefill worker announces, on the ``TransferKV`` stream, which of
its blocks hold which positions of the request (``KVChunk.source_block_ids``; its ranks' pool
addresses and head ranges, and its agent metadata, in the stream's opening message), and the
decode worker pulls them with a NIXL READ straight into its reserved slots: each of its ranks'
head range from the prefill ranks that hold it, so workers of different tensor-parallel sizes
pair up (heterogeneous TP, as vLLM's NIXL connector does it for dense models). Reading rather
than having the prefill worker write is the safer and simpler choice: the receiver checks every position against its
reservation before any byte lands (as on the gRPC path), only the receiver knows where its
slots are, and a faulty or hostile sender cannot write anywhere into the decode worker's pool
(vLLM's NIXL connector reads for the same reasons). The overlap with prefill is kept: blocks
are announced as soon as the chunk that fills them is computed, and read while the prefill
goes on.

Each rank's part of a block is one span (heads are the block's outermost dimension), and so is
the overlap of two ranks' head ranges: a read is one descriptor per block and pair of
overlapping ranks, and NIXL merges runs of blocks adjacent on both sides into one. Both sides'
descriptors of every block are prepared once per peer (NIXL's prepared descriptor lists, as
vLLM's connector does), so a read only names block indices instead of building and checking
its descriptors (about 0.2 ms of NumPy on a GPU host for 256 blocks, on the first token's path).

The receiver **acknowledges by NIXL notification** (:meth:`NixlAgent.acknowledge`): once a read
completes the reservation, it sends the sender's agent a short message naming the reservation,
and the sender's :meth:`~kvtransfer.client.KVTransferStream.finish` returns on whichever
comes first, that message or the stream's gRPC answer (which still follows: the stream is
closed normally, and every refusal arrives as the stream's status). The answer crosses Python
gRPC and two event loops (about half a millisecond); a notification arrives in tens of
microseconds. The acknowledgement is
sent only after the read is counted in (``ReservationTable.end_write``), so a ``Decode`` that the
sender's success triggers finds the reservation complete.

NIXL runs without its progress thread: that thread polls UCX without pause (a whole core per
worker, idle or not: an idle two-worker cluster took both cores of a 2-core host). UCX then
moves only when called: a reader's completion polls drive its reads, a sender's ``finish``
drives its own agent while it waits, and either side drives its agent from the event loop
while a stream of its is open (or an acknowledgement of its is on its way), and a few seconds
after (:meth:`NixlAgent.serving_reads`): connection set-up, notifications, and the active
messages UCX falls back to without one-sided access.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Generator, Sequence

import grpc
import numpy as np
import torch

from kvtransfer.pool import KVPool
from protos.status import StatusError
from protos.tandem.v1 import kvtransfer_pb2

logger = logging.getLogger(__name__)

# A read's completion is polled with sleeps growing from _POLL_MIN_S to _POLL_MAX_S, slept off
# the event loop (_poll_sleep): the loop's own timed waits are whole milliseconds (epoll's
# timeout; asyncio.sleep(20e-6) lasts ~1.1 ms), about a millisecond late for a 256-block read.
# Spinning the loop instead (sleep(0)) would contend for the GIL with the engine thread's steps
# for the whole read, where a poll thread takes it once per poll.
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 2e-4
# A sender waiting in ``finish`` for an acknowledgement polls every _POLL_MIN_S to _ACK_POLL_MAX_S:
# the wait is short (the last chunk's read), and the notification arrives within ~20 us of its
# sending, which 200 us sleeps would see a few hundred microseconds late (measured on an H100).
_ACK_POLL_MAX_S = 5e-5
_POLL_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="nixl-poll")
# A sender's agent is progressed every _SERVE_POLL_S (~1.1 ms in effect: the loop's own sleep)
# while a reader may be reading from it: while one of its streams is open, and this long after
# the last one closed (a stream cancelled mid-read leaves the reader's read in flight, holding
# its destination blocks until it completes).
_SERVE_POLL_S = 2e-4
_SERVE_LINGER_S = 5.0
# A sender's agent that no stream or read has used for this long is forgotten (its metadata and
# prepared reads released) when another is added: prefill workers come and go (a restart is a new
# agent name), and a decode worker would otherwise keep every one it ever read from.
_PEER_IDLE_S = 60.0
# An acknowledgement's notification: this prefix, the reservation id, the blocks acknowledged.
_ACK_PREFIX = b"tandem.kv.ack/"

# UCX turns CUDA IPC reads (get zero-copy) off on GPUs without an active NVLink (openucx/ucx#7566:
# reads were slower than writes on some PCIe platforms), and a read then falls back to active
# messages over TCP through host memory: under 1 GB/s between two processes on one H100 against
# 1 TB/s for a write (UCX 1.23, from nixl-cu13 1.5.1). The decode side reads, so it asks for them
# back; a value the operator set wins.
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def nixl_importable() -> bool:
    """Whether the ``nixl`` package (with a CUDA or CPU backend build) can be imported here."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class _Peer:
    """A sender's pool as the receiver's agent knows it: per rank, ``(base_address, device_id,
    first_head, num_heads)``; and the two sides of every read from it, prepared once
    (``nixl_prepped_dlist_handle``s of :meth:`NixlAgent.read_spans`)."""

    name: str
    metadata: bytes
    num_blocks: int
    memory_type: str
    ranks: tuple[tuple[int, int, int, int], ...]
    local_side: object = None
    remote_side: object = None
    num_span_pairs: int = 0


class NixlAgent:
    """This worker's NIXL agent, its KV pool (every rank's part) registered once.

    Args:
        name: the agent's name, unique in the cluster (a worker's id and a random suffix).
        pool: the worker's pool: its ranks' tensors, on GPUs or in host memory (all alike).

    Raises:
        RuntimeError: NIXL is not importable, or its UCX backend could not start.
    """

    def __init__(self, name: str, pool: KVPool) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        cuda = pool.ranks[0].tensor.is_cuda
        if cuda:  # (UCX warns of a CUDA setting where it has no CUDA transport)
            for key, value in UCX_DEFAULTS.items():
                os.environ.setdefault(key, value)  # read by UCX when the agent's backend starts
        # A host-memory read runs in a thread (see read); NIXL then serializes the agent's calls.
        sync = None if cuda else nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=sync))
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL's UCX backend is not available")
        self.name = name
        self.pool = pool
        self.memory_type = "VRAM" if cuda else "DRAM"
        self._registrations = [self.agent.register_memory(part.tensor) for part in pool.ranks]
        self._metadata = self.agent.get_agent_metadata()  # fixed once the pool is registered
        self._peers: dict[str, _Peer] = {}
        self._serving = 0
        self._progress: asyncio.Task | None = None
        self._last_activity = 0.0  # event-loop time of the last reason to progress (serving, acknowledging)
        self._acks: dict[str, asyncio.Future[int]] = {}
        self._users: dict[str, int] = {}  # per peer: streams and reads holding it
        self._idle_since: dict[str, float] = {}  # per peer with no user: since when (time.monotonic)
        self.peer_idle_s = _PEER_IDLE_S

    def source(self) -> kvtransfer_pb2.NixlSource:
        """What a receiver needs to read from this worker's pool."""
        return kvtransfer_pb2.NixlSource(
            agent_metadata=self._metadata, agent_name=self.name, num_blocks=self.pool.num_blocks,
            memory_type=self.memory_type,
            ranks=[kvtransfer_pb2.NixlRankPool(base_address=part.tensor.data_ptr(), device_id=_device_id(part.tensor),
                                               first_head=part.first_head, num_heads=part.num_heads)
                   for part in self.pool.ranks])

    @contextlib.asynccontextmanager
    async def serving_reads(self):
        """While open (one per outgoing stream, nested freely) and ``_SERVE_LINGER_S`` after, this
        agent is progressed from the running event loop every ``_SERVE_POLL_S`` so that peers'
        reads of its pool complete and their notifications arrive."""
        self._serving += 1
        self._keep_progressing()
        try:
            yield
        finally:
            self._serving -= 1

    def _keep_progressing(self) -> None:
        """Progress this agent from the event loop for ``_SERVE_LINGER_S`` from now, at least."""
        if self._progress is None:
            self._progress = asyncio.get_running_loop().create_task(self._progress_while_serving())
        self._last_activity = asyncio.get_running_loop().time()

    async def _progress_while_serving(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._serving or loop.time() - self._last_activity < _SERVE_LINGER_S:
                if self._serving:
                    self._last_activity = loop.time()
                self.poll_notifications()
                await asyncio.sleep(_SERVE_POLL_S)
        finally:
            self._progress = None

    def poll_notifications(self) -> None:
        """Progress the agent's UCX workers and hand the acknowledgements that arrived to their
        waiters (:meth:`expect_acknowledgement`); other notifications are dropped."""
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                if not message.startswith(_ACK_PREFIX):
                    continue
                reservation_id, _, num_blocks = message[len(_ACK_PREFIX):].decode(errors="replace").partition("/")
                waiter = self._acks.get(reservation_id)
                if waiter is not None and not waiter.done() and num_blocks.isdigit():
                    waiter.set_result(int(num_blocks))

    def expect_acknowledgement(self, reservation_id: str) -> asyncio.Future[int]:
        """A future set to the number of blocks acknowledged when the receiver's acknowledgement
        of ``reservation_id`` arrives (while this agent is progressed); call
        :meth:`forget_acknowledgement` when done with it."""
        waiter = self._acks[reservation_id] = asyncio.get_running_loop().create_future()
        return waiter

    async def wait_acknowledgement(self, waiter: asyncio.Future[int], answer: asyncio.Future) -> int | None:
        """Poll this agent (every 20 to 50 microseconds) until ``waiter``
        (:meth:`expect_acknowledgement`) is set or ``answer`` (the stream's) is done.

        Returns:
            The blocks acknowledged, or ``None`` when the answer came first.
        """
        delay = _POLL_MIN_S
        while not answer.done():
            self.poll_notifications()
            if waiter.done():
                return waiter.result()
            await _poll_sleep(delay)
            delay = min(2 * delay, _ACK_POLL_MAX_S)
        return None

    def forget_acknowledgement(self, reservation_id: str) -> None:
        """Stop waiting for ``reservation_id``'s acknowledgement."""
        self._acks.pop(reservation_id, None)

    def acknowledge(self, peer: _Peer, reservation_id: str, num_blocks: int) -> bool:
        """Tell ``peer``'s agent that every block of ``reservation_id`` (``num_blocks``) has been
        read. Best effort: the stream's answer follows whatever becomes of the message.

        Returns:
            Whether NIXL took the message (``False``, logged, where it refused it: peer gone).
        """
        try:
            self.agent.send_notif(peer.name, _ACK_PREFIX + f"{reservation_id}/{num_blocks}".encode())
        except Exception as exc:  # nixl raises its own binding errors
            logger.warning("NIXL acknowledgement of reservation %s to %s not sent: %s", reservation_id, peer.name, exc)
            return False
        self.poll_notifications()  # sends it now where UCX can: eager active messages
        self._keep_progressing()  # else while the loop progresses the agent
        return True

    def add_peer(self, source: kvtransfer_pb2.NixlSource) -> _Peer:
        """Know a sender's agent and prepare its reads (once per agent; its metadata is checked on
        every stream), and hold it for the caller's stream: call :meth:`release_peer` when the
        stream ends. Peers no one has held for ``peer_idle_s`` are forgotten here.

        Raises:
            StatusError: ``INVALID_ARGUMENT``, malformed source (its ranks must cover this pool's
                KV heads in order, inside the memory its agent registered) or a memory type NIXL
                lacks; ``FAILED_PRECONDITION``, an agent of that name with other metadata is in
                use here.
        """
        if source.memory_type not in ("VRAM", "DRAM") or not source.agent_name or not source.num_blocks:
            raise StatusError.invalid_argument("nixl_source", "agent_name, num_blocks and memory_type VRAM or DRAM "
                                                              "are required")
        heads = [(r.first_head, r.num_heads) for r in source.ranks]
        expected = list(itertools.accumulate((n for _, n in heads), initial=0))[:-1]
        if not heads or [first for first, _ in heads] != expected or min(n for _, n in heads) < 1 \
                or sum(n for _, n in heads) != self.pool.layout.block_shape[0]:
            raise StatusError.invalid_argument("nixl_source.ranks", f"head ranges {heads} do not cover the "
                                               f"{self.pool.layout.block_shape[0]} KV heads in order")
        self._forget_idle()
        peer = self._peers.get(source.agent_name)
        if peer is None or peer.metadata != source.agent_metadata:
            if peer is not None:
                if self._users[peer.name]:
                    raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"NIXL agent {peer.name!r} is in use "
                                                                           f"here with other metadata")
                self._forget(peer)
            try:
                name = self.agent.add_remote_agent(source.agent_metadata)
            except Exception as exc:  # nixl raises its own binding errors for bad metadata
                raise StatusError.invalid_argument("nixl_source.agent_metadata", f"refused by NIXL: {exc}") from None
            name = name.decode() if isinstance(name, bytes) else name
            if name != source.agent_name:
                raise StatusError.invalid_argument("nixl_source.agent_name", f"is {source.agent_name!r} but the "
                                                   f"metadata names {name!r}")
            peer = self._prepare(_Peer(name, source.agent_metadata, source.num_blocks, source.memory_type,
                                       tuple((r.base_address, r.device_id, r.first_head, r.num_heads)
                                             for r in source.ranks)))
            self._peers[name], self._users[name] = peer, 0
        self._hold(peer)
        return peer

    def release_peer(self, peer: _Peer) -> None:
        """The stream that :meth:`add_peer` held ``peer`` for has ended (a peer forgotten
        meanwhile, by :meth:`close`, is let be)."""
        if self._peers.get(peer.name) is peer:
            self._users[peer.name] -= 1
            if not self._users[peer.name]:
                self._idle_since[peer.name] = time.monotonic()

    def held_peers(self) -> dict[str, int]:
        """Per known sender's agent, the streams and reads holding it."""
        return dict(self._users)

    def _hold(self, peer: _Peer) -> None:
        self._users[peer.name] += 1
        self._idle_since.pop(peer.name, None)

    def _forget_idle(self) -> None:
        """Forget the peers no one has held for ``peer_idle_s``."""
        now = time.monotonic()
        for name, since in list(self._idle_since.items()):
            if now - since >= self.peer_idle_s:
                self._forget(self._peers[name])

    def _prepare(self, peer: _Peer) -> _Peer:
        """``peer`` with both sides of its reads prepared (NIXL checks the peer's spans against
        the memory its agent registered here, once, instead of on every read).

        Raises:
            StatusError: ``INVALID_ARGUMENT`` when the peer's spans lie outside the pool its
                agent registered (NIXL refuses them) or past the address space; the peer is
                forgotten.
        """
        try:
            local, remote = self.read_spans(peer)
            remote_side = self.agent.prep_xfer_dlist(peer.name, remote, peer.memory_type)
        except Exception as exc:  # OverflowError (a span past the 64-bit address space), nixl's own errors
            self.agent.remove_remote_agent(peer.name)
            raise StatusError.invalid_argument("nixl_source.ranks", f"spans refused: {exc!r}") from None
        local_side = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, self.memory_type)
        return dataclasses.replace(peer, local_side=local_side, remote_side=remote_side, num_span_pairs=len(local))

    def _forget(self, peer: _Peer) -> None:
        """Release ``peer``'s prepared reads and its agent (no stream or read may hold it)."""
        peer.local_side.release()
        peer.remote_side.release()
        self.agent.remove_remote_agent(peer.name)
        del self._peers[peer.name], self._users[peer.name]
        self._idle_since.pop(peer.name, None)

    def read_spans(self, peer: _Peer) -> tuple[np.ndarray, np.ndarray]:
        """Where each block lies on both sides of a read from ``peer``: for each of this pool's
        ranks and each of the peer's ranks whose head ranges overlap (a span pair), the overlap
        of every block, one span on both sides (heads are a block's outermost dimension).

        Returns:
            ``(local, remote)`` strided NIXL descriptor arrays ``[num_span_pairs, 5]`` uint64 of
            ``(address of block 0, bytes, device id, block stride in bytes, number of blocks)``,
            pairwise; block ``b`` of span pair ``p`` is descriptor ``p * number of blocks + b``
            (:meth:`read_indices`).
        """
        head = self.pool.head_nbytes
        local, remote = [], []
        for part in self.pool.ranks:
            first, last = part.first_head, part.first_head + part.num_heads
            for base, device_id, src_first, src_heads in peer.ranks:
                low, high = max(first, src_first), min(last, src_first + src_heads)
                if low < high:
                    local.append((part.tensor.data_ptr() + (low - first) * head, (high - low) * head,
                                  _device_id(part.tensor), part.num_heads * head, self.pool.num_blocks))
                    remote.append((base + (low - src_first) * head, (high - low) * head, device_id,
                                   src_heads * head, peer.num_blocks))
        return np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64)

    def read_indices(self, peer: _Peer, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> tuple[np.ndarray, ...]:
        """The descriptors of :meth:`read_spans` that move ``peer``'s blocks ``src_blocks[i]``
        into this pool's ``dst_blocks[i]``, span pair by span pair: ``(local, remote)`` int32
        arrays ``[num_span_pairs * len(src_blocks)]``, pairwise. NIXL merges descriptors
        adjacent on both sides into one copy (the block pool allocates in runs where it can)."""
        src, dst = np.asarray(src_blocks, dtype=np.int32), np.asarray(dst_blocks, dtype=np.int32)
        if peer.num_span_pairs == 1:
            return dst, src
        pairs = np.arange(peer.num_span_pairs, dtype=np.int32)[:, None]
        return (pairs * self.pool.num_blocks + dst).ravel(), (pairs * peer.num_blocks + src).ravel()

    async def read(self, peer: _Peer, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """Copy ``peer``'s blocks ``src_blocks[i]`` into this pool's ``dst_blocks[i]``, each of
        this pool's ranks reading its KV heads from the peer's ranks that hold them
        (:meth:`read_spans`, prepared when the peer was added).

        Runs to completion even if the caller is cancelled meanwhile only when shielded: callers
        hold the destination blocks until this returns. Between host-memory pools UCX copies the
        bytes inside NIXL's ``transfer`` call itself (tens of milliseconds for a long prompt's
        blocks on a small host), so there the whole read runs in a thread of ``_POLL_THREADS``
        (NIXL releases the GIL meanwhile) and the event loop goes on serving the worker's other
        streams. A GPU read only starts in ``transfer``; it is polled from the event loop.

        Raises:
            StatusError: ``INVALID_ARGUMENT`` for a source block outside the peer's pool,
                ``UNAVAILABLE`` when NIXL reports the transfer failed (peer gone) or the peer has
                been forgotten here.
        """
        bad = [block for block in src_blocks if not 0 <= block < peer.num_blocks]
        if bad:
            raise StatusError.invalid_argument("source_block_ids", f"{bad[:4]} outside the sender's pool "
                                                                   f"of {peer.num_blocks} blocks")
        if self._peers.get(peer.name) is not peer:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"NIXL agent {peer.name!r} is no longer known here")
        local, remote = self.read_indices(peer, src_blocks, dst_blocks)
        polls = self._read_polls(peer, local, remote)
        self._hold(peer)  # (even past its stream's end: a cancelled stream's read runs on, shielded)
        try:
            if self.memory_type == "DRAM":  # the whole read, the handle's release included, in a thread
                state = await asyncio.get_running_loop().run_in_executor(_POLL_THREADS, _drive_blocking, polls)
            else:
                state = await _drive(polls)
        finally:
            self.release_peer(peer)
        if state != "DONE":
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"NIXL read from {peer.name} failed ({state})")

    def _read_polls(self, peer: _Peer, local: np.ndarray, remote: np.ndarray) -> Generator[float, None, str]:
        """Post the read of the ``remote`` descriptors of ``peer``'s prepared side into the
        ``local`` ones (:meth:`read_indices`) and yield the seconds to wait before each next look
        at its state, until it has ended; return its final state (``"DONE"`` or ``"ERR"``). Its
        handle is made on the first ``next`` and released at the end or when the generator is
        closed before it."""
        handle = self.agent.make_prepped_xfer("READ", peer.local_side, local, peer.remote_side, remote)
        try:
            state, delay = self.agent.transfer(handle), _POLL_MIN_S
            while state == "PROC":
                yield delay
                delay = min(2 * delay, _POLL_MAX_S)
                state = self.agent.check_xfer_state(handle)
            return state
        finally:
            self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        """Forget every peer and deregister the pool."""
        for peer in list(self._peers.values()):
            self._forget(peer)
        for registration in self._registrations:
            self.agent.deregister_memory(registration)


async def _poll_sleep(seconds: float) -> None:
    """Sleep ``seconds`` (tens of microseconds and up) with the kernel's timer resolution: in a
    thread of ``_POLL_THREADS``, which wakes the event loop through its self-pipe when done.
    Hand-written because asyncio's own timers are whole milliseconds here (above)."""
    await asyncio.get_running_loop().run_in_executor(_POLL_THREADS, time.sleep, seconds)


async def _drive(polls: Generator[float, None, str]) -> str:
    """Run a read's polls (:meth:`NixlAgent._read_polls`) to the end from the event loop, each
    wait slept off it (:func:`_poll_sleep`); return the read's final state."""
    try:
        while True:
            await _poll_sleep(next(polls))
    except StopIteration as end:
        return end.value
    finally:
        polls.close()


def _drive_blocking(polls: Generator[float, None, str]) -> str:
    """Run a read's polls to the end in this thread, sleeping in between; return its final state."""
    try:
        while True:
            time.sleep(next(polls))
    except StopIteration as end:
        return end.value


def _device_id(tensor: torch.Tensor) -> int:
    """The GPU index of ``tensor`` for NIXL (0 for host memory)."""
    return tensor.get_device() if tensor.is_cuda else 0
