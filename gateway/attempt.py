"""One try of a request on one route: Admit on the decode worker, then the prefill where the
placement puts it (Prefill on the prefill worker or on a decode worker lent to it, or a Decode
that prefills locally), and the release of everything the try still owes, whatever way it ends.

Conditional disaggregation: ``Admit`` tells how many leading prompt blocks the decode worker
already holds; the decode worker prefills the rest itself (no KV moves) when the pool has no
prefill worker, when at most ``local_prefill_max_tokens`` are left (Dynamo's static
threshold), or when that is predicted to meet the request's latency objectives better than a
prefill worker would (:mod:`gateway.placement`); another decode worker that serves prefill
(the route's lender) is called like a prefill worker when it is predicted to serve them better
than both. A prefill's timeout (the Prefill call, or a local prefill's first Decode message)
grows with the prompt at the worker's measured pace (:mod:`gateway.prefill_pace`), so a long
prompt is not a failure.

Release: the try's calls are cancelled, every worker that may still hold something of it is told
to ``Abort`` (in the background: the caller may be a cancelled task) and the routing counts are
given back, exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from cluster import tracing
from cluster.registry import shares_device
from gateway import metrics
from gateway.placement import LENT, Lender, Placement, PlacementModel
from gateway.prefill_pace import PrefillPace
from gateway.request import CheckedRequest
from gateway.router import ClusterView, Route
from gateway.worker_calls import TimeLeft, WorkerCalls, remaining
from protos.status import StatusError
from protos.tandem.v1 import worker_pb2

_ABORT_TIMEOUT_S = 2.0


@dataclass
class Attempt:
    """Where one try of the request runs, and what is still owed for it.

    ``route``: as routed; once placement lends the prefill to the route's lender, the route with
    the lender as its prefill worker (:meth:`ClusterView.lend`). ``*_counted``: the ClusterView
    still counts the request on that worker (``prefill_done`` / ``decode_done`` not yet called).
    ``*_holds``: the worker may still hold state of the request (it gets an Abort at release). ``decode_call``: the Decode stream once started
    (already with the first message read, for a local prefill: ``first_messages``).
    ``kv_spot_check``: the decode worker spot-checks the received KV before it decodes (its
    Admit said so): the prefill's first tokens wait for the Decode stream's first message.
    """

    route: Route
    worker_request_id: str
    cache_salt: str = ""
    reservation_id: str = ""
    prefill_counted: bool = True
    decode_counted: bool = True
    prefill_holds: bool = True
    decode_holds: bool = True
    calls: list = field(default_factory=list)
    decode_call: object = None
    first_messages: list = field(default_factory=list)
    decode_cached_tokens: int = 0
    kv_spot_check: bool = False

    def __post_init__(self) -> None:
        if self.route.prefill is None:  # the decode worker prefills: nothing to release on a prefill worker
            self.prefill_counted = self.prefill_holds = False

    def trace_attributes(self, retries: int) -> dict[str, object]:
        """The attributes of this try's span: its workers and how many tries failed before it."""
        route = self.route
        return {"tandem.worker_request_id": self.worker_request_id, "tandem.retries": retries,
                "tandem.prefill_worker": route.prefill.worker_id if route.prefill is not None else "none (local)",
                "tandem.decode_worker": route.decode.worker_id}


@dataclass
class _Prefill:
    """One prefill being timed: the prompt tokens it computes."""

    tokens: int


class Attempts:
    """Runs tries and releases them.

    Args:
        view: the routing state.
        calls: how worker calls are made and awaited.
        placement: where each prompt is prefilled.
        pace: each worker's measured prefill pace (a prefill's timeout).
    """

    def __init__(self, view: ClusterView, calls: WorkerCalls, placement: PlacementModel, pace: PrefillPace) -> None:
        self.view = view
        self.calls = calls
        self.clients = calls.clients
        self.placement = placement
        self.pace = pace
        self._background: set[asyncio.Task] = set()

    async def admit_and_prefill(self, attempt: Attempt, request: CheckedRequest,
                                time_left: TimeLeft) -> worker_pb2.PrefillResponse | None:
        """Admit, then Prefill on the prefill worker (its response), or start a Decode that
        prefills locally and read its first message (``None``: the first tokens come with it),
        as the placement decides.

        Raises:
            gateway.worker_calls.WorkerCallError: a call failed.
            StatusError: the decode worker ended the stream before a token (``INTERNAL``).
        """
        route, rid, calls = attempt.route, attempt.worker_request_id, self.calls
        prompt, sampling, pool = request.prompt, request.sampling, request.pool
        quarantine = self.view.quarantine
        suspect = quarantine is not None and any(w is not None and quarantine.on_probation(w.worker_id)
                                                 for w in (route.prefill, route.lender))
        admit = self.clients.decode(route.decode.address).Admit(
            worker_pb2.AdmitRequest(request_id=rid, prompt_token_ids=prompt, cache_salt=attempt.cache_salt,
                                    sampling=sampling, kv_spot_check=suspect),
            timeout=calls.hop_timeout(time_left))
        attempt.calls.append(admit)
        admitted = await calls.staged(admit, "Admit", route.decode, time_left)
        attempt.reservation_id = admitted.reservation_id
        attempt.kv_spot_check = admitted.kv_spot_check
        attempt.decode_cached_tokens = admitted.num_cached_blocks * pool.block_size
        local_tokens = len(prompt) - attempt.decode_cached_tokens
        remote_tokens = len(prompt) - route.cached_blocks * pool.block_size
        shared = route.prefill is not None and shares_device(route.prefill.config, route.decode.config)
        lender = None if route.lender is None else Lender(
            route.lender.worker_id, len(prompt) - route.lender_cached_blocks * pool.block_size,
            route.lender.load.running, route.lender.config.max_num_batched_tokens)
        placement = self.placement.decide(route.prefill.worker_id if route.prefill else None, remote_tokens,
                                          route.decode.worker_id, local_tokens, route.decode.load.running, request.slo,
                                          route.decode.config.max_num_batched_tokens, shared_device=shared,
                                          lender=lender)
        metrics.PLACEMENTS.labels(placement.kind).inc()
        tracing.annotate({"tandem.placement": placement.kind})
        if placement.kind == LENT:  # the lender is called as the prefill worker from here on
            attempt.route = route = self.view.lend(route, request.block_hashes)
            attempt.prefill_counted = attempt.prefill_holds = True
            remote_tokens = lender.tokens
        if placement.local:
            attempt.prefill_counted = attempt.prefill_holds = False
            self.view.prefill_done(route)
            call = self.decode_call(attempt, request, [], time_left, local_prefill=True)
            timeout_s = calls.hop_timeout(time_left, self.pace.timeout_s(
                route.decode.worker_id, self.placement.queued(route.decode.worker_id) + local_tokens))
            with self._prefilling(route.decode.worker_id, local_tokens, placement):
                first = await calls.staged(calls.next_message(call, timeout_s), "Decode", route.decode, time_left,
                                           timeout_s)
            if first is grpc.aio.EOF:
                raise StatusError(grpc.StatusCode.INTERNAL, "the decode worker ended the stream before a token")
            attempt.first_messages.append(first)
            metrics.PREFILLS.labels("local", "none").inc()
            return None
        destination = worker_pb2.KVDestination(address=route.decode.address, reservation_id=admitted.reservation_id,
                                               layout=admitted.layout, num_cached_blocks=admitted.num_cached_blocks,
                                               kv_transports=admitted.kv_transports)
        timeout_s = calls.hop_timeout(time_left, self.pace.timeout_s(
            route.prefill.worker_id, self.placement.queued(route.prefill.worker_id) + len(prompt)))
        prefill = self.clients.prefill_on(route.prefill).Prefill(
            worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                      destination=destination, cache_salt=attempt.cache_salt,
                                      num_resumed_tokens=request.num_resumed_tokens),
            timeout=timeout_s)
        attempt.calls.append(prefill)
        with self._prefilling(route.prefill.worker_id, remote_tokens, placement) as measured:
            response = await calls.staged(prefill, "Prefill", route.prefill, time_left, timeout_s,
                                          watched=(route.prefill, route.decode))
            measured.tokens = len(prompt) - response.num_cached_tokens
        attempt.prefill_counted = attempt.prefill_holds = False
        self.view.prefill_done(route)
        metrics.PREFILLS.labels(placement.kind if placement.kind == LENT else "remote", response.kv_transport).inc()
        return response

    def decode_call(self, attempt: Attempt, request: CheckedRequest, first_ids: list[int], time_left: TimeLeft,
                    local_prefill: bool = False):
        """Start the try's Decode stream of ``request`` (as the workers get it) after ``first_ids``
        (the client's deadline as its timeout)."""
        call = self.clients.decode(attempt.route.decode.address).Decode(
            worker_pb2.DecodeRequest(request_id=attempt.worker_request_id, reservation_id=attempt.reservation_id,
                                     prompt_token_ids=request.prompt, first_token_ids=first_ids,
                                     sampling=request.sampling, local_prefill=local_prefill,
                                     cache_salt=attempt.cache_salt, num_resumed_tokens=request.num_resumed_tokens,
                                     kv_spot_check=attempt.kv_spot_check and not local_prefill),
            timeout=remaining(time_left))
        attempt.calls.append(call)
        attempt.decode_call = call
        return call

    @contextlib.contextmanager
    def _prefilling(self, worker_id: str, tokens: int, placement: Placement) -> Iterator[_Prefill]:
        """Count a prefill of ``tokens`` prompt tokens in ``worker_id``'s queue while the block
        runs; when the block succeeds, record the worker's pace over the tokens it computed
        meanwhile (the ones queued ahead, and ``tokens`` or what the block sets in the yielded
        :class:`_Prefill`; net of the decode steps a local one was predicted to ride) and how the
        placement's prediction fared."""
        prefill, ahead = _Prefill(tokens), self.placement.queued(worker_id)
        self.placement.started(worker_id, tokens)
        started = time.monotonic()
        try:
            yield prefill
        finally:
            self.placement.ended(worker_id, tokens)
        elapsed = time.monotonic() - started
        self.placement.observe_prefill(worker_id, ahead + prefill.tokens, elapsed, placement)
        if placement.predicted_ttft_s:
            metrics.PREFILL_PREDICTION.observe(elapsed / placement.predicted_ttft_s)

    # -- release ---------------------------------------------------------------------------

    def release(self, attempt: Attempt, reason: str) -> None:
        """Cancel the try's calls, Abort what the workers may still hold, release routing counts."""
        for call in attempt.calls:
            call.cancel()
        attempt.calls.clear()
        route, rid = attempt.route, attempt.worker_request_id
        if attempt.prefill_counted:
            self.view.prefill_done(route)
        if attempt.decode_counted:
            self.view.decode_done(route)
        if attempt.prefill_holds:
            self._abort(self.clients.prefill_on(route.prefill), rid, reason)
        if attempt.decode_holds:
            self._abort(self.clients.decode(route.decode.address), rid, reason)
        attempt.prefill_counted = attempt.decode_counted = attempt.prefill_holds = attempt.decode_holds = False

    def _abort(self, stub, request_id: str, reason: str) -> None:
        """Send Abort in the background: the caller may be a cancelled task that cannot await."""

        async def abort() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Abort(worker_pb2.AbortRequest(request_id=request_id, reason=reason),
                                 timeout=_ABORT_TIMEOUT_S)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain_aborts(self) -> None:
        """Wait for outstanding Abort calls (at shutdown)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=_ABORT_TIMEOUT_S)
