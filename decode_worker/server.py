"""The decode worker's gRPC servicer (``tandem.v1.DecodeWorker``).

Blocks move through three owners: ``Admit`` allocates them on the engine thread and hands them
to the ``ReservationTable`` under a lease; ``TransferKV`` fills them; ``Decode`` claims them and
the engine's sequences own them from then on. Every exit path (expired lease, failed transfer,
Abort, a cancelled Decode stream) gives them back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from engine.block_pool import NoFreeBlocksError
from engine.serving.async_engine import AsyncEngine, EngineError
from engine.serving.metrics import WorkerMetrics
from engine.serving.server import (
    Admission, RpcError, finish_reason_to_proto, request_id_var, sampling_params_from_proto, token_logprobs,
)
from engine.serving.settings import WorkerSettings
from kvtransfer import GrpcKVReceiver, KVReceiver, KVTransferError, ReservationTable
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 0.25


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Admits (reserves blocks), receives KV, and streams the tokens after the first ones.

    Args:
        engine: the worker's running engine.
        settings: ``lease_s`` (default reservation lease) is used.
        metrics: the worker's metrics.
    """

    service_name = "tandem.v1.DecodeWorker"

    def __init__(self, engine: AsyncEngine, settings: WorkerSettings, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.table = ReservationTable(engine.free_blocks, lease_s=settings.lease_s)
        self.kv_receiver = GrpcKVReceiver(KVReceiver(engine.kv_cache, self.table))
        self.layout = self.kv_receiver.receiver.layout
        self.admission = Admission()
        self._decoding: set[str] = set()
        self._expiry: asyncio.Task[None] | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)
        self._expiry = asyncio.get_running_loop().create_task(self.table.run_expiry(EXPIRY_INTERVAL_S))

    def pending(self) -> int:
        """Reservations waiting for their KV or their Decode call."""
        return len(self.table)

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        self.table.release_all("worker shutting down")

    # ----------------------------------------------------------------- RPCs
    async def Admit(self, request: worker_pb2.AdmitRequest, context):  # noqa: N802
        request_id = request.request_id
        request_id_var.set(request_id)
        await self.admission.check(context)
        try:
            if not request_id:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
            num_tokens = request.num_prompt_tokens
            if not 1 <= num_tokens < self.engine.max_model_len:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"num_prompt_tokens must be in [1, {self.engine.max_model_len - 1}], got {num_tokens}")
            if request_id in self._decoding:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already decoding")
            lease_s = request.lease_ms / 1000 if request.lease_ms else self.table.lease_s
            try:
                block_ids = await self.engine.reserve_blocks(num_tokens)
            except NoFreeBlocksError as exc:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room for the prompt's KV: {exc}") from None
            try:
                reservation = self.table.reserve(request_id, block_ids, lease_s)
            except KVTransferError:
                self.engine.free_blocks(block_ids)
                raise
        except (RpcError, KVTransferError) as exc:
            self.metrics.requests.labels("Admit", exc.code.name).inc()
            await context.abort(exc.code, exc.message)
        self.metrics.requests.labels("Admit", "OK").inc()
        return worker_pb2.AdmitResponse(
            reservation_id=reservation.reservation_id, num_blocks=reservation.num_blocks,
            lease_ms=round(lease_s * 1000), layout=self.layout.to_proto())

    async def TransferKV(self, request_iterator, context):  # noqa: N802
        start = time.perf_counter()
        response = await self.kv_receiver.transfer_kv(request_iterator, context)
        self.metrics.kv_transfer_seconds.observe(time.perf_counter() - start)
        self.metrics.kv_bytes.inc(response.num_blocks_received * self.layout.block_nbytes)
        return response

    async def Decode(self, request: worker_pb2.DecodeRequest, context):  # noqa: N802
        request_id = request.request_id
        request_id_var.set(request_id)
        start, status = time.perf_counter(), "OK"
        with self.admission.track():
            try:
                params, first = self._validate(request)
                if request_id in self._decoding:
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already decoding")
                block_ids = self.table.claim(request.reservation_id, request_id)  # now ours to free
                self._decoding.add(request_id)
                try:
                    async for response in self._stream(request_id, list(request.prompt_token_ids), first,
                                                       params, block_ids, start):
                        yield response
                finally:
                    self._decoding.discard(request_id)
            except (RpcError, KVTransferError) as exc:
                status = exc.code.name
                logger.info("decode failed: %s", exc)
                await context.abort(exc.code, exc.message)
            except EngineError as exc:
                status = "INTERNAL"
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
            except (asyncio.CancelledError, GeneratorExit):
                status = "CANCELLED"
                raise
            finally:
                self.metrics.requests.labels("Decode", status).inc()
                self.metrics.e2e.labels("Decode").observe(time.perf_counter() - start)

    async def Abort(self, request: worker_pb2.AbortRequest, context):  # noqa: N802
        request_id_var.set(request.request_id)
        reserved = self.table.release_request(request.request_id, f"aborted: {request.reason or 'no reason'}")
        running = await asyncio.wrap_future(self.engine.abort(request.request_id))
        if reserved or running:
            logger.info("aborted: %s", request.reason or "no reason given")
        return worker_pb2.AbortResponse(found=reserved or running)

    async def GetStats(self, request, context):  # noqa: N802
        s = self.engine.stats()
        return worker_pb2.WorkerStats(
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
            num_running=s.num_running, num_waiting=s.num_waiting + len(self.table), block_size=s.block_size)

    # ------------------------------------------------------------- helpers
    def _validate(self, request: worker_pb2.DecodeRequest):
        if not request.request_id:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        if not request.reservation_id:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "reservation_id must not be empty")
        try:
            self.engine.engine.validate_prompt(list(request.prompt_token_ids))  # reads only the config
        except ValueError as exc:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids: {exc}") from None
        try:
            params = sampling_params_from_proto(request.sampling, self.engine.max_model_len)
        except ValueError as exc:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}") from None
        first = list(request.first_token_ids)
        if len(first) != params.n:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"first_token_ids has {len(first)} tokens for sampling.n={params.n}")
        if any(t >= self.engine.vocab_size for t in first):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"first_token_ids must be in [0, {self.engine.vocab_size})")
        return params, first

    async def _stream(self, request_id: str, prompt: list[int], first: list[int], params, block_ids: list[int],
                      start: float):
        """Deltas of each sample after its first token; a sample's last message has its finish reason."""
        sent = [1] * params.n  # the first token of every sample is the prefill worker's
        done = [False] * params.n
        outputs = self.engine.add_prefilled(request_id, prompt, first, params, block_ids)
        try:
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    for c in out.outputs:
                        i = c.index
                        if done[i] or (len(c.token_ids) == sent[i] and not c.finished):
                            continue
                        yield worker_pb2.DecodeResponse(
                            index=i, token_ids=c.token_ids[sent[i]:],
                            logprobs=[token_logprobs(t, lp, params.logprobs)
                                      for t, lp in zip(c.token_ids[sent[i]:], c.logprobs[sent[i]:])],
                            finish_reason=finish_reason_to_proto(c.finish_reason))
                        sent[i], done[i] = len(c.token_ids), c.finished
                        if c.finished and sent[i] > 1:
                            self.metrics.tpot.observe((time.perf_counter() - start) / (sent[i] - 1))
        except ValueError as exc:  # the engine refused the request (blocks already freed)
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
