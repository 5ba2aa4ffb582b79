"""One checked request across the cluster: route, Admit → Prefill → Decode (or Admit → Decode
with a local prefill), stream, clean up.

The front end (:mod:`gateway.frontend`) hands :meth:`Orchestrator.drive` a
:class:`~gateway.request.CheckedRequest` and the :class:`~gateway.output.RequestOutput` that
turns tokens into the client's messages. The layers below do one job each:

- :mod:`gateway.failover`: routing, waiting for decode capacity, retries on other workers before
  the first token, and resuming a stream whose decode worker was lost;
- :mod:`gateway.attempt`: one try (Admit, placement, Prefill or a local prefill) and its release;
- :mod:`gateway.decode_stream`: a try's tokens into the output, with the TTFT and TPOT metrics;
- :mod:`gateway.worker_calls`: each worker call's timeout, outlier accounting and client status.

Who decides what: the workers decide when a sample ends on its tokens (EOS, stop token ids,
``max_tokens``, ``max_model_len``; the prefill worker for the first token, the decode worker
after it); the gateway owns the text (:mod:`gateway.output`). Errors come out as
:class:`protos.status.StatusError`; whatever way the stream ends (finished, stop string, error,
client cancellation, deadline), every worker that may still hold something of the request is
told to ``Abort`` and the routing counts are released, exactly once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from cluster import tracing
from gateway.attempt import Attempts
from gateway.decode_stream import DecodeStreamer
from gateway.failover import Failover
from gateway.output import LENGTH, RequestOutput
from gateway.placement import PlacementModel
from gateway.prefill_pace import PrefillPace
from gateway.request import CheckedRequest
from gateway.router import ClusterView
from gateway.worker_calls import DecodeLost, TimeLeft, WorkerCalls, WorkerClients
from protos.tandem.v1 import gateway_pb2


class Orchestrator:
    """Drives requests through the cluster.

    Args:
        view: the routing state (``ClusterView``).
        clients: stubs of the workers.
        admit_wait_s: longest wait for decode capacity before RESOURCE_EXHAUSTED, seconds.
        local_prefill_max_tokens: the decode worker prefills a request itself when at most this
            many prompt tokens are left after its prefix hit.
        max_retries: tries on other workers after worker failures before the first token (and
            resumes after it).
        hop_timeout_s: seconds an Admit call may take (sooner: the client's deadline); a prefill
            gets this plus its prompt's tokens at the worker's measured pace.
        decode_stall_timeout_s: seconds a Decode stream may go without a message.
        prefill_s_per_token: a prefill's seconds per prompt token before its worker's pace is measured.
        adaptive_placement: place each prefill by prediction; ``False``: a fixed split
            (:class:`~gateway.placement.PlacementModel`'s ``adaptive``).

    Attributes:
        pace: each worker's measured prefill pace.
        placement: where each prompt is prefilled.
    """

    def __init__(self, view: ClusterView, clients: WorkerClients, admit_wait_s: float, local_prefill_max_tokens: int,
                 max_retries: int, hop_timeout_s: float, decode_stall_timeout_s: float, prefill_s_per_token: float,
                 adaptive_placement: bool) -> None:
        self.pace = PrefillPace(hop_timeout_s, prefill_s_per_token)
        self.placement = PlacementModel(self.pace, local_prefill_max_tokens, adaptive=adaptive_placement)
        calls = WorkerCalls(view, clients, hop_timeout_s, decode_stall_timeout_s)
        self.attempts = Attempts(view, calls, self.placement, self.pace)
        self.failover = Failover(view, self.attempts, max_retries, admit_wait_s)
        self.streamer = DecodeStreamer(self.attempts, calls, self.placement)

    async def drive(self, request: CheckedRequest, output: RequestOutput,
                    time_left: TimeLeft) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Stream the request's messages (built by ``output``; the last one carries ``usage``).

        Args:
            request: the checked request.
            output: its output, empty.
            time_left: seconds until the client's deadline (``None``: none); every worker call
                gets it as its timeout.

        Raises:
            StatusError: the status the client gets.
        """
        started = time.monotonic()
        with tracing.span("first_token"):  # routing, capacity, tries, prefill and KV transfer: the TTFT
            attempt, first = await self.failover.first_token(request, time_left)
        output.usage.cached_prompt_tokens = first.num_cached_tokens if first is not None \
            else attempt.decode_cached_tokens
        tried, resumes = request, 0  # tried: the request as the workers get it
        try:
            while True:
                try:
                    async for response in self.streamer.stream(attempt, tried, output, first, time_left,
                                                               None if resumes else started):
                        yield response
                    return
                except DecodeLost as lost:
                    self.attempts.release(attempt, "decode worker lost mid-stream")
                    resumes += 1
                    resumed = await self.failover.resume(request, output.samples[0].token_ids, lost, resumes,
                                                         time_left)
                    if resumed is None:  # the last token's finish was what got lost
                        yield output.piece(0, [], [], LENGTH)
                        return
                    attempt, first, tried = resumed
        finally:
            self.attempts.release(attempt, "request ended")

    async def drain_aborts(self) -> None:
        """Wait for outstanding Abort calls (at shutdown)."""
        await self.attempts.drain_aborts()
