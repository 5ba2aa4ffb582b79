"""Getting a request its first token despite failed workers and a full decode pool, and resuming
a stream whose decode worker was lost.

Failover (docs/architecture.md, "Failures"): a worker failure before the client has seen a
token (UNAVAILABLE, a connection failure, a lost reservation, no answer within
``hop_timeout_s``, a Decode stream silent for ``decode_stall_timeout_s``, the health probe
finding the worker down while the gateway waits on it) is retried up to ``max_retries`` times,
each time on workers the request has not failed on yet (other workers of the role where any
exist); after that the client gets UNAVAILABLE. Failures of a worker's own (the call to it
failed or timed out, not the KV transfer it made to its peer) are counted in the view's outlier
detector, which ejects a worker failing repeatedly. Decode capacity (``NoCapacityError`` or
Admit's RESOURCE_EXHAUSTED) is waited for up to ``admit_wait_s`` with backoff, a small
admission queue, then answered RESOURCE_EXHAUSTED (DEADLINE_EXCEEDED when the client's deadline
comes first).

Resume: once the client has tokens, a failed or stalled Decode stream
(:class:`~gateway.worker_calls.DecodeLost`) is resumed on another decode worker when its tokens
are reproducible: one sample (``n`` = 1) that is greedy or seeded (the sampler's noise depends
only on the seed, the sample and the position, ``kernels/sampling.py``), or when it has none yet
(a spot-checked request's first tokens wait for the check). The prompt plus the
tokens already sent is prefilled again (Admit → Prefill → Decode, on workers other than the
failed one) with ``max_tokens`` reduced by them, and the stream goes on where it stopped: the
client sees one stream, its usage counting the original prompt and every output token. At most
``max_retries`` resumes per request. Any other request (unseeded sampling, ``n`` > 1) ends with
the lost stream's UNAVAILABLE: the tokens already sent cannot be taken back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from cluster import tracing
from gateway import metrics
from gateway.attempt import Attempt, Attempts
from gateway.request import CheckedRequest
from gateway.router import ClusterView, NoCapacityError, NoWorkerError, Route
from gateway.worker_calls import RETRYABLE, DecodeLost, TimeLeft, WorkerCallError, client_status, expired, remaining
from protos.status import StatusError
from protos.tandem.v1 import worker_pb2

logger = logging.getLogger(__name__)


class Failover:
    """Tries a request until a route serves its first token.

    Args:
        view: the routing state.
        attempts: runs and releases each try.
        max_retries: tries on other workers after worker failures before the first token, and
            resumes after the decode worker was lost mid-stream.
        admit_wait_s: longest wait for decode capacity before RESOURCE_EXHAUSTED, seconds.
    """

    def __init__(self, view: ClusterView, attempts: Attempts, max_retries: int, admit_wait_s: float) -> None:
        self.view = view
        self.attempts = attempts
        self.max_retries = max_retries
        self.admit_wait_s = admit_wait_s

    async def first_token(self, request: CheckedRequest, time_left: TimeLeft,
                          avoid: frozenset[str] = frozenset()) -> tuple[Attempt, worker_pb2.PrefillResponse | None]:
        """Route the request (as the workers get it: a resumed one carries the tokens sent) and
        run tries until one has the first tokens: the try and its PrefillResponse (``None``: a
        local prefill, the first tokens are the Decode stream's first message).

        Raises:
            StatusError: the status the client gets.
        """
        retries = 0
        capacity = _Backoff(self.admit_wait_s)
        while True:
            with tracing.span("route"):
                route = await self._choose(request.block_hashes, len(request.prompt), avoid, capacity, time_left)
            attempt = Attempt(route, f"{request.request_id}-{uuid.uuid4().hex[:8]}", request.cache_salt)
            try:
                with tracing.span("retry" if retries else "attempt", attempt.trace_attributes(retries)):
                    first = await self.attempts.admit_and_prefill(attempt, request, time_left)
                return attempt, first
            except asyncio.CancelledError:
                self.attempts.release(attempt, "client cancelled")
                raise
            except WorkerCallError as failure:
                self.attempts.release(attempt, f"{failure.stage} failed")
                code = failure.code
                level = logging.DEBUG if code == grpc.StatusCode.RESOURCE_EXHAUSTED else logging.WARNING
                logger.log(level, "%s failed on %s: %s %s", failure.stage, _workers(attempt.route), code.name,
                           failure.details)
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    await capacity.wait(time_left, client_status(failure))
                    continue
                if (failure.worker_fault or code in RETRYABLE) and retries < self.max_retries \
                        and not expired(time_left):
                    retries += 1
                    metrics.RETRIES.inc()
                    avoid = avoid | (frozenset({failure.culprit}) if failure.culprit
                                     else _involved(attempt.route, failure.stage))
                    continue
                raise client_status(failure) from failure
            except BaseException:
                self.attempts.release(attempt, "gateway error")
                raise

    async def resume(self, request: CheckedRequest, sent: list[int], lost: DecodeLost, resumes: int,
                     time_left: TimeLeft) -> tuple[Attempt, worker_pb2.PrefillResponse | None, CheckedRequest] | None:
        """The try that goes on after the ``sent`` tokens of the one sample, ``lost`` being the
        stream that failed (the ``resumes``-th resume).

        Returns:
            ``(attempt, first, resumed)`` (``resumed``: the request as the workers get it now,
            :meth:`CheckedRequest.resumed`), or ``None`` when ``sent`` already reached
            ``max_tokens`` (what got lost was the last token's finish: the sample ends LENGTH).

        Raises:
            StatusError: ``lost``'s status when the request cannot be resumed (``n`` > 1,
                unseeded sampling, ``max_retries`` resumes spent, the deadline passed), or the
                status of the resumed request's failure.
        """
        params = request.params
        reproducible = params.n == 1 and (params.greedy or params.seed is not None)
        if (sent and not reproducible) or resumes > self.max_retries or expired(time_left):
            raise lost.status from lost
        if len(sent) >= params.max_tokens:
            return None
        metrics.RESUMES.inc()
        logger.warning("resuming request %s after %d tokens on another decode worker (%s lost)",
                       request.request_id, len(sent), lost.worker_id)
        resumed = request.resumed(sent)
        with tracing.span("resume", {"tandem.resume": resumes, "tandem.tokens_sent": len(sent),
                                     "tandem.lost_worker": lost.worker_id, "tandem.lost_reason": str(lost)}):
            attempt, first = await self.first_token(resumed, time_left, avoid=frozenset({lost.worker_id}))
        return attempt, first, resumed

    async def _choose(self, hashes, prompt_len: int, avoid: frozenset[str], capacity: _Backoff,
                      time_left: TimeLeft) -> Route:
        """``view.choose``, waiting for decode capacity within ``capacity``'s budget."""
        while True:
            try:
                return await self.view.choose(hashes, prompt_len, exclude=avoid)
            except NoWorkerError as exc:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
            except NoCapacityError as exc:
                overload = StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"over capacity: {exc}")
                await capacity.wait(time_left, overload)


class _Backoff:
    """A budget of ``total_s`` seconds of waiting for capacity, spent in growing sleeps; the
    clock starts at the first wait, not when the request arrived (a long prefill before a
    retry does not eat it). While it sleeps, the request counts in the
    ``tandem_gateway_requests_waiting`` gauge."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.deadline: float | None = None
        self.delay = 0.02

    async def wait(self, time_left: TimeLeft, overload: StatusError) -> None:
        """Sleep before the next try.

        Args:
            time_left: seconds until the client's deadline (``None``: none).
            overload: the RESOURCE_EXHAUSTED the client gets once the budget is spent.

        Raises:
            StatusError: ``overload`` (no sleep) when the budget ends before the next try;
                DEADLINE_EXCEEDED, naming the overload, when the client's deadline comes first.
        """
        now = time.monotonic()
        self.deadline = self.deadline or now + self.total_s
        budget_s, client_s = self.deadline - now, remaining(time_left)
        if client_s is not None and client_s < min(self.delay, budget_s):
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"waited for capacity until the client's deadline: {overload.message}")
        if budget_s <= self.delay:
            raise overload
        with metrics.WAITING.track_inprogress(), tracing.span("wait_for_capacity", {"tandem.wait_s": self.delay}):
            await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, 0.5)


def _involved(route: Route, stage: str) -> frozenset[str]:
    """The workers a failure at ``stage`` may be the fault of (a failed Prefill: either side,
    its KV transfer goes to the decode worker; a lent prefill's side is the lender, the route's
    prefill worker by then)."""
    if stage == "Prefill" and route.prefill is not None:
        return frozenset({route.prefill.worker_id, route.decode.worker_id})
    return frozenset({route.decode.worker_id})


def _workers(route: Route) -> str:
    prefill = route.prefill.worker_id if route.prefill is not None else "none (local)"
    return f"prefill {prefill} / decode {route.decode.worker_id}"
