"""One Generate request across the cluster: route, Admit → Prefill → Decode (or Admit → Decode
with a local prefill), stream, clean up.

The servicer hands a checked request to :meth:`Orchestrator.run`, an async generator of
``GenerateResponse``. Errors come out as :class:`protos.status.StatusError`; whatever way the
generator ends (finished, stop string, error, client cancellation, deadline), every worker
that may still hold something of the request is told to ``Abort`` and the routing counts are
released, exactly once.

Who decides what: the workers decide when a sample ends on its tokens (EOS, stop token ids,
``max_tokens``, ``max_model_len``; the prefill worker for the first token, the decode worker
after it); the gateway owns the text: it detokenizes and ends a sample whose text contains a
stop string.

Conditional disaggregation: ``Admit`` tells how many leading prompt blocks the decode worker
already holds; the decode worker prefills the rest itself (no KV moves) when the pool has no
prefill worker, when at most ``local_prefill_max_tokens`` are left (Dynamo's static
threshold), or when that is predicted to meet the request's latency objectives better than a
prefill worker would (:mod:`gateway.placement`).

Failover (docs/architecture.md, "Failures"): a worker failure before the client has seen a
token (UNAVAILABLE, a connection failure, a lost reservation, no answer within
``hop_timeout_s``, a Decode stream silent for ``decode_stall_timeout_s``, the health probe
finding the worker down while the gateway waits on it) is retried up to
``max_retries`` times, each time on workers the request has not failed on yet (other workers
of the role where any exist); after that the client gets UNAVAILABLE. A prefill's timeout
(the Prefill call, or a local prefill's first Decode message) grows with the prompt at the
worker's measured pace (:mod:`gateway.prefill_pace`), so a long prompt is not a failure. Failures of a worker's
own (the call to it failed or timed out, not the KV transfer it made to its peer) are counted
in the view's outlier detector, which ejects a worker failing repeatedly. Once the client has
tokens, a failed or stalled Decode stream (UNAVAILABLE, NOT_FOUND, ABORTED, silent for
``decode_stall_timeout_s``) is **resumed** on another decode worker when its tokens are
reproducible: one sample (``n`` = 1) that is greedy or seeded (the sampler's noise depends only
on the seed, the sample and the position, ``kernels/sampling.py``). The prompt plus the tokens
already sent is prefilled again (Admit → Prefill → Decode, on workers other than the failed
one) with ``max_tokens`` reduced by them, and the stream goes on where it stopped: the client
sees one stream, its usage counting the original prompt and every output token. At most
``max_retries`` resumes per request. Any other request (unseeded sampling, ``n`` > 1) ends
with UNAVAILABLE: the tokens already sent cannot be taken back. Every worker call
but the Decode stream gets its hop timeout or the client's deadline, whichever is sooner; the
Decode stream gets the client's deadline and ``decode_stall_timeout_s`` between messages.
Decode capacity (``NoCapacityError`` or Admit's RESOURCE_EXHAUSTED) is waited for
up to ``admit_wait_s`` with backoff, a small admission queue, then answered
RESOURCE_EXHAUSTED (DEADLINE_EXCEEDED when the client's deadline comes first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import grpc

from cluster import tracing
from cluster.channels import ChannelCache
from cluster.registry import Role, WorkerConfig, WorkerInfo, shares_device
from engine.block_hash import hash_blocks, salted_seed
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from gateway import metrics
from gateway.placement import Placement, PlacementModel, ServiceLevel
from gateway.prefill_pace import PrefillPace
from gateway.router import ClusterView, NoCapacityError, NoWorkerError, Route
from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

STOP, LENGTH, ABORT = gateway_pb2.FINISH_REASON_STOP, gateway_pb2.FINISH_REASON_LENGTH, gateway_pb2.FINISH_REASON_ABORT
# Worker failures worth one transparent retry elsewhere, while the client has seen nothing
# (PERMISSION_DENIED: a worker refused its peer, e.g. a prefill worker that does not find the
# decode worker in the registry: the cluster's state, not the client's permission; CANCELLED: a
# worker's server stopped with the call in it, e.g. a drain that ran out of time: the client's
# own cancellation reaches the gateway as asyncio's CancelledError, never as a call's status).
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED,
              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.CANCELLED}
_ABORT_TIMEOUT_S = 2.0


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

    def for_role(self, role: Role) -> ChannelCache:
        """The cache of channels to workers of ``role``."""
        return self.prefill_channels if role == Role.PREFILL else self.channels


@dataclass
class _Sample:
    """Output state of one sample (index ``i`` of ``n``)."""

    def __init__(self, detok: IncrementalDetokenizer | None) -> None:
        self.detok = detok
        self.token_ids: list[int] = []  # sent to the client
        self.finish = 0  # FinishReason; 0 while it streams

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish != 0


@dataclass
class _Attempt:
    """Where one try of the request runs, and what is still owed for it.

    ``*_counted``: the ClusterView still counts the request on that worker (``prefill_done``
    / ``decode_done`` not yet called). ``*_holds``: the worker may still hold state of the
    request (it gets an Abort at release). ``decode_call``: the Decode stream once started
    (already with the first message read, for a local prefill: ``first_messages``).
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

    def __post_init__(self) -> None:
        if self.route.prefill is None:  # the decode worker prefills: nothing to release on a prefill worker
            self.prefill_counted = self.prefill_holds = False


@dataclass
class _Output:
    """What the client has been sent: each sample's state, and the usage of the whole request."""

    samples: list[_Sample]
    usage: gateway_pb2.Usage
    max_tokens: int  # output tokens a sample may reach (max_tokens, within max_model_len)


@dataclass
class _Prefill:
    """One prefill being timed: the prompt tokens it computes."""

    tokens: int


class _DecodeLost(Exception):
    """The Decode stream failed or stalled after the client had tokens (``status``: what the
    client gets unless the request is resumed elsewhere)."""

    def __init__(self, status: StatusError, worker_id: str) -> None:
        super().__init__(status.message)
        self.status, self.worker_id = status, worker_id


class _WorkerCallError(Exception):
    """A worker call failed.

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


class _WorkerDown(Exception):
    """The health probe found ``worker_id`` down while a call waited on it."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.worker_id = worker_id


class Orchestrator:
    """Drives requests through the cluster.

    Args:
        view: the routing state (``ClusterView``).
        clients: stubs of the workers.
        tokenizer: the model's tokenizer, for the text of the outputs (``None``: tokens only).
        admit_wait_s: longest wait for decode capacity before RESOURCE_EXHAUSTED, seconds.
        local_prefill_max_tokens: the decode worker prefills a request itself when at most this
            many prompt tokens are left after its prefix hit.
        max_retries: tries on other workers after worker failures before the first token.
        hop_timeout_s: seconds an Admit call may take (sooner: the client's deadline); a prefill
            gets this plus its prompt's tokens at the worker's measured pace.
        decode_stall_timeout_s: seconds a Decode stream may go without a message.
        prefill_s_per_token: a prefill's seconds per prompt token before its worker's pace is measured.
        slo: the latency objectives of a request that sets none (:mod:`gateway.placement`).
        adaptive_placement: place each prefill by prediction; ``False``: a fixed split
            (:class:`~gateway.placement.PlacementModel`'s ``adaptive``).
    """

    def __init__(self, view: ClusterView, clients: WorkerClients, tokenizer: Tokenizer | None,
                 admit_wait_s: float, local_prefill_max_tokens: int, max_retries: int, hop_timeout_s: float,
                 decode_stall_timeout_s: float, prefill_s_per_token: float, slo: ServiceLevel,
                 adaptive_placement: bool) -> None:
        self.view = view
        self.clients = clients
        self.tokenizer = tokenizer
        self.admit_wait_s = admit_wait_s
        self.max_retries = max_retries
        self.hop_timeout_s = hop_timeout_s
        self.decode_stall_timeout_s = decode_stall_timeout_s
        self.pace = PrefillPace(hop_timeout_s, prefill_s_per_token)
        self.placement = PlacementModel(self.pace, local_prefill_max_tokens, adaptive=adaptive_placement)
        self.default_slo = slo
        self._background: set[asyncio.Task] = set()

    async def run(
        self, request_id: str, prompt: list[int], sampling: gateway_pb2.SamplingParams, params: SamplingParams,
        pool: WorkerConfig, time_left: Callable[[], float | None], cache_salt: str = "",
        slo: ServiceLevel = ServiceLevel(),
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Stream the request's ``GenerateResponse`` messages; the last one carries ``usage``.

        Args:
            request_id: the client's (or gateway-made) id, echoed in every message.
            prompt: checked prompt token ids.
            sampling: the client's sampling parameters, passed to the workers as sent (each
                checks them itself).
            params: the same, as checked by the gateway (``n``, stop strings, logprobs).
            pool: the settings of the pool that serves the request (block size, hash seed).
            time_left: seconds until the client's deadline (``None``: none); every worker call
                gets it as its timeout.
            cache_salt: the tenant's prefix-cache salt (``""``: none): routing and every
                worker's prefix cache see the prompt's blocks under it only.
            slo: the request's latency objectives (unset ones: the gateway's).

        Raises:
            StatusError: the status the client gets.
        """
        started = time.monotonic()
        slo = slo.or_defaults(self.default_slo)
        hash_seed = salted_seed(pool.hash_seed, cache_salt)  # the prompt's block hashes under the tenant's salt
        with tracing.span("first_token"):  # routing, capacity, tries, prefill and KV transfer: the TTFT
            attempt, first = await self._prefill_with_retry(
                request_id, prompt, hash_blocks(prompt, pool.block_size, hash_seed), sampling, pool, time_left,
                cache_salt, slo)
        backend = self.tokenizer.backend if self.tokenizer is not None else None
        output = _Output([_Sample(IncrementalDetokenizer(backend, prompt, params.stop) if backend else None)
                          for _ in range(params.n)],
                         gateway_pb2.Usage(prompt_tokens=len(prompt), cached_prompt_tokens=(
                             first.num_cached_tokens if first is not None else attempt.decode_cached_tokens)),
                         min(params.max_tokens, pool.max_model_len - len(prompt)))
        worker_prompt, worker_sampling, resumes = prompt, sampling, 0
        try:
            while True:
                try:
                    async for response in self._stream(request_id, attempt, worker_prompt, worker_sampling, output,
                                                       first, time_left, started if not resumes else None):
                        yield response
                    return
                except _DecodeLost as lost:
                    self._release(attempt, "decode worker lost mid-stream")
                    sent = output.samples[0].token_ids
                    if not (params.n == 1 and (params.greedy or params.seed is not None)) \
                            or resumes >= self.max_retries or _expired(time_left):
                        raise lost.status from lost
                    if len(sent) >= params.max_tokens:  # the last token's finish was what got lost
                        yield self._piece(request_id, output, 0, [], [], LENGTH)
                        return
                    resumes += 1
                    metrics.RESUMES.inc()
                    logger.warning("resuming request %s after %d tokens on another decode worker (%s lost)",
                                   request_id, len(sent), lost.worker_id)
                    worker_prompt = prompt + sent
                    worker_sampling = gateway_pb2.SamplingParams()
                    worker_sampling.CopyFrom(sampling)
                    worker_sampling.max_tokens = params.max_tokens - len(sent)
                    with tracing.span("resume", {"tandem.resume": resumes, "tandem.tokens_sent": len(sent),
                                                 "tandem.lost_worker": lost.worker_id,
                                                 "tandem.lost_reason": str(lost)}):
                        attempt, first = await self._prefill_with_retry(
                            request_id, worker_prompt, hash_blocks(worker_prompt, pool.block_size, hash_seed),
                            worker_sampling, pool, time_left, cache_salt, slo, avoid=frozenset({lost.worker_id}))
        finally:
            self._release(attempt, "request ended")

    # -- admission and prefill -------------------------------------------------------------

    async def _prefill_with_retry(self, request_id, prompt, hashes, sampling, pool: WorkerConfig, time_left,
                                  cache_salt: str, slo: ServiceLevel, avoid: frozenset[str] = frozenset()):
        retries = 0
        capacity = _Backoff(self.admit_wait_s)
        while True:
            with tracing.span("route"):
                route = await self._choose(hashes, len(prompt), avoid, capacity, time_left)
            attempt = _Attempt(route, f"{request_id}-{uuid.uuid4().hex[:8]}", cache_salt)
            try:
                with tracing.span("retry" if retries else "attempt", _trace_attributes(attempt, retries)):
                    first = await self._admit_and_prefill(attempt, prompt, sampling, pool, time_left, slo)
                return attempt, first
            except asyncio.CancelledError:
                self._release(attempt, "client cancelled")
                raise
            except _WorkerCallError as failure:
                self._release(attempt, f"{failure.stage} failed")
                code = failure.code
                level = logging.DEBUG if code == grpc.StatusCode.RESOURCE_EXHAUSTED else logging.WARNING
                logger.log(level, "%s failed on %s: %s %s", failure.stage, _workers(route), code.name,
                           failure.details)
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    await capacity.wait(time_left, _status_from_worker(failure))
                    continue
                if (failure.worker_fault or code in _RETRYABLE) and retries < self.max_retries \
                        and not _expired(time_left):
                    retries += 1
                    metrics.RETRIES.inc()
                    avoid = avoid | (frozenset({failure.culprit}) if failure.culprit
                                     else _involved(route, failure.stage))
                    continue
                raise _status_from_worker(failure) from failure
            except BaseException:
                self._release(attempt, "gateway error")
                raise

    async def _choose(self, hashes, prompt_len: int, avoid: frozenset[str], capacity: _Backoff,
                      time_left) -> Route:
        """``view.choose``, waiting for decode capacity within ``capacity``'s budget."""
        while True:
            try:
                return await self.view.choose(hashes, prompt_len, exclude=avoid)
            except NoWorkerError as exc:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
            except NoCapacityError as exc:
                overload = StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"over capacity: {exc}")
                await capacity.wait(time_left, overload)

    async def _admit_and_prefill(self, attempt: _Attempt, prompt, sampling, pool: WorkerConfig, time_left,
                                 slo: ServiceLevel) -> worker_pb2.PrefillResponse | None:
        """Admit, then Prefill on the prefill worker (its response), or start a Decode that
        prefills locally and read its first message (``None``: the first tokens come with it),
        as the placement decides."""
        route, rid = attempt.route, attempt.worker_request_id
        decode = self.clients.decode(route.decode.address)
        admit = decode.Admit(worker_pb2.AdmitRequest(request_id=rid, prompt_token_ids=prompt,
                                                     cache_salt=attempt.cache_salt),
                             timeout=self._hop_timeout(time_left))
        attempt.calls.append(admit)
        admitted = await self._staged(admit, "Admit", route.decode, time_left)
        attempt.reservation_id = admitted.reservation_id
        attempt.decode_cached_tokens = admitted.num_cached_blocks * pool.block_size
        local_tokens = len(prompt) - attempt.decode_cached_tokens
        remote_tokens = len(prompt) - route.cached_blocks * pool.block_size
        shared = route.prefill is not None and shares_device(route.prefill.config, route.decode.config)
        placement = self.placement.decide(route.prefill.worker_id if route.prefill else None, remote_tokens,
                                          route.decode.worker_id, local_tokens, route.decode.load.running, slo,
                                          route.decode.config.max_num_batched_tokens, shared_device=shared)
        metrics.PLACEMENTS.labels(placement.kind).inc()
        tracing.annotate({"tandem.placement": placement.kind})
        if placement.local:
            attempt.prefill_counted = attempt.prefill_holds = False
            self.view.prefill_done(route)
            call = self._decode_call(attempt, prompt, [], sampling, time_left, local_prefill=True)
            timeout_s = self._hop_timeout(time_left, self.pace.timeout_s(
                route.decode.worker_id, self.placement.queued(route.decode.worker_id) + local_tokens))
            with self._prefilling(route.decode.worker_id, local_tokens, placement):
                first = await self._staged(self._next_message(call, timeout_s), "Decode", route.decode, time_left,
                                           timeout_s)
            if first is grpc.aio.EOF:
                raise StatusError(grpc.StatusCode.INTERNAL, "the decode worker ended the stream before a token")
            attempt.first_messages.append(first)
            metrics.PREFILLS.labels("local", "none").inc()
            return None
        destination = worker_pb2.KVDestination(address=route.decode.address, reservation_id=admitted.reservation_id,
                                               layout=admitted.layout, num_cached_blocks=admitted.num_cached_blocks,
                                               kv_transports=admitted.kv_transports)
        timeout_s = self._hop_timeout(time_left, self.pace.timeout_s(
            route.prefill.worker_id, self.placement.queued(route.prefill.worker_id) + len(prompt)))
        prefill = self.clients.prefill(route.prefill.address).Prefill(
            worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                      destination=destination, cache_salt=attempt.cache_salt),
            timeout=timeout_s)
        attempt.calls.append(prefill)
        with self._prefilling(route.prefill.worker_id, remote_tokens, placement) as measured:
            response = await self._staged(prefill, "Prefill", route.prefill, time_left, timeout_s,
                                          watched=(route.prefill, route.decode))
            measured.tokens = len(prompt) - response.num_cached_tokens
        attempt.prefill_counted = attempt.prefill_holds = False
        self.view.prefill_done(route)
        metrics.PREFILLS.labels("remote", response.kv_transport).inc()
        return response

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

    def _hop_timeout(self, time_left: Callable[[], float | None], hop_s: float | None = None) -> float:
        """The timeout of one worker call: ``hop_s`` (default ``hop_timeout_s``) or the
        client's deadline, whichever is sooner."""
        hop_s = self.hop_timeout_s if hop_s is None else hop_s
        left = _timeout(time_left)
        return hop_s if left is None else min(left, hop_s)

    async def _next_message(self, call, timeout_s: float | None = None):
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

    async def _staged(self, awaitable, stage: str, worker: WorkerInfo, time_left, timeout_s: float | None = None,
                      watched: tuple[WorkerInfo, ...] = ()):
        """Await one step of a worker call (a unary call, or a stream's next message) before the
        client's first token; its failure comes out as :class:`_WorkerCallError`, and the
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
        except _WorkerDown as down:
            raise _WorkerCallError(stage, grpc.StatusCode.UNAVAILABLE,
                                   f"worker {down.worker_id} failed its health probe", True, down.worker_id) from down
        except TimeoutError as exc:
            outliers.failure(worker.worker_id)
            metrics.WORKER_FAILURES.labels(stage).inc()
            raise _WorkerCallError(stage, grpc.StatusCode.UNAVAILABLE, "no first message within the per-hop timeout",
                                   True) from exc
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            hop_timeout = code == grpc.StatusCode.DEADLINE_EXCEEDED and not _expired(time_left)
            fault = code == grpc.StatusCode.UNAVAILABLE or hop_timeout
            if fault and (stage != "Prefill" or
                          self.clients.for_role(worker.role).state(worker.address) != grpc.ChannelConnectivity.READY):
                outliers.failure(worker.worker_id)
                metrics.WORKER_FAILURES.labels(stage).inc()
            details = (f"no answer within {timeout_s or self.hop_timeout_s:.1f} s" if hop_timeout
                       else exc.details())
            raise _WorkerCallError(stage, code, details or "", fault) from exc
        outliers.success(worker.worker_id)
        return result

    async def _unless_down(self, awaitable, workers: tuple[WorkerInfo, ...]):
        """``awaitable``'s result, unless the health probe finds one of ``workers`` down first (a
        worker already down is not watched: routing chose it for want of another).

        Raises:
            _WorkerDown: the probe's verdict came first; ``awaitable`` is cancelled.
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
        raise _WorkerDown(next(worker_id for watcher, worker_id in watchers.items() if watcher in done))

    def _decode_call(self, attempt: _Attempt, prompt, first_ids: list[int], sampling, time_left,
                     local_prefill: bool = False):
        call = self.clients.decode(attempt.route.decode.address).Decode(
            worker_pb2.DecodeRequest(request_id=attempt.worker_request_id, reservation_id=attempt.reservation_id,
                                     prompt_token_ids=prompt, first_token_ids=first_ids, sampling=sampling,
                                     local_prefill=local_prefill, cache_salt=attempt.cache_salt),
            timeout=_timeout(time_left))
        attempt.calls.append(call)
        attempt.decode_call = call
        return call

    # -- decode and streaming --------------------------------------------------------------

    def _piece(self, request_id: str, output: _Output, index: int, tokens: list[int], logprobs,
               finish: int) -> gateway_pb2.GenerateResponse:
        """Feed ``tokens`` to sample ``index``; the message for the client (stop strings applied;
        ``usage`` set when it is the stream's last message)."""
        sample = output.samples[index]
        kept = []
        for token in tokens:
            kept.append(token)
            if sample.detok is not None and sample.detok.push(token) is not None:
                finish = STOP
                break
        sample.token_ids += kept
        sample.finish = finish
        output.usage.completion_tokens += len(kept)
        text = sample.detok.take_new_text(bool(finish)) if sample.detok is not None else ""
        response = gateway_pb2.GenerateResponse(request_id=request_id, index=index, token_ids=kept, text=text,
                                                finish_reason=finish, logprobs=list(logprobs)[: len(kept)])
        if all(s.done for s in output.samples):
            response.usage.CopyFrom(output.usage)
        return response

    async def _stream(self, request_id, attempt: _Attempt, prompt, sampling, output: _Output,
                      first: worker_pb2.PrefillResponse | None, time_left, started: float | None):
        """Stream one attempt's tokens into ``output`` (``prompt``: what the workers were given;
        ``started``: when the request began, for the TTFT metric, ``None`` on a resumed attempt).

        Raises:
            _DecodeLost: the Decode stream failed or stalled after the first token.
            StatusError: any other failure.
        """
        samples, n = output.samples, len(output.samples)
        if first is not None and (len(first.first_tokens) != n or len(first.finish_reasons) != n):
            raise StatusError(grpc.StatusCode.INTERNAL,
                              f"prefill worker returned {len(first.first_tokens)} first tokens for n={n}")
        if first is not None:
            for index, (token, finish) in enumerate(zip(first.first_tokens, first.finish_reasons)):
                yield self._piece(request_id, output, index, [token.token_id], [token], finish)
            if all(s.done for s in samples):
                if started is not None:
                    metrics.TTFT.observe(time.monotonic() - started)
                return  # the decode reservation is never claimed: the release's Abort frees it
        if started is not None:
            metrics.TTFT.observe(time.monotonic() - started)
        first_token_at, tokens_before = time.monotonic(), max(s.tokens for s in samples)
        tokens_past = max(1, tokens_before)  # output as TPOT's clock starts: at least the first token
        with tracing.span("decode", {"tandem.decode_worker": attempt.route.decode.worker_id}) as decoding, \
                self.placement.slack.decoding(attempt.route.decode.worker_id,
                                              lambda: max(s.tokens for s in samples) - tokens_past,
                                              output.max_tokens - tokens_past):
            call = attempt.decode_call if first is None else self._decode_call(
                attempt, prompt, [t.token_id for t in first.first_tokens], sampling, time_left)
            async with contextlib.aclosing(self._decode_stream(request_id, attempt, call, output)) as responses:
                async for response in responses:
                    yield response
            tracing.annotate({"tandem.output_tokens": max(s.tokens for s in samples)}, decoding)
        tokens_after_first = max(s.tokens for s in samples) - tokens_past
        if tokens_after_first > 0:
            tpot = (time.monotonic() - first_token_at) / tokens_after_first
            metrics.TPOT.observe(tpot)
            self.placement.observe_step(attempt.route.decode.worker_id, tpot)

    async def _decode_stream(self, request_id, attempt: _Attempt, call, output: _Output):
        """The Decode stream's tokens into ``output`` (after the first token).

        Raises:
            _DecodeLost: the stream failed or stalled.
            StatusError: any other failure.
        """
        samples, n, route = output.samples, len(output.samples), attempt.route
        try:
            async for message in _chain(attempt.first_messages, call, self._next_message):
                if message.index >= n or samples[message.index].done:
                    continue
                yield self._piece(request_id, output, message.index, list(message.token_ids), message.logprobs,
                                  message.finish_reason)
                if all(s.done for s in samples):
                    break
        except TimeoutError as exc:
            logger.warning("Decode on %s stalled after the first token: no message within %.1f s",
                           route.decode.address, self.decode_stall_timeout_s)
            self.view.outliers.failure(route.decode.worker_id)
            metrics.WORKER_FAILURES.labels("Decode").inc()
            raise _DecodeLost(StatusError(grpc.StatusCode.UNAVAILABLE,
                                          f"decode worker {route.decode.worker_id} stalled mid-stream: no token "
                                          f"within {self.decode_stall_timeout_s} s"), route.decode.worker_id) from exc
        except grpc.aio.AioRpcError as exc:
            logger.warning("Decode on %s failed after the first token: %s %s", route.decode.address,
                           exc.code().name, exc.details())
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.view.outliers.failure(route.decode.worker_id)
                metrics.WORKER_FAILURES.labels("Decode").inc()
            if exc.code() in _RETRYABLE:
                raise _DecodeLost(StatusError(grpc.StatusCode.UNAVAILABLE,
                                              f"decode worker {route.decode.worker_id} failed mid-stream: "
                                              f"{exc.code().name} {exc.details()}"), route.decode.worker_id) from exc
            raise _status_from_worker(_WorkerCallError("Decode", exc.code(), exc.details() or "", False)) from exc
        else:
            if all(s.done for s in samples):
                # The worker finished every sample (its finish reasons came): it holds nothing of
                # the request, whether or not the stream's status has arrived yet (it usually has
                # not when the last message is read: an Abort went out after every request).
                attempt.decode_holds = False
            for index, sample in enumerate(samples):
                if not sample.done:  # the worker ended the stream without finishing this sample
                    yield self._piece(request_id, output, index, [], [], ABORT)

    # -- cleanup ---------------------------------------------------------------------------

    def _release(self, attempt: _Attempt, reason: str) -> None:
        """Cancel the attempt's calls, Abort what the workers may still hold, release routing counts."""
        for call in attempt.calls:
            call.cancel()
        attempt.calls.clear()
        route, rid = attempt.route, attempt.worker_request_id
        if attempt.prefill_counted:
            self.view.prefill_done(route)
        if attempt.decode_counted:
            self.view.decode_done(route)
        if attempt.prefill_holds:
            self._abort(self.clients.prefill(route.prefill.address), rid, reason)
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


class _Backoff:
    """A budget of ``total_s`` seconds of waiting for capacity, spent in growing sleeps; the
    clock starts at the first wait, not when the request arrived (a long prefill before a
    retry does not eat it). While it sleeps, the request counts in the
    ``tandem_gateway_requests_waiting`` gauge."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.deadline: float | None = None
        self.delay = 0.02

    async def wait(self, time_left: Callable[[], float | None], overload: StatusError) -> None:
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
        budget_s, client_s = self.deadline - now, _timeout(time_left)
        if client_s is not None and client_s < min(self.delay, budget_s):
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"waited for capacity until the client's deadline: {overload.message}")
        if budget_s <= self.delay:
            raise overload
        with metrics.WAITING.track_inprogress(), tracing.span("wait_for_capacity", {"tandem.wait_s": self.delay}):
            await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, 0.5)


async def _chain(first: list, call, next_message) -> AsyncIterator:
    """The messages already read, then the rest of the stream, each read by
    ``next_message(call)`` (``read()``: grpc.aio does not let one call mix it with iteration)."""
    for message in first:
        yield message
    while (message := await next_message(call)) is not grpc.aio.EOF:
        yield message


def _trace_attributes(attempt: _Attempt, retries: int) -> dict[str, object]:
    """The attributes of a try's span: its workers and how many tries failed before it."""
    route = attempt.route
    return {"tandem.worker_request_id": attempt.worker_request_id, "tandem.retries": retries,
            "tandem.prefill_worker": route.prefill.worker_id if route.prefill is not None else "none (local)",
            "tandem.decode_worker": route.decode.worker_id}


def _involved(route: Route, stage: str) -> frozenset[str]:
    """The workers a failure at ``stage`` may be the fault of (a failed Prefill: either side,
    its KV transfer goes to the decode worker)."""
    if stage == "Prefill" and route.prefill is not None:
        return frozenset({route.prefill.worker_id, route.decode.worker_id})
    return frozenset({route.decode.worker_id})


def _workers(route: Route) -> str:
    prefill = route.prefill.worker_id if route.prefill is not None else "none (local)"
    return f"prefill {prefill} / decode {route.decode.worker_id}"


def _timeout(time_left: Callable[[], float | None]) -> float | None:
    """The client's remaining time for the next hop; ``None`` when it set no deadline."""
    left = time_left()
    if left is None or left > 1e8:  # grpc reports "no deadline" as a huge number
        return None
    return max(left, 0.001)


def _expired(time_left: Callable[[], float | None]) -> bool:
    """Whether the client's deadline has passed (or is about to)."""
    left = _timeout(time_left)
    return left is not None and left <= 0.01


def _status_from_worker(failure: _WorkerCallError) -> StatusError:
    """The client's status for a worker error that is not retried (a worker's own failure,
    a per-hop or stall timeout included: UNAVAILABLE)."""
    code = failure.code
    if failure.worker_fault or code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.UNAVAILABLE
    elif code == grpc.StatusCode.UNKNOWN:
        code = grpc.StatusCode.INTERNAL
    elif code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        code = grpc.StatusCode.UNAVAILABLE  # a lost reservation, a refused peer: the cluster's fault, not the client's
    return StatusError(code, f"{failure.stage}: {failure.details}")
