"""The decode worker's gRPC servicer (``tandem.v1.DecodeWorker``).

Blocks move through three owners: ``Admit`` reserves them on the engine thread (reusing the
leading blocks the prefix cache holds) and hands them to the ``ReservationTable`` under a
lease; ``TransferKV`` fills the rest (bytes in the stream, or read from the prefill worker's
pool with NIXL), each block verified where it landed against the sender's digests before it
counts as arrived (a mismatch fails the transfer: ``ABORTED``, the reservation released);
``Decode`` claims them and the engine's sequences own them from then on. With
``local_prefill`` (conditional disaggregation: few prompt tokens left after the prefix hit)
``Decode`` prefills the prompt here instead, the reservation handed to the request. Every exit
path (expired lease, failed transfer, Abort, a cancelled Decode stream) gives the blocks back
to the pool. With ``serves_prefill`` the worker also serves ``tandem.v1.PrefillWorker``
(:class:`cluster.prefill_service.PrefillService`, on the same port, pool and NIXL agent): it
prefills prompts for other decode workers and sends them the KV, its pinned blocks unpinned
once the transfer ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from cluster import tracing
from cluster.log import request_id_var
from cluster.metrics import WorkerMetrics
from cluster.prefill_service import PrefillService
from cluster.registry import Role
from cluster.translate import (
    check_cache_salt, check_prompt_ids, check_request_id, engine_refusal, finish_reason_to_proto,
    sampling_params_from_proto, token_logprobs, worker_config_to_proto,
)
from cluster.worker import Admission, abort_request_id, kv_transport, published_config, request_outcome
from decode_worker.settings import DecodeWorkerSettings
from decode_worker.spot_check import SpotChecker, spot_check
from engine.core.core_client import EngineCoreClient
from engine.block_hash import prompt_key
from engine.core.block_pool import NoFreeBlocksError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer import KVTransferServicer, KVPool, KVReceiver, ReservationTable
from protos.status import StatusError
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 0.25


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Admits (reserves blocks), receives KV, and streams the generated tokens.

    Args:
        engine: the worker's running engine.
        settings: ``lease_s`` (reservation lease), ``stream_interval``, ``serves_prefill``, the KV
            transport settings and the request caps are used.
        metrics: the worker's metrics.

    Raises:
        cluster.server.StartupError: ``kv_transport`` is ``nixl`` and NIXL cannot start.
    """

    service_name = "tandem.v1.DecodeWorker"
    # KV comes from the workers that prefill (prefill workers and decode workers lent to
    # prefill), so only their blocks can enter the prefix cache.
    peer_roles = {"Admit": ("gateway",), "TransferKV": ("prefill", "decode"), "Decode": ("gateway",),
                  "Abort": ("gateway",), "GetStats": ("gateway", "prefill", "decode")}

    def __init__(self, engine: EngineCoreClient, settings: DecodeWorkerSettings, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.limits = settings.limits
        self.stream_interval = settings.stream_interval
        self.table = ReservationTable(engine.free_blocks, lease_s=settings.lease_s)
        pool = KVPool(engine.kv_pools)
        _, self.nixl = kv_transport(settings, settings.resolved_worker_id(str(Role.DECODE)), pool)
        self.kv_receiver = KVTransferServicer(
            KVReceiver(pool, self.table, nixl=self.nixl, verify_checksums=settings.kv_verify_checksums),
            on_integrity_failure=lambda transport: metrics.kv_integrity_failures.labels(transport).inc())
        self.spot_checker = SpotChecker(engine, pool, settings.kv_spot_check_rate)
        self.layout = pool.layout
        transports = self.kv_receiver.receiver.transports
        self.config = published_config(engine.info, engine.kv_pools, transports, settings.serves_prefill)
        self.admission = Admission()
        self.lent = (PrefillService(engine, settings, metrics, Role.DECODE, pool, transports, self.nixl, self.config,
                                    self.admission) if settings.serves_prefill else None)
        self._decoding: set[str] = set()
        self._expiry: asyncio.Task[None] | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)
        if self.lent is not None:
            self.lent.add_to_server(server)
        self._expiry = asyncio.get_running_loop().create_task(self.table.run_expiry(EXPIRY_INTERVAL_S))

    def services(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """``tandem.v1.DecodeWorker``, and ``tandem.v1.PrefillWorker`` where it serves prefill."""
        return {self.service_name: self.peer_roles, **(self.lent.services() if self.lent is not None else {})}

    def pending(self) -> int:
        """Reservations waiting for their KV or their Decode call."""
        return len(self.table)

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        self.table.release_all("worker shutting down")
        if self.lent is not None:
            await self.lent.close()
        if self.nixl is not None:
            self.nixl.close()

    # ----------------------------------------------------------------- RPCs
    async def Admit(self, request: worker_pb2.AdmitRequest, context):  # noqa: N802
        request_id = request.request_id
        try:
            check_request_id(request_id)
            request_id_var.set(request_id)
            self.admission.check()
            prompt = list(request.prompt_token_ids)
            check_prompt_ids("prompt_token_ids", prompt, self.config.max_model_len, self.config.vocab_size)
            check_cache_salt(request.cache_salt)
            params = sampling_params_from_proto(request.sampling, len(prompt), self.config, self.limits)
            if request_id in self._decoding:
                raise StatusError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already decoding")
            try:
                block_ids, num_cached = await self.engine.reserve_blocks(prompt, request.cache_salt, params)
            except NoFreeBlocksError as exc:
                raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room for the prompt's KV: {exc}") from None
            except ValueError as exc:  # the engine refuses the parameters (a grammar it cannot compile)
                raise engine_refusal(exc) from None
            try:
                reservation = self.table.reserve(request_id, block_ids, num_cached=num_cached,
                                                 prompt_key=prompt_key(prompt, request.cache_salt))
            except StatusError:
                self.engine.free_blocks(block_ids)
                raise
        except StatusError as exc:
            self.metrics.requests.labels("Admit", exc.code.name).inc()
            await context.abort(exc.code, exc.message)
        self.metrics.requests.labels("Admit", "OK").inc()
        return worker_pb2.AdmitResponse(
            reservation_id=reservation.reservation_id, num_blocks=reservation.num_blocks,
            lease_ms=round(reservation.lease_s * 1000), layout=self.layout.to_proto(),
            num_cached_blocks=num_cached, kv_transports=self.kv_receiver.receiver.transports,
            kv_spot_check=self.spot_checker.wanted(request.kv_spot_check))

    async def TransferKV(self, request_iterator, context):  # noqa: N802
        start = time.perf_counter()
        response, transport = await self.kv_receiver.transfer_kv(request_iterator, context)
        self.metrics.kv_transfer_seconds.labels(transport).observe(time.perf_counter() - start)
        self.metrics.kv_transfers.labels(transport, "OK").inc()
        self.metrics.kv_bytes.labels(transport).inc(response.num_blocks_received * self.layout.block_nbytes)
        tracing.annotate({"tandem.kv.transport": transport, "tandem.kv.blocks": response.num_blocks_received})
        return response

    async def Decode(self, request: worker_pb2.DecodeRequest, context):  # noqa: N802
        request_id = request.request_id
        with self.admission.track():
            async with request_outcome("Decode", self.metrics, context) as start:
                prompt, params, first = self._validate(request)
                request_id_var.set(request_id)
                if request_id in self._decoding:
                    raise StatusError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already decoding")
                salt, key = request.cache_salt, prompt_key(prompt, request.cache_salt)
                if request.local_prefill:
                    block_ids = self.table.take(request.reservation_id, request_id, key)  # now ours to free
                    outputs = self.engine.generate(request_id, prompt, params, release_blocks=block_ids,
                                                   cache_salt=salt)
                    self.metrics.local_prefills.inc()
                else:
                    num_cached = self.table.get(request.reservation_id).num_cached
                    block_ids = self.table.claim(request.reservation_id, request_id, key)  # now ours to free
                    if request.kv_spot_check:
                        await spot_check(self.spot_checker, self.engine, self.metrics, request_id, prompt, block_ids,
                                         num_cached)
                    outputs = self.engine.add_prefilled(request_id, prompt, first, params, block_ids, salt)
                self._decoding.add(request_id)
                try:
                    async for response in self._stream(outputs, params, 1 if first else 0, start):
                        yield response
                finally:
                    self._decoding.discard(request_id)

    async def Abort(self, request: worker_pb2.AbortRequest, context):  # noqa: N802
        request_id = await abort_request_id(request, context)
        reserved = self.table.release_request(request_id, f"aborted: {request.reason or 'no reason'}")
        running = await self.engine.abort(request_id)
        if reserved or running:
            logger.info("aborted: %s", request.reason or "no reason given")
        return worker_pb2.AbortResponse(found=reserved or running)

    async def GetStats(self, request, context):  # noqa: N802
        s = self.engine.stats()
        return worker_pb2.WorkerStats(
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks, num_running=s.num_running,
            num_waiting=s.num_waiting + len(self.table), config=worker_config_to_proto(self.config, Role.DECODE))

    # ------------------------------------------------------------- helpers
    def _validate(self, request: worker_pb2.DecodeRequest) -> tuple[list[int], SamplingParams, list[int]]:
        check_request_id(request.request_id)
        if not request.reservation_id:
            raise StatusError.invalid_argument("reservation_id", "must not be empty")
        prompt = list(request.prompt_token_ids)
        check_prompt_ids("prompt_token_ids", prompt, self.config.max_model_len, self.config.vocab_size)
        check_cache_salt(request.cache_salt)
        params = sampling_params_from_proto(request.sampling, len(prompt), self.config, self.limits,
                                            request.num_resumed_tokens)
        first = list(request.first_token_ids)
        wanted = 0 if request.local_prefill else params.n
        if len(first) != wanted:
            raise StatusError.invalid_argument(
                "first_token_ids", f"has {len(first)} tokens; {wanted} expected (sampling.n={params.n}, "
                                   f"local_prefill={request.local_prefill})")
        if any(t >= self.config.vocab_size for t in first):
            raise StatusError.invalid_argument("first_token_ids", f"must be in [0, {self.config.vocab_size})")
        return prompt, params, first

    async def _stream(self, outputs: AsyncIterator[RequestOutput], params: SamplingParams, num_first: int,
                      start: float):
        """Each sample's new tokens (after the ``num_first`` of each, 1 or 0, that the prefill
        worker already returned), ``stream_interval`` or more a message; a sample's first token
        (a local prefill's) goes alone at once, as it sets the time to first token; a sample's
        last message has its finish reason."""
        sent = [num_first] * params.n
        done = [False] * params.n
        try:
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    for c in out.outputs:
                        # The output grows in place while this generator waits on its yield:
                        # what a message carries is fixed before it is sent.
                        i, end, finished = c.index, len(c.token_ids), c.finished
                        held = sent[i] > 0 and end - sent[i] < self.stream_interval
                        if done[i] or (held and not finished):
                            continue
                        yield worker_pb2.DecodeResponse(
                            index=i, token_ids=c.token_ids[sent[i]:end],
                            logprobs=[token_logprobs(t, lp, params.logprobs)
                                      for t, lp in zip(c.token_ids[sent[i]:end], c.logprobs[sent[i]:end])],
                            finish_reason=finish_reason_to_proto(c.finish_reason))
                        sent[i], done[i] = end, finished
                        if finished and end > 1:
                            self.metrics.tpot.observe((time.perf_counter() - start) / (end - 1))
        except ValueError as exc:  # the engine refused the request (blocks already freed)
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
