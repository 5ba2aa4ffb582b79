"""Streaming one try's tokens into the request's output: the prefill's first tokens, then the
Decode stream's, until every sample has finished; the TTFT and TPOT metrics, and each decode
worker's measured step time (placement's input).

Every call but the Decode stream gets its hop timeout or the client's deadline, whichever is
sooner; the Decode stream gets the client's deadline and ``decode_stall_timeout_s`` between
messages. A Decode stream that fails or stalls after the first token (UNAVAILABLE, NOT_FOUND,
ABORTED, silent for ``decode_stall_timeout_s``) is :class:`~gateway.worker_calls.DecodeLost`,
which :mod:`gateway.failover` may resume elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from cluster import tracing
from gateway import metrics
from gateway.attempt import Attempt, Attempts
from gateway.output import ABORT, RequestOutput
from gateway.placement import PlacementModel
from gateway.request import CheckedRequest
from gateway.worker_calls import RETRYABLE, DecodeLost, TimeLeft, WorkerCallError, WorkerCalls, client_status
from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2, worker_pb2

logger = logging.getLogger(__name__)


class DecodeStreamer:
    """Streams tries' tokens into their request's output.

    Args:
        attempts: starts a try's Decode stream.
        calls: reads the stream with its stall timeout.
        placement: measures each decode worker's steps and counts the streams on it.
    """

    def __init__(self, attempts: Attempts, calls: WorkerCalls, placement: PlacementModel) -> None:
        self.attempts = attempts
        self.calls = calls
        self.view = calls.view
        self.placement = placement

    async def stream(self, attempt: Attempt, request: CheckedRequest, output: RequestOutput,
                     first: worker_pb2.PrefillResponse | None, time_left: TimeLeft,
                     started: float | None) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Stream one try's tokens into ``output`` (``request``: as the workers were given it;
        ``started``: when the request began, for the TTFT metric, ``None`` on a resumed try).

        Raises:
            DecodeLost: the Decode stream failed or stalled after the first token.
            StatusError: any other failure.
        """
        n = len(output.samples)
        if first is not None and (len(first.first_tokens) != n or len(first.finish_reasons) != n):
            raise StatusError(grpc.StatusCode.INTERNAL,
                              f"prefill worker returned {len(first.first_tokens)} first tokens for n={n}")
        # A spot-checked request's first tokens wait for the Decode stream's first message (the
        # check passed): a prefill worker whose KV is wrong may have sampled them from it too.
        # One whose first tokens finish it needs no decode, nor the KV.
        held = list(zip(first.first_tokens, first.finish_reasons)) if first is not None and attempt.kv_spot_check \
            and not all(first.finish_reasons) else []
        if first is not None and not held:
            for index, (token, finish) in enumerate(zip(first.first_tokens, first.finish_reasons)):
                yield output.piece(index, [token.token_id], [token], finish)
            if output.done:
                if started is not None:
                    metrics.TTFT.observe(time.monotonic() - started)
                return  # the decode reservation is never claimed: the release's Abort frees it
        if started is not None:
            metrics.TTFT.observe(time.monotonic() - started)
        first_token_at = time.monotonic()
        tokens_past = max(1, output.most_tokens())  # output as TPOT's clock starts: at least the first token
        decode = attempt.route.decode
        with tracing.span("decode", {"tandem.decode_worker": decode.worker_id}) as decoding, \
                self.placement.slack.decoding(decode.worker_id, lambda: output.most_tokens() - tokens_past,
                                              output.max_tokens - tokens_past):
            call = attempt.decode_call if first is None else self.attempts.decode_call(
                attempt, request, [t.token_id for t in first.first_tokens], time_left)
            async with contextlib.aclosing(self._decode_stream(attempt, call, output, held)) as responses:
                async for response in responses:
                    yield response
            tracing.annotate({"tandem.output_tokens": output.most_tokens()}, decoding)
        tokens_after_first = output.most_tokens() - tokens_past
        if tokens_after_first > 0:
            tpot = (time.monotonic() - first_token_at) / tokens_after_first
            metrics.TPOT.observe(tpot)
            self.placement.observe_step(decode.worker_id, tpot)

    async def _decode_stream(self, attempt: Attempt, call, output: RequestOutput, held: list):
        """The Decode stream's tokens into ``output`` (after the first token; ``held``: the
        prefill's first tokens and finish reasons, per sample, still to go out, before the
        stream's first message).

        Raises:
            DecodeLost: the stream failed or stalled, or (before any token) the decode worker's
                spot check found the prefill worker's KV wrong: the prefill worker is
                quarantined.
            StatusError: any other failure.
        """
        samples, n, decode = output.samples, len(output.samples), attempt.route.decode
        try:
            async for message in _chain(attempt.first_messages, call, self.calls.next_message):
                if held:
                    for index, (token, finish) in enumerate(held):
                        yield output.piece(index, [token.token_id], [token], finish)
                    held = []
                    if output.done:
                        break
                if message.index >= n or samples[message.index].done:
                    continue
                yield output.piece(message.index, list(message.token_ids), message.logprobs, message.finish_reason)
                if output.done:
                    break
        except TimeoutError as exc:
            logger.warning("Decode on %s stalled after the first token: no message within %.1f s",
                           decode.address, self.calls.decode_stall_timeout_s)
            self.view.outliers.failure(decode.worker_id)
            metrics.WORKER_FAILURES.labels("Decode").inc()
            raise DecodeLost(StatusError(grpc.StatusCode.UNAVAILABLE,
                                         f"decode worker {decode.worker_id} stalled mid-stream: no token "
                                         f"within {self.calls.decode_stall_timeout_s} s"), decode.worker_id) from exc
        except grpc.aio.AioRpcError as exc:
            prefill = attempt.route.prefill
            if exc.code() == grpc.StatusCode.DATA_LOSS and held and prefill is not None:
                metrics.SPOT_CHECK_FAILURES.inc()
                if self.view.quarantine is not None:
                    await self.view.quarantine.add(prefill.worker_id, f"decode worker {decode.worker_id}: "
                                                                      f"{exc.details()}")
                raise DecodeLost(StatusError(grpc.StatusCode.UNAVAILABLE,
                                             f"the KV of prefill worker {prefill.worker_id} failed decode worker "
                                             f"{decode.worker_id}'s spot check"), decode.worker_id) from exc
            logger.warning("Decode on %s failed after the first token: %s %s", decode.address,
                           exc.code().name, exc.details())
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.view.outliers.failure(decode.worker_id)
                metrics.WORKER_FAILURES.labels("Decode").inc()
            if exc.code() in RETRYABLE:
                raise DecodeLost(StatusError(grpc.StatusCode.UNAVAILABLE,
                                             f"decode worker {decode.worker_id} failed mid-stream: "
                                             f"{exc.code().name} {exc.details()}"), decode.worker_id) from exc
            raise client_status(WorkerCallError("Decode", exc.code(), exc.details() or "", False)) from exc
        else:
            for index, (token, finish) in enumerate(held):  # the stream ended with no message
                yield output.piece(index, [token.token_id], [token], finish)
            if output.done:
                # The worker finished every sample (its finish reasons came): it holds nothing of
                # the request, whether or not the stream's status has arrived yet (it usually has
                # not when the last message is read: an Abort went out after every request).
                attempt.decode_holds = False
            for index, sample in enumerate(samples):
                if not sample.done:  # the worker ended the stream without finishing this sample
                    yield output.piece(index, [], [], ABORT)


async def _chain(first: list, call, next_message) -> AsyncIterator:
    """The messages already read, then the rest of the stream, each read by
    ``next_message(call)`` (``read()``: grpc.aio does not let one call mix it with iteration)."""
    for message in first:
        yield message
    while (message := await next_message(call)) is not grpc.aio.EOF:
        yield message
