"""Calls to the workers as the orchestrator makes them: the stubs, each call's timeout (its hop
timeout or the client's deadline, whichever is sooner), the outlier accounting of a worker's own
failures and successes, the health probe's verdict ending a wait at once, and the status a
client gets for a worker error.

A call that fails before the client has a token comes out as :class:`WorkerCallError` (retried
elsewhere by :mod:`gateway.failover` when the worker is at fault); a Decode stream that fails
after it comes out as :class:`DecodeLost` (resumed elsewhere when its tokens are reproducible).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from cluster.channels import ChannelCache
from cluster.registry import Role, WorkerInfo
from gateway import metrics
from gateway.router import ClusterView
from protos.status import StatusError
from protos.tandem.v1 import worker_pb2_grpc

# Worker failures worth one transparent retry elsewhere, while the client has seen nothing
# (PERMISSION_DENIED: a worker refused its peer, e.g. a prefill worker that does not find the
# decode worker in the registry: the cluster's state, not the client's permission; CANCELLED: a
# worker's server stopped with the call in it, e.g. a drain that ran out of time: the client's
# own cancellation reaches the gateway as asyncio's CancelledError, never as a call's status).
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED,
             grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.CANCELLED}

TimeLeft = Callable[[], float | None]


class WorkerClients:
    """Stubs of the workers' services over caches of channels: one for decode workers and one
    for prefill workers (with TLS each checks that the peer's certificate is of that role).

    Args:
        channels: channels to decode workers (and to prefill workers when ``prefill_channels``
            is ``None``).
        prefill_channels: channels to prefill workers.
    """

    def __init__(self, channels: ChannelCache, prefill_channels: ChannelCache | None = None) -> None:
        self.channels = channels
        self.prefill_channels = channels if prefill_channels is None else prefill_channels

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channels.get(address))

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.prefill_channels.get(address))

    def prefill_on(self, worker: WorkerInfo) -> worker_pb2_grpc.PrefillWorkerStub:
        """``PrefillWorker`` on ``worker``, over the channels of its role: a prefill worker, or a
        decode worker lent to a prefill (``gateway.placement``'s ``lent``)."""
        return worker_pb2_grpc.PrefillWorkerStub(self.for_role(worker.role).get(worker.address))

    def for_role(self, role: Role) -> ChannelCache:
        """The cache of channels to workers of ``role``."""
        return self.prefill_channels if role == Role.PREFILL else self.channels


class WorkerCallError(Exception):
    """A worker call failed before the client had a token.

    Attributes:
        stage: the call (Admit, Prefill, Decode).
        code: its status (UNAVAILABLE for a stalled stream).
        details: its message.
        worker_fault: the worker failed (UNAVAILABLE, or no answer within the per-hop or stall
            timeout while the client's deadline had not passed): worth a retry elsewhere.
        culprit: the one worker known to have failed (the health probe found it down), or
            ``None``: any worker the stage involves may be at fault.
    """

    def __init__(self, stage: str, code: grpc.StatusCode, details: str, worker_fault: bool,
                 culprit: str | None = None) -> None:
        super().__init__(f"{stage}: {code.name} {details}")
        self.stage, self.code, self.details, self.worker_fault = stage, code, details, worker_fault
        self.culprit = culprit


class DecodeLost(Exception):
    """The Decode stream failed or stalled after the client had tokens (``status``: what the
    client gets unless the request is resumed elsewhere)."""

    def __init__(self, status: StatusError, worker_id: str) -> None:
        super().__init__(status.message)
        self.status, self.worker_id = status, worker_id


class WorkerDown(Exception):
    """The health probe found ``worker_id`` down while a call waited on it."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.worker_id = worker_id


def remaining(time_left: TimeLeft) -> float | None:
    """The client's remaining time for the next hop, seconds; ``None`` when it set no deadline."""
    left = time_left()
    if left is None or left > 1e8:  # grpc reports "no deadline" as a huge number
        return None
    return max(left, 0.001)


def expired(time_left: TimeLeft) -> bool:
    """Whether the client's deadline has passed (or is about to)."""
    left = remaining(time_left)
    return left is not None and left <= 0.01


def client_status(failure: WorkerCallError) -> StatusError:
    """The client's status for a worker error that is not retried (a worker's own failure,
    a per-hop or stall timeout included: UNAVAILABLE). The message names the call, but for an
    INVALID_ARGUMENT the worker found in the request: that one starts with the field, as the
    gateway's own refusals do."""
    code = failure.code
    if failure.worker_fault or code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.UNAVAILABLE
    elif code == grpc.StatusCode.UNKNOWN:
        code = grpc.StatusCode.INTERNAL
    elif code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        code = grpc.StatusCode.UNAVAILABLE  # a lost reservation, a refused peer: the cluster's fault, not the client's
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        return StatusError(code, failure.details)
    return StatusError(code, f"{failure.stage}: {failure.details}")


class WorkerCalls:
    """Awaiting worker calls with their timeouts and the outlier detector's accounting.

    Args:
        view: the routing state (its outlier detector and the health probe's signals).
        clients: stubs of the workers.
        hop_timeout_s: seconds a unary call may take (sooner: the client's deadline).
        decode_stall_timeout_s: seconds a Decode stream may go without a message.
    """

    def __init__(self, view: ClusterView, clients: WorkerClients, hop_timeout_s: float,
                 decode_stall_timeout_s: float) -> None:
        self.view = view
        self.clients = clients
        self.hop_timeout_s = hop_timeout_s
        self.decode_stall_timeout_s = decode_stall_timeout_s

    def hop_timeout(self, time_left: TimeLeft, hop_s: float | None = None) -> float:
        """The timeout of one worker call: ``hop_s`` (default ``hop_timeout_s``) or the
        client's deadline, whichever is sooner."""
        hop_s = self.hop_timeout_s if hop_s is None else hop_s
        left = remaining(time_left)
        return hop_s if left is None else min(left, hop_s)

    async def next_message(self, call, timeout_s: float | None = None):
        """The Decode stream's next message (``grpc.aio.EOF`` at its end).

        Args:
            timeout_s: seconds to wait (default ``decode_stall_timeout_s``; a local prefill's
                first message takes the prefill's time and gets the per-hop timeout).

        Raises:
            TimeoutError: none came in time.
            grpc.aio.AioRpcError: the call failed.
        """
        async with asyncio.timeout(timeout_s or self.decode_stall_timeout_s):
            return await call.read()

    async def staged(self, awaitable, stage: str, worker: WorkerInfo, time_left: TimeLeft,
                     timeout_s: float | None = None, watched: tuple[WorkerInfo, ...] = ()):
        """Await one step of a worker call (a unary call, or a stream's next message) before the
        client's first token; its failure comes out as :class:`WorkerCallError`, and the
        worker's own failures and successes go to the outlier detector. The health probe finding
        the worker (or one of ``watched``, default: the worker) down ends the wait at once as a
        failure of that worker's: a frozen worker is left within the probe's interval and
        timeout, not after a prefill's timeout, which grows with the prompt.

        A failed Prefill counts against the prefill worker only when the gateway's connection
        to it is down (keepalive closes the connection of a frozen worker too): an UNAVAILABLE
        or a timeout with the connection up may be its KV transfer's (the decode worker's
        fault), which the health probe judges instead. ``timeout_s``: the call's hop timeout
        (for the message; default ``hop_timeout_s``).
        """
        outliers = self.view.outliers
        try:
            result = await self._unless_down(awaitable, watched or (worker,))
        except WorkerDown as down:
            raise WorkerCallError(stage, grpc.StatusCode.UNAVAILABLE,
                                  f"worker {down.worker_id} failed its health probe", True, down.worker_id) from down
        except TimeoutError as exc:
            outliers.failure(worker.worker_id)
            metrics.WORKER_FAILURES.labels(stage).inc()
            raise WorkerCallError(stage, grpc.StatusCode.UNAVAILABLE, "no first message within the per-hop timeout",
                                  True) from exc
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            hop_timeout = code == grpc.StatusCode.DEADLINE_EXCEEDED and not expired(time_left)
            fault = code == grpc.StatusCode.UNAVAILABLE or hop_timeout
            if fault and (stage != "Prefill" or
                          self.clients.for_role(worker.role).state(worker.address) != grpc.ChannelConnectivity.READY):
                outliers.failure(worker.worker_id)
                metrics.WORKER_FAILURES.labels(stage).inc()
            details = (f"no answer within {timeout_s or self.hop_timeout_s:.1f} s" if hop_timeout
                       else exc.details())
            raise WorkerCallError(stage, code, details or "", fault) from exc
        outliers.success(worker.worker_id)
        return result

    async def _unless_down(self, awaitable, workers: tuple[WorkerInfo, ...]):
        """``awaitable``'s result, unless the health probe finds one of ``workers`` down first (a
        worker already down is not watched: routing chose it for want of another).

        Raises:
            WorkerDown: the probe's verdict came first; ``awaitable`` is cancelled.
        """
        signals = {w.worker_id: self.view.outliers.down_signal(w.worker_id) for w in workers}
        watchers = {asyncio.ensure_future(signal.wait()): worker_id
                    for worker_id, signal in signals.items() if not signal.is_set()}
        if not watchers:
            return await awaitable
        step = asyncio.ensure_future(awaitable)
        try:
            done, _ = await asyncio.wait({step, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for watcher in (step, *watchers):
                watcher.cancel()
        if step in done:
            return step.result()
        raise WorkerDown(next(worker_id for watcher, worker_id in watchers.items() if watcher in done))
