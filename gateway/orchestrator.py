"""One Generate request across the cluster: route, Admit → Prefill → Decode, stream, clean up.

The servicer hands a checked request (prompt token ids + sampling params) to
:meth:`Orchestrator.generate`, an async generator of ``GenerateResponse``. Errors come out as
:class:`RequestError` (a gRPC status code and a message); whatever way the generator ends
(finished, stop string, error, client cancellation, deadline), every worker that may still hold
something of the request is told to ``Abort`` and the routing counts are released.

Retries: a worker answering UNAVAILABLE (or a reservation lost) before the client has seen a
token is retried once on other workers; after that the client gets UNAVAILABLE. Decode capacity
(``NoCapacityError`` or Admit's RESOURCE_EXHAUSTED) is waited for up to ``admit_wait_s`` with
backoff, a small admission queue, then answered RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from tokenizers import Tokenizer

from engine.block_hash import hash_blocks
from engine.detokenizer import IncrementalDetokenizer
from gateway import metrics
from gateway.router import NoCapacityError, NoWorkerError, Route
from protos.tandem.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

STOP, LENGTH, ABORT = (gateway_pb2.FINISH_REASON_STOP, gateway_pb2.FINISH_REASON_LENGTH,
                       gateway_pb2.FINISH_REASON_ABORT)
# Worker failures worth one transparent retry elsewhere, while the client has seen nothing.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED}
_ABORT_TIMEOUT_S = 2.0


class RequestError(Exception):
    """The request ends with gRPC status ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True)
class ModelMeta:
    """The served model as the gateway sees it (no weights)."""

    model_id: str
    max_model_len: int
    block_size: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    kv_dtype: str
    hash_seed: bytes


class WorkerClients:
    """One gRPC channel per worker address, opened on first use and reused."""

    def __init__(self, options: Sequence[tuple[str, int]] = ()) -> None:
        self._options = list(options)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=self._options)
        return self._channels[address]

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self._channel(address))

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self._channel(address))

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        await asyncio.gather(*(c.close() for c in channels.values()), return_exceptions=True)


@dataclass
class _Sample:
    """Output state of one sample (index ``i`` of ``n``)."""

    detok: IncrementalDetokenizer
    tokens: int = 0
    finish: int = 0  # FinishReason; 0 while it streams

    @property
    def done(self) -> bool:
        return self.finish != 0


@dataclass
class _Attempt:
    """Where one try of the request runs, and what is still owed for it.

    ``*_counted``: the ClusterView still counts the request on that worker (``prefill_done``
    / ``decode_done`` not yet called). ``*_holds``: the worker may still hold state of the
    request (it gets an Abort at release).
    """

    route: Route
    worker_request_id: str
    reservation_id: str = ""
    prefill_counted: bool = True
    decode_counted: bool = True
    prefill_holds: bool = True
    decode_holds: bool = True
    calls: list = field(default_factory=list)


class _WorkerCallError(Exception):
    """A worker call failed; ``stage`` names the call (Admit, Prefill)."""

    def __init__(self, stage: str, error: grpc.aio.AioRpcError) -> None:
        super().__init__(f"{stage}: {error.code().name} {error.details()}")
        self.stage = stage
        self.error = error


class Orchestrator:
    """Drives requests through the cluster.

    Args:
        view: a ``ClusterView`` (or anything with its ``choose``/``prefill_done``/``decode_done``).
        clients: channels to the workers.
        meta: the served model.
        tokenizer: the ``tokenizers.Tokenizer`` for detokenization.
        admit_wait_s: longest wait for decode capacity before RESOURCE_EXHAUSTED.
        lease_ms: reservation lease asked of decode workers (0: their default).
    """

    def __init__(self, view, clients: WorkerClients, meta: ModelMeta, tokenizer: Tokenizer,
                 admit_wait_s: float = 5.0, lease_ms: int = 0) -> None:
        self.view = view
        self.clients = clients
        self.meta = meta
        self.tokenizer = tokenizer
        self.admit_wait_s = admit_wait_s
        self.lease_ms = lease_ms
        self._background: set[asyncio.Task] = set()
        self._layout_checked = False

    async def generate(
        self, request_id: str, prompt: list[int], sampling: gateway_pb2.SamplingParams,
        time_left: Callable[[], float | None],
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Stream the request's ``GenerateResponse`` messages.

        Args:
            request_id: the client's (or gateway-made) id, echoed in every message.
            prompt: checked prompt token ids.
            sampling: checked sampling params (``n`` and ``max_tokens`` explicit).
            time_left: seconds until the client's deadline (``None``: none); every worker call
                gets it as its timeout.

        Raises:
            RequestError: the status the client gets.
        """
        started = time.monotonic()
        hashes = hash_blocks(prompt, self.meta.block_size, self.meta.hash_seed)
        attempt, first = await self._prefill_with_retry(request_id, prompt, hashes, sampling, time_left)
        try:
            async for response in self._stream(request_id, attempt, prompt, sampling, first, time_left, started):
                yield response
        finally:
            self._release(attempt, "request ended")

    # -- admission and prefill -------------------------------------------------------------

    async def _prefill_with_retry(self, request_id, prompt, hashes, sampling, time_left):
        capacity_deadline = time.monotonic() + self.admit_wait_s
        avoid: set[str] = set()
        retried = False
        delay = 0.02
        while True:
            route = await self._choose(hashes, len(prompt), avoid, capacity_deadline, time_left)
            attempt = _Attempt(route, f"{request_id}-{uuid.uuid4().hex[:8]}")
            try:
                first = await self._admit_and_prefill(attempt, prompt, sampling, time_left)
                return attempt, first
            except asyncio.CancelledError:
                self._release(attempt, "client cancelled")
                raise
            except _WorkerCallError as failure:
                self._release(attempt, f"{failure.stage} failed")
                exc, stage, code = failure.error, failure.stage, failure.error.code()
                level = logging.DEBUG if code == grpc.StatusCode.RESOURCE_EXHAUSTED else logging.WARNING
                logger.log(level, "%s failed on %s: %s %s", stage, _workers(route), code.name, exc.details())
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() + delay < capacity_deadline:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
                    continue
                if code in _RETRYABLE and not retried:
                    retried = True
                    metrics.RETRIES.inc()
                    avoid |= {route.prefill.worker_id, route.decode.worker_id}
                    continue
                raise _status_from_worker(exc, stage) from exc
            except BaseException:
                self._release(attempt, "gateway error")
                raise

    async def _choose(self, hashes, prompt_len, avoid, capacity_deadline, time_left) -> Route:
        """``view.choose`` with a bounded wait for capacity, preferring workers not in ``avoid``."""
        delay = 0.02
        while True:
            try:
                routes = [await self.view.choose(hashes, prompt_len, self.meta.block_size)]
                while avoid and len(routes) < 4 and _avoided(routes[-1], avoid):
                    routes.append(await self.view.choose(hashes, prompt_len, self.meta.block_size))
                best = min(routes, key=lambda r: _avoided(r, avoid))
                for r in routes:
                    if r is not best:
                        self.view.prefill_done(r)
                        self.view.decode_done(r)
                return best
            except NoWorkerError as exc:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
            except NoCapacityError as exc:
                remaining = _timeout(time_left)
                if time.monotonic() + delay >= capacity_deadline or (remaining is not None and remaining < delay):
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"over capacity: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def _admit_and_prefill(self, attempt: _Attempt, prompt, sampling, time_left) -> worker_pb2.PrefillResponse:
        route, rid = attempt.route, attempt.worker_request_id
        decode = self.clients.decode(route.decode.address)
        admit = decode.Admit(worker_pb2.AdmitRequest(request_id=rid, num_prompt_tokens=len(prompt),
                                                     lease_ms=self.lease_ms), timeout=_timeout(time_left))
        attempt.calls.append(admit)
        admitted = await _staged(admit, "Admit")
        self._check_layout(admitted.layout)
        destination = worker_pb2.KVDestination(address=route.decode.address, reservation_id=admitted.reservation_id,
                                               layout=admitted.layout)
        seed_state = worker_pb2.SeedState(seed=sampling.seed) if sampling.HasField("seed") else worker_pb2.SeedState()
        prefill = self.clients.prefill(route.prefill.address).Prefill(
            worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                      seed_state=seed_state, destination=destination),
            timeout=_timeout(time_left))
        attempt.calls.append(prefill)
        attempt.reservation_id = admitted.reservation_id
        response = await _staged(prefill, "Prefill")
        attempt.prefill_counted = attempt.prefill_holds = False
        self.view.prefill_done(route)
        return response

    def _check_layout(self, layout) -> None:
        if not self._layout_checked and layout.dtype:
            self._layout_checked = True
            if layout.dtype != self.meta.kv_dtype:
                logger.error("decode workers cache KV as %s but this gateway hashes blocks for %s: prefix-aware "
                             "routing finds nothing; set TANDEM_KV_DTYPE=%s", layout.dtype, self.meta.kv_dtype,
                             layout.dtype)

    # -- decode and streaming --------------------------------------------------------------

    async def _stream(self, request_id, attempt: _Attempt, prompt, sampling, first: worker_pb2.PrefillResponse,
                      time_left, started):
        n = sampling.n
        if len(first.first_tokens) != n:
            raise RequestError(grpc.StatusCode.INTERNAL,
                               f"prefill worker returned {len(first.first_tokens)} first tokens for n={n}")
        stop = list(sampling.stop)
        samples = [_Sample(IncrementalDetokenizer(self.tokenizer, prompt, stop)) for _ in range(n)]
        usage = gateway_pb2.Usage(prompt_tokens=len(prompt), cached_prompt_tokens=first.num_cached_tokens)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.meta.eos_token_ids)

        def piece(index: int, tokens: list[int], logprobs, finish: int) -> gateway_pb2.GenerateResponse:
            """Feed ``tokens`` to sample ``index``; the message for the client (stop strings applied)."""
            sample = samples[index]
            kept = []
            for token in tokens:
                kept.append(token)
                sample.tokens += 1
                if sample.detok.push(token) is not None:
                    finish = STOP
                    break
            if not finish and sample.tokens >= sampling.max_tokens:
                finish = LENGTH  # the worker says so too; the gateway need not wait for it
            sample.finish = finish
            usage.completion_tokens += len(kept)
            response = gateway_pb2.GenerateResponse(
                request_id=request_id, index=index, token_ids=kept, text=sample.detok.take_new_text(bool(finish)),
                finish_reason=finish, logprobs=list(logprobs)[: len(kept)])
            if finish:
                response.usage.CopyFrom(usage)
            return response

        first_ids = [t.token_id for t in first.first_tokens]
        for index, token in enumerate(first.first_tokens):
            yield piece(index, [token.token_id], [token], STOP if token.token_id in stop_ids else 0)
        metrics.TTFT.observe(time.monotonic() - started)
        first_token_at = time.monotonic()
        if all(s.done for s in samples):
            return

        route = attempt.route
        call = self.clients.decode(route.decode.address).Decode(
            worker_pb2.DecodeRequest(request_id=attempt.worker_request_id, reservation_id=attempt.reservation_id,
                                     prompt_token_ids=prompt, first_token_ids=first_ids, sampling=sampling,
                                     seed_state=first.seed_state),
            timeout=_timeout(time_left))
        attempt.calls.append(call)
        try:
            async for message in call:
                if message.index >= n or samples[message.index].done:
                    continue
                yield piece(message.index, list(message.token_ids), message.logprobs, message.finish_reason)
                if all(s.done for s in samples):
                    break
        except grpc.aio.AioRpcError as exc:
            logger.warning("Decode on %s failed after the first token: %s %s", route.decode.address,
                           exc.code().name, exc.details())
            code = exc.code()
            if code in _RETRYABLE:
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"decode worker {route.decode.worker_id} failed mid-stream: {exc.details()}") from exc
            raise _status_from_worker(exc, "Decode") from exc
        else:
            if all(s.done for s in samples) and call.done():
                attempt.decode_holds = False  # the worker ended the stream itself: nothing left to free
            for index, sample in enumerate(samples):
                if not sample.done:  # the worker ended the stream without finishing this sample
                    yield piece(index, [], [], ABORT)
        tokens_after_first = max(s.tokens for s in samples) - 1
        if tokens_after_first > 0:
            metrics.TPOT.observe((time.monotonic() - first_token_at) / tokens_after_first)

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


async def _staged(call, stage: str):
    """Await a unary worker call; its failure comes out as :class:`_WorkerCallError`."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise _WorkerCallError(stage, exc) from exc


def _avoided(route: Route, avoid: set[str]) -> int:
    return (route.prefill.worker_id in avoid) + (route.decode.worker_id in avoid)


def _workers(route: Route) -> str:
    return f"prefill {route.prefill.worker_id} / decode {route.decode.worker_id}"


def _timeout(time_left: Callable[[], float | None]) -> float | None:
    """The client's remaining time for the next hop; ``None`` when it set no deadline."""
    left = time_left()
    if left is None or left > 1e8:  # grpc reports "no deadline" as a huge number
        return None
    return max(left, 0.001)


def _status_from_worker(exc: grpc.aio.AioRpcError, stage: str) -> RequestError:
    """The client's status for a worker error that is not retried."""
    code = exc.code()
    if code in (grpc.StatusCode.CANCELLED,):
        code = grpc.StatusCode.UNAVAILABLE
    elif code == grpc.StatusCode.UNKNOWN:
        code = grpc.StatusCode.INTERNAL
    elif code == grpc.StatusCode.NOT_FOUND:
        code = grpc.StatusCode.UNAVAILABLE  # a lost reservation: the cluster's fault, not the client's
    return RequestError(code, f"{stage}: {exc.details()}")
