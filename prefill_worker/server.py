"""The prefill worker's gRPC servicer (``tandem.v1.PrefillWorker``).

A prefill is the engine told to stop after the first token: the request runs with
``max_tokens=1`` and ``hold_blocks=True``, so its prompt blocks stay pinned after it finishes;
they are pushed into the decode worker's reservation and released as soon as the transfer is
acknowledged, fails, is aborted, or the prefill lease (``lease_s``) runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import grpc

from engine.serving.async_engine import AsyncEngine, EngineError
from engine.serving.metrics import WorkerMetrics
from engine.serving.server import (
    Admission, RpcError, request_id_var, sampling_params_from_proto, token_logprobs,
)
from engine.serving.settings import WorkerSettings
from kvtransfer import BlockLayout, KVDestination, KVSender, KVTransferError
from prefill_worker.faults import make_sender
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """Validates, runs the prefill on the engine, pushes the KV, returns the first tokens.

    Args:
        engine: the worker's running engine.
        settings: ``lease_s`` (prefill lease) and ``max_num_seqs`` (queue bound) are used.
        metrics: the worker's metrics.
        sender: the KV transport (default: gRPC, one channel per decode worker; see
            :mod:`prefill_worker.faults` for the test-only corruption hook).
    """

    service_name = "tandem.v1.PrefillWorker"

    def __init__(self, engine: AsyncEngine, settings: WorkerSettings, metrics: WorkerMetrics,
                 sender: KVSender | None = None) -> None:
        self.engine = engine
        self.lease_s = settings.lease_s
        self.max_waiting = settings.max_num_seqs  # queued requests at most (back-pressure)
        self.metrics = metrics
        self.sender = sender or make_sender(settings.lease_s)
        self.layout = BlockLayout.of_cache(engine.kv_cache)
        self.admission = Admission()
        self._tasks: dict[str, asyncio.Task[worker_pb2.PrefillResponse]] = {}

    def add_to_server(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    def pending(self) -> int:
        return 0

    async def close(self) -> None:
        await self.sender.close()

    # ----------------------------------------------------------------- RPCs
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        request_id = request.request_id
        request_id_var.set(request_id)
        await self.admission.check(context)
        start, status = time.perf_counter(), "OK"
        try:
            with self.admission.track():
                prompt, params, destination = self._validate(request)
                if self.engine.stats().num_waiting >= self.max_waiting:
                    raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"prefill queue is full ({self.max_waiting} requests waiting)")
                if request_id in self._tasks:
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already prefilling")
                task = asyncio.ensure_future(self._prefill(request_id, prompt, params, destination, start))
                self._tasks[request_id] = task
                try:
                    return await task
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise  # the call itself ended (client gone, deadline)
                    raise RpcError(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted") from None
                finally:
                    self._tasks.pop(request_id, None)
        except (RpcError, KVTransferError) as exc:
            status = exc.code.name
            logger.info("prefill failed: %s", exc)
            await context.abort(exc.code, exc.message)
        except EngineError as exc:
            status = "INTERNAL"
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        finally:
            self.metrics.requests.labels("Prefill", status).inc()
            self.metrics.e2e.labels("Prefill").observe(time.perf_counter() - start)

    async def Abort(self, request: worker_pb2.AbortRequest, context):  # noqa: N802
        request_id_var.set(request.request_id)
        task = self._tasks.get(request.request_id)
        known = await asyncio.wrap_future(self.engine.abort(request.request_id))
        if task is not None:
            task.cancel()
        if task is not None or known:
            logger.info("aborted: %s", request.reason or "no reason given")
        return worker_pb2.AbortResponse(found=task is not None or known)

    async def GetStats(self, request, context):  # noqa: N802
        s = self.engine.stats()
        return worker_pb2.WorkerStats(
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
            num_running=s.num_running, num_waiting=s.num_waiting, block_size=s.block_size)

    # ------------------------------------------------------------- helpers
    def _validate(self, request: worker_pb2.PrefillRequest):
        if not request.request_id:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        prompt = list(request.prompt_token_ids)
        try:
            self.engine.engine.validate_prompt(prompt)  # reads only the model's config
        except ValueError as exc:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids: {exc}") from None
        try:
            params = sampling_params_from_proto(request.sampling, self.engine.max_model_len)
        except ValueError as exc:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}") from None
        dest = request.destination
        if not dest.address or not dest.reservation_id:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           "destination.address and destination.reservation_id must be set")
        if dest.HasField("layout"):
            try:
                theirs = BlockLayout.from_proto(dest.layout)
            except KVTransferError as exc:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"destination.layout: {exc.message}") from None
            if theirs != self.layout:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"destination.layout {theirs.dtype_name} {list(theirs.block_shape)} differs from "
                               f"this worker's {self.layout.dtype_name} {list(self.layout.block_shape)}")
        return prompt, params, KVDestination(dest.address, dest.reservation_id)

    async def _prefill(self, request_id: str, prompt: list[int], params, destination: KVDestination,
                       start: float) -> worker_pb2.PrefillResponse:
        # Stop strings are the gateway's (and decode's) business; the first token's draw is not
        # affected by them or by max_tokens.
        first_params = dataclasses.replace(params, max_tokens=1, stop=[])
        final = None
        try:
            try:
                stream = self.engine.generate(request_id, prompt, first_params, hold_blocks=True)
                async with contextlib.aclosing(stream) as outputs:
                    async for out in outputs:
                        final = out
            except ValueError as exc:  # e.g. a duplicate request id in the engine
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if final is None or any(c.finish_reason == "abort" for c in final.outputs):
                raise RpcError(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted")
            self.metrics.ttft.observe(time.perf_counter() - start)
            block_ids = await self.engine.prompt_blocks(request_id)
            sent_at = time.perf_counter()
            try:
                async with asyncio.timeout(self.lease_s):
                    await self.sender.send(self.engine.kv_cache, block_ids, destination, request_id)
            except TimeoutError:
                raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"the prefill lease ({self.lease_s:g} s) ran out before the KV transfer "
                               "was acknowledged") from None
            self.metrics.kv_transfer_seconds.observe(time.perf_counter() - sent_at)
            self.metrics.kv_bytes.inc(len(block_ids) * self.layout.block_nbytes)
        finally:
            self.engine.release(request_id)  # no-op unless held; safe while being cancelled
        seed_state = worker_pb2.SeedState(seed=params.seed) if params.seed is not None else worker_pb2.SeedState()
        return worker_pb2.PrefillResponse(
            first_tokens=[token_logprobs(c.token_ids[0], c.logprobs[0], params.logprobs) for c in final.outputs],
            num_cached_tokens=final.num_cached_tokens, seed_state=seed_state)
