"""The prefill service (``tandem.v1.PrefillWorker``), served by a prefill worker
(:mod:`prefill_worker.server`) and by a decode worker lent to prefill (``serves_prefill``,
:mod:`decode_worker.server`): one implementation for both.

A prefill is the engine told to stop after the first token: the request runs with
``max_tokens=1`` and ``pin_prompt_blocks=True``, so each prompt block is pinned as soon as the
chunk that fills it is computed, and stays pinned after the request finishes. The transfer into
the decode worker's reservation is opened before the prefill starts (the open stream keeps the
reservation alive however long the prefill takes); each block is sent as soon as it is pinned
(chunked prefill is the pipeline: only the last chunk's transfer is on the time to first
token), except the leading ones the decode worker already holds; the blocks are unpinned when
the transfer is acknowledged, fails or is aborted. Blocks go by NIXL where both workers have it
(the decode worker reads them from this pool), else in the gRPC stream. The first token's
finish reason is decided here from the request's real parameters (EOS, stop token ids,
``max_tokens``, ``max_model_len``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time

import grpc
from redis.exceptions import RedisError

from cluster import tracing
from cluster.channels import ChannelCache, client_keepalive_options
from cluster.identity import InstanceVerifier
from cluster.log import request_id_var
from cluster.metrics import WorkerMetrics
from cluster.registry import ClusterNamespace, Role, WorkerConfig, WorkerRegistry, redis_client
from cluster.server import Admission
from cluster.settings import WorkerSettings
from cluster.translate import (
    check_cache_salt, check_prompt_ids, check_request_id, finish_reason_to_proto, sampling_params_from_proto,
    token_logprobs, worker_config_to_proto,
)
from cluster.tls import role_name
from cluster.worker import abort_request_id, request_outcome, worker_tls
from engine.core.core_client import EngineCoreClient
from engine.core.stop import check_stop
from engine.sampling_params import SamplingParams
from kvtransfer import GRPC_MESSAGE_OPTIONS, BlockLayout, KVTransferClient, KVDestination, KVPool, KVSender
from kvtransfer.nixl import NixlAgent
from protos.status import StatusError
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

DESTINATION_REREAD_S = 0.2  # a KV destination missing from the last registry read waits this long for another


class PrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    """Validates, runs the prefill on the engine, pushes the KV, returns the first tokens.

    Args:
        engine: the worker's running engine.
        settings: ``max_num_seqs`` (queue bound), the Redis, TLS and checksum settings and the
            request caps are used.
        metrics: the worker's metrics.
        role: the worker's pool: it dials decode workers with that role's certificate and
            reports it in ``GetStats``.
        pool: the worker's KV pool.
        transports: the KV transports the worker moves blocks with, preferred first.
        nixl: the worker's NIXL agent (its pool registered) where ``transports`` has NIXL; its
            owner, the worker's servicer, closes it.
        config: what the worker publishes.
        admission: the worker's admission (a drain closes it for every service of the worker).
        sender: the KV transport (default: ``transports`` over the worker's channels to decode
            workers).
    """

    service_name = "tandem.v1.PrefillWorker"
    peer_roles = {"Prefill": ("gateway",), "Abort": ("gateway",), "GetStats": ("gateway", "prefill", "decode")}

    def __init__(self, engine: EngineCoreClient, settings: WorkerSettings, metrics: WorkerMetrics, role: Role,
                 pool: KVPool, transports: list[str], nixl: NixlAgent | None, config: WorkerConfig,
                 admission: Admission, sender: KVSender | None = None) -> None:
        self.engine = engine
        self.limits = settings.limits
        self.max_waiting = settings.engine.max_num_seqs  # queued requests at most (back-pressure)
        self.metrics = metrics
        self.role = role
        tls = worker_tls(settings, role)
        # KV goes only to a peer that proves it is a decode worker of this cluster (with TLS) and
        # that is registered as one (with Redis).
        self.channels = ChannelCache(
            [*GRPC_MESSAGE_OPTIONS, *client_keepalive_options(settings.keepalive_time_s, settings.keepalive_timeout_s)],
            tls, peer_name=role_name("decode"))
        self._registry = (WorkerRegistry(redis_client(settings.redis_url, password=settings.redis_password,
                                                      tls_ca=settings.redis_tls_ca),
                                         ClusterNamespace(settings.redis_key_prefix, settings.registry_ttl_s))
                          if settings.redis_url else None)
        self._registry_ttl_s = settings.registry_ttl_s
        # Under TLS a decode entry counts only if the certificate on its address names it.
        self._identity = InstanceVerifier(settings.tls_dir, str(role)) if settings.tls_dir else None
        self._decode_seen: dict[str, float] = {}  # decode worker address -> when a registry read last listed it
        self._decode_read_at = -1.0
        self.pool = pool
        self.sender = sender or KVTransferClient(self.channels.get, transports=transports, nixl=nixl,
                                             verify_checksums=settings.kv_verify_checksums)
        self.layout = pool.layout
        self.config = config
        self.admission = admission
        self._tasks: dict[str, asyncio.Task[worker_pb2.PrefillResponse]] = {}

    def add_to_server(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    def services(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """This service's name and, per method, the roles that may call it (``cluster.tls``)."""
        return {self.service_name: self.peer_roles}

    async def close(self) -> None:
        """Close the channels to decode workers and the registry client (not the NIXL agent:
        its owner's)."""
        await self.channels.close()
        if self._registry is not None:
            await self._registry.client.aclose()

    # ----------------------------------------------------------------- RPCs
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        request_id = request.request_id
        async with request_outcome("Prefill", self.metrics, context) as start:
            self.admission.check()
            with self.admission.track():
                prompt, params, destination = self._validate(request)
                request_id_var.set(request_id)
                await self._check_destination(destination.address)
                if self.engine.stats().num_waiting >= self.max_waiting:
                    raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"prefill queue is full ({self.max_waiting} requests waiting)")
                if request_id in self._tasks:
                    raise StatusError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already prefilling")
                task = asyncio.ensure_future(self._prefill(request_id, prompt, params, destination, start,
                                                           request.cache_salt))
                self._tasks[request_id] = task
                try:
                    return await task
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise  # the call itself ended (client gone, deadline)
                    raise StatusError(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted") from None
                finally:
                    self._tasks.pop(request_id, None)

    async def Abort(self, request: worker_pb2.AbortRequest, context):  # noqa: N802
        request_id = await abort_request_id(request, context)
        task = self._tasks.get(request_id)
        known = await self.engine.abort(request_id)
        if task is not None:
            task.cancel()
        if task is not None or known:
            logger.info("aborted: %s", request.reason or "no reason given")
        return worker_pb2.AbortResponse(found=task is not None or known)

    async def GetStats(self, request, context):  # noqa: N802
        s = self.engine.stats()
        return worker_pb2.WorkerStats(
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks, num_running=s.num_running,
            num_waiting=s.num_waiting, config=worker_config_to_proto(self.config, self.role))

    # ------------------------------------------------------------- helpers
    def _validate(self, request: worker_pb2.PrefillRequest) -> tuple[list[int], SamplingParams, KVDestination]:
        check_request_id(request.request_id)
        prompt = list(request.prompt_token_ids)
        check_prompt_ids("prompt_token_ids", prompt, self.config.max_model_len, self.config.vocab_size)
        check_cache_salt(request.cache_salt)
        params = sampling_params_from_proto(request.sampling, len(prompt), self.config, self.limits,
                                            request.num_resumed_tokens)
        dest = request.destination
        if not dest.address or not dest.reservation_id:
            raise StatusError.invalid_argument("destination", "address and reservation_id must be set")
        num_blocks = -(-len(prompt) // self.config.block_size)
        if dest.num_cached_blocks > num_blocks:
            raise StatusError.invalid_argument("destination.num_cached_blocks",
                                               f"is {dest.num_cached_blocks}, more than the prompt's {num_blocks} blocks")
        if dest.HasField("layout"):
            theirs = BlockLayout.from_proto(dest.layout)
            if theirs != self.layout:
                raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"destination.layout {theirs.dtype_name} {list(theirs.block_shape)} differs from "
                                  f"this worker's {self.layout.dtype_name} {list(self.layout.block_shape)}")
        return prompt, params, KVDestination(dest.address, dest.reservation_id, dest.num_cached_blocks,
                                             tuple(dest.kv_transports) or ("grpc",))

    async def _check_destination(self, address: str) -> None:
        """Refuse a KV destination that is not a live decode worker of the registry: one listed
        (with TLS: whose address presents its instance's certificate, ``cluster.identity``)
        by a registry read within the last ``registry_ttl_s`` (the life of a registry entry
        after its heartbeat, so a Redis restarted empty does not refuse a worker before it
        registers again). The registry is re-read on a miss, at most every
        ``DESTINATION_REREAD_S``. Without Redis there is no registry to ask: the address is used
        as given (with TLS its certificate is still checked).

        Raises:
            StatusError: ``PERMISSION_DENIED`` naming ``destination.address``; ``UNAVAILABLE``
                when Redis cannot be read.
        """
        if self._registry is None:
            return
        now = time.monotonic()

        def live() -> bool:
            return now - self._decode_seen.get(address, -math.inf) < self._registry_ttl_s

        if not live() and now - self._decode_read_at >= DESTINATION_REREAD_S:
            try:
                workers = await self._registry.live_workers(Role.DECODE)
            except (RedisError, OSError) as exc:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"cannot read the registry: {exc}") from None
            if self._identity is not None:
                workers = await self._identity.trusted(workers)
            self._decode_seen = {a: t for a, t in self._decode_seen.items() if now - t < self._registry_ttl_s}
            self._decode_seen.update((w.address, now) for w in workers)
            self._decode_read_at = now
        if not live():
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED,
                              "destination.address: is not a registered decode worker")

    async def _prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                       destination: KVDestination, start: float, cache_salt: str) -> worker_pb2.PrefillResponse:
        # Stop strings are the gateway's business; the first token's draw does not depend on
        # them or on max_tokens (min_tokens only says whether it may be EOS).
        first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=[])
        final, transport = None, "-"
        prefill_context = tracing.current_context()  # the chunks' parent: the Prefill call's span
        try:
            # The transfer's span is current while its stream opens, so the decode worker's
            # TransferKV continues it; the chunks run inside it (each one's blocks leave as it ends).
            with tracing.span("kv_transfer", {"tandem.kv.destination": destination.address}) as transfer_span:
                async with self.sender.open(destination, request_id) as transfer:
                    transport, sent = transfer.transport, destination.num_cached_blocks
                    try:
                        stream = self.engine.generate(request_id, prompt, first_params, pin_prompt_blocks=True,
                                                      cache_salt=cache_salt)
                        chunk_started, chunks = time.time_ns(), 0
                        async with contextlib.aclosing(stream) as outputs:
                            async for out in outputs:
                                final, ready = out, out.pinned_block_ids[sent:]
                                tracing.record("prefill_chunk", chunk_started, time.time_ns(),
                                               {"tandem.chunk": chunks, "tandem.chunk.blocks": len(ready)},
                                               prefill_context)
                                if ready:  # blocks the last chunk completed: on their way at once
                                    await transfer.send(self.pool, sent, ready)
                                    sent += len(ready)
                                chunk_started, chunks = time.time_ns(), chunks + 1
                    except ValueError as exc:  # e.g. a duplicate request id in the engine
                        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
                    if final is None or any(c.finish_reason == "abort" for c in final.outputs):
                        raise StatusError(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted")
                    self.metrics.ttft.observe(time.perf_counter() - start)
                    last_chunk_at = time.perf_counter()
                    await transfer.finish()
                    tracing.annotate({"tandem.kv.transport": transport, "tandem.kv.blocks": transfer.num_sent,
                                      "tandem.kv.bytes": transfer.num_sent * self.layout.block_nbytes,
                                      "tandem.kv.cached_blocks": destination.num_cached_blocks}, transfer_span)
            self.metrics.kv_transfer_seconds.labels(transport).observe(time.perf_counter() - last_chunk_at)
            self.metrics.kv_transfers.labels(transport, "OK").inc()
            self.metrics.kv_bytes.labels(transport).inc(transfer.num_sent * self.layout.block_nbytes)
        except StatusError as exc:
            self.metrics.kv_transfers.labels(transport, exc.code.name).inc()
            raise
        finally:
            self.engine.release(request_id)  # no-op unless pinned; safe while being cancelled
        info = self.engine.info
        reasons = [check_stop(params, c.token_ids[0], 1, len(prompt) + 1, info.eos_token_ids, info.max_model_len)
                   for c in final.outputs]
        return worker_pb2.PrefillResponse(
            first_tokens=[token_logprobs(c.token_ids[0], c.logprobs[0], params.logprobs) for c in final.outputs],
            finish_reasons=[finish_reason_to_proto(r) for r in reasons], num_cached_tokens=final.num_cached_tokens,
            kv_transport=transport)
