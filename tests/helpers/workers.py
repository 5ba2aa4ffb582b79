"""A prefill worker and a decode worker in the test's process, each with its own engine, on real
grpc.aio servers on loopback ephemeral ports (and the shared Redis under a test key prefix),
and a real gateway in front of them; or, in the prefill worker's place, a decode worker that
also serves prefill (a lender)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.metrics import WorkerMetrics
from cluster.registry import Role
from cluster.settings import WorkerSettings
from cluster.tls import issue_instance_cert
from cluster.worker import WorkerServer
from decode_worker.server import DecodeServicer
from decode_worker.settings import DecodeWorkerSettings
from engine import EngineCore
from engine.core.core_client import EngineCoreClient
from gateway.server import Gateway, load_served_model
from gateway.settings import GatewaySettings
from kvtransfer import GRPC_MESSAGE_OPTIONS
from prefill_worker.server import PrefillServicer
from protos.tandem.v1 import worker_pb2_grpc


@dataclass
class Worker:
    """One started worker: its server, its engine, and a plaintext channel and stub to it."""

    server: WorkerServer
    engine: EngineCoreClient
    channel: grpc.aio.Channel
    stub: object

    @property
    def address(self) -> str:
        return self.server.address


@dataclass
class Pair:
    """A started prefill worker and decode worker."""

    prefill: Worker
    decode: Worker


def settings(role: Role, **overrides) -> WorkerSettings:
    """The settings of a worker of ``role`` on a free loopback port, without Redis, plaintext
    unless ``tls_dir`` is given; ``overrides`` are further fields (one the role does not read
    is ignored)."""
    cls = WorkerSettings if role is Role.PREFILL else DecodeWorkerSettings
    return cls(**{"listen": "127.0.0.1:0", "redis_url": "", "drain_timeout_s": 5.0,
                  "insecure": not overrides.get("tls_dir"), **overrides})


@contextlib.asynccontextmanager
async def worker(llm: EngineCore, role: Role, **overrides) -> AsyncIterator[Worker]:
    """A started worker of ``role`` running ``llm`` (:func:`settings` with ``overrides``); shut
    down on exit."""
    engine = await EngineCoreClient.embed(llm)
    s = settings(role, **overrides)
    metrics = WorkerMetrics(str(role), engine.stats)
    if role is Role.PREFILL:
        servicer, stub_cls = PrefillServicer(engine, s, metrics), worker_pb2_grpc.PrefillWorkerStub
    else:
        servicer, stub_cls = DecodeServicer(engine, s, metrics), worker_pb2_grpc.DecodeWorkerStub
    server = WorkerServer(s, role, engine, servicer, metrics)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address, options=GRPC_MESSAGE_OPTIONS)
    try:
        yield Worker(server, engine, channel, stub_cls(channel))
    finally:
        await channel.close()
        await server.shutdown()


@contextlib.asynccontextmanager
async def pair(engines, prefill: dict | None = None, decode: dict | None = None, **overrides) -> AsyncIterator[Pair]:
    """A prefill worker on ``engines[0]`` and a decode worker on ``engines[1]`` (:func:`worker`
    with ``overrides``, and ``prefill`` / ``decode`` for one of them: its own TLS directory, say)."""
    async with worker(engines[0], Role.PREFILL, **overrides, **(prefill or {})) as p, \
            worker(engines[1], Role.DECODE, **overrides, **(decode or {})) as d:
        yield Pair(p, d)


def instance_tls(ca_dir: Path, role: Role, worker_id: str) -> dict[str, str]:
    """The overrides of a worker registering as ``worker_id`` with a certificate of its own
    instance issued from ``ca_dir``'s CA (into ``ca_dir/instances/{worker_id}``)."""
    out = ca_dir / "instances" / worker_id
    issue_instance_cert(str(ca_dir), str(role), worker_id, str(out))
    return {"tls_dir": str(out), "worker_id": worker_id}


@contextlib.asynccontextmanager
async def lending_pair(engines, **overrides) -> AsyncIterator[Pair]:
    """A decode worker that also serves prefill (``serves_prefill``) on ``engines[0]`` in the
    prefill side's place, its stub a ``PrefillWorkerStub``, and a decode worker on ``engines[1]``
    (:func:`worker`)."""
    async with worker(engines[0], Role.DECODE, serves_prefill=True, **overrides) as lender, \
            worker(engines[1], Role.DECODE, **overrides) as d:
        yield Pair(dataclasses.replace(lender, stub=worker_pb2_grpc.PrefillWorkerStub(lender.channel)), d)


@contextlib.asynccontextmanager
async def gateway_over(engines, **settings) -> AsyncIterator[tuple[Pair, Gateway, str]]:
    """A real gateway (plaintext, the pair's static addresses, every prompt through the prefill
    worker unless ``settings`` say otherwise) in front of a :func:`pair`; yields the pair, the
    gateway and its address."""
    async with pair(engines) as p:
        config = GatewaySettings(**{"listen": "127.0.0.1:0", "metrics_port": 0, "insecure": True,
                                    "static_prefill": [p.prefill.address], "static_decode": [p.decode.address],
                                    "refresh_interval_s": 0.1, "local_prefill_max_tokens": 0, **settings})
        gateway = Gateway(config, load_served_model(config))
        port = await gateway.start()
        try:
            yield p, gateway, f"127.0.0.1:{port}"
        finally:
            await gateway.stop(grace_s=1)
