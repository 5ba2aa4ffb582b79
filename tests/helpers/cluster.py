"""The end-to-end tests' cluster: a real LocalCluster (worker + gateway processes on loopback,
with TLS and mTLS from a CA made for the test) and small gRPC utilities (worker stats, streaming
calls)."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from cli.launcher import LocalCluster
from cluster.tls import TlsFiles, init_certs, role_name
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.helpers.shared_redis import delete_keys

SP = gateway_pb2.SamplingParams
# Workers whose resumed streams equal an undisturbed run token for token: re-prefilling a token
# computes what decoding it did only with float32 weights. The quantized path's bfloat16 matmul
# inputs round the two paths' last-bit differences apart, and after a near-tie a resumed stream
# may part from the undisturbed one (docs/engine.md, "GGUF weights kept quantized").
EXACT_RESUME = {"TANDEM_QUANTIZATION": "none"}


def start_cluster(tmp: Path, key_prefix: str, redis_url: str | None, num_prefill: int, num_decode: int,
                  kv_transport: str, env: dict[str, str] | None = None, worker_env: dict | None = None,
                  **placement) -> LocalCluster:
    """Start workers and a gateway (logs in ``tmp``); return once every process reports SERVING
    (the gateway does only when a request can be routed). Every prompt goes through a prefill
    worker (``TANDEM_LOCAL_PREFILL_MAX_TOKENS=0``) unless ``env`` says otherwise; KV blocks move
    by ``kv_transport`` (blocks read over NIXL are checksummed too: ``TANDEM_KV_VERIFY_CHECKSUMS``).
    ``placement`` (``gpus``, ``prefill_tp``, ``decode_tp``) goes to :class:`LocalCluster`."""
    base = {"TANDEM_REDIS_KEY_PREFIX": key_prefix, "TANDEM_LOG_LEVEL": "INFO",
            "TANDEM_REGISTRY_TTL_S": "3", "TANDEM_HEARTBEAT_INTERVAL_S": "0.5",
            "TANDEM_KV_CACHE_MEMORY_BYTES": str(64 << 20), "TANDEM_DRAIN_TIMEOUT_S": "5",
            "TANDEM_MAX_MODEL_LEN": "2048", "TANDEM_LOCAL_PREFILL_MAX_TOKENS": "0",
            "TANDEM_KV_TRANSPORT": kv_transport, "TANDEM_KV_VERIFY_CHECKSUMS": "true", **(env or {})}
    init_certs(str(tmp / "certs"))
    cluster = LocalCluster(num_prefill=num_prefill, num_decode=num_decode, env=base, worker_env=worker_env,
                           redis=redis_url, sink=lambda name, line: None, log_dir=tmp, tls_dir=str(tmp / "certs"),
                           **placement)
    cluster.start(timeout_s=300)
    return cluster


@contextlib.contextmanager
def shared_redis_cluster(tmp: Path, name: str, redis_url: str, **kwargs) -> Iterator[LocalCluster]:
    """:func:`start_cluster` on the shared Redis at ``redis_url`` under a key prefix of its own
    (``test-<name>-<random>``), with ``cluster.stub`` a gateway stub and ``cluster.tmp`` its
    log folder; on exit the stub's channel is closed, the cluster stopped and every key under
    its prefix deleted. ``kwargs`` go to :func:`start_cluster`."""
    prefix = f"test-{name}-{uuid.uuid4().hex[:12]}"
    cluster = start_cluster(tmp, prefix, redis_url, **kwargs)
    channel, cluster.stub = gateway_stub(cluster)
    cluster.tmp = tmp
    try:
        yield cluster
    finally:
        channel.close()
        cluster.stop()
        delete_keys(redis_url, prefix)


def gateway_stub(cluster: LocalCluster) -> tuple[grpc.Channel, gateway_pb2_grpc.GatewayStub]:
    ca = (Path(cluster.tls_dir) / "ca.pem").read_bytes()
    channel = grpc.secure_channel(cluster.gateway_addr, grpc.ssl_channel_credentials(root_certificates=ca))
    return channel, gateway_pb2_grpc.GatewayStub(channel)


def stats(cluster: LocalCluster, address: str, role: str) -> worker_pb2.WorkerStats:
    """A worker's ``GetStats``, called with the gateway's certificate."""
    credentials = TlsFiles.load(cluster.tls_dir, "gateway", "tls_dir").channel_credentials()
    with grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", role_name(role))]) \
            as channel:
        stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
        return stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)


def counter(cluster: LocalCluster, process: str, name: str, **labels: str) -> float:
    """Process ``process``'s Prometheus counter ``name`` (its ``_total``), summed over the samples
    with ``labels``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_ports[process]}/metrics", timeout=5) as page:
        families = text_string_to_metric_families(page.read().decode())
        return sum(s.value for f in families if f.name == name for s in f.samples
                   if s.name.endswith("_total") and labels.items() <= s.labels.items())


def free_blocks(cluster: LocalCluster) -> dict[str, int]:
    """Free KV blocks of every live worker, by name."""
    return {name: stats(cluster, w.address, name.split("-")[0]).num_free_blocks
            for name, w in cluster.workers.items() if w.alive}


def wait_free_blocks(cluster: LocalCluster, expected: dict[str, int], within_s: float) -> dict[str, int]:
    """Poll until every worker in ``expected`` is back to its free-block count; returns the last reading."""
    deadline = time.monotonic() + within_s
    while True:
        now = free_blocks(cluster)
        if all(now.get(k) == v for k, v in expected.items()) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def settled_free_blocks(cluster: LocalCluster, within_s: float) -> dict[str, int]:
    """Every live worker's free-block count once no request holds a block (free == total), waited
    for: the reference a leak check compares with, taken after an earlier request's last frees
    (an Abort after a cut or a cancel lands asynchronously) rather than during them.

    Raises:
        AssertionError: a worker still holds blocks after ``within_s`` seconds.
    """
    total = {name: stats(cluster, w.address, name.split("-")[0]).num_total_blocks
             for name, w in cluster.workers.items() if w.alive}
    assert wait_free_blocks(cluster, total, within_s) == total, "a worker still holds blocks"
    return total


def collect(stub, request, timeout_s: float = 120) -> dict:
    """Run one Generate call; per sample: token ids, text, finish reason; plus usage (checked to
    come exactly once, on the stream's last message)."""
    samples: dict[int, dict] = {}
    messages = list(stub.Generate(request, timeout=timeout_s))
    for message in messages:
        s = samples.setdefault(message.index, {"token_ids": [], "text": "", "finish": 0})
        s["token_ids"] += message.token_ids
        s["text"] += message.text
        if message.finish_reason:
            s["finish"] = message.finish_reason
    with_usage = [i for i, m in enumerate(messages) if m.HasField("usage")]
    assert with_usage == [len(messages) - 1], f"usage on messages {with_usage} of {len(messages)}"
    return {"samples": samples, "usage": messages[-1].usage}


@dataclass
class KilledStream:
    """What a client saw of a stream whose decode worker was SIGKILLed mid-stream
    (:func:`stream_killing_its_decode_worker`)."""

    token_ids: list[int]
    text: str
    finish: int
    usage: object
    code: str  # the call's status name ("OK" when it ended well)
    victim: str | None  # the killed worker's name
    tokens_at_kill: int


def stream_killing_its_decode_worker(cluster, request, after_tokens: int, timeout_s: float = 120) -> KilledStream:
    """Stream ``request`` and SIGKILL the decode worker running it once the client holds
    ``after_tokens`` tokens; read the stream to its end (or its error)."""
    seen = KilledStream([], "", 0, None, "OK", None, 0)
    try:
        for message in cluster.stub.Generate(request, timeout=timeout_s):
            seen.token_ids += message.token_ids
            seen.text += message.text
            seen.finish = message.finish_reason or seen.finish
            seen.usage = message.usage if message.HasField("usage") else seen.usage
            if seen.victim is None and len(seen.token_ids) >= after_tokens:
                (seen.victim,) = [name for name, w in cluster.workers.items() if name.startswith("decode")
                                  and stats(cluster, w.address, "decode").num_running]
                cluster.workers[seen.victim].proc.send_signal(signal.SIGKILL)
                seen.tokens_at_kill = len(seen.token_ids)
    except grpc.RpcError as exc:
        seen.code = exc.code().name
    return seen


def log_text(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class Outcome:
    """One request of a :class:`ClosedLoop`: its status name, the tokens the client got, when
    (``time.monotonic()`` seconds) it started, got its first token (``None``: never) and ended, and
    the longest time (seconds) the client waited with nothing from the server (start → first
    message, between messages, last message → end): how long the request was stuck, which a
    retried request's service time elsewhere does not inflate the way ``ended - started`` does."""

    code: str
    tokens: int
    started: float
    first_token_at: float | None
    ended: float
    longest_silence_s: float


class ClosedLoop:
    """``streams`` client threads, each sending its next Generate as soon as the last one ended
    (closed loop), until :meth:`stop`.

    Args:
        stub: a ``GatewayStub``.
        make_request: request number → the request.
        streams: concurrent streams.
        timeout_s: each call's deadline.
    """

    def __init__(self, stub, make_request: Callable[[int], gateway_pb2.GenerateRequest], streams: int,
                 timeout_s: float = 60.0) -> None:
        self.stub, self.make_request, self.timeout_s = stub, make_request, timeout_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._count = itertools.count()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]

    def start(self) -> ClosedLoop:
        for thread in self._threads:
            thread.start()
        return self

    def completed(self) -> int:
        with self._lock:
            return sum(o.code == "OK" for o in self.outcomes)

    def stop(self) -> list[Outcome]:
        """Stop sending, wait for the calls in flight, return every outcome."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 10)
        return list(self.outcomes)

    def _run(self) -> None:
        while not self._stop.is_set():
            request = self.make_request(next(self._count))
            started, first, tokens, code = time.monotonic(), None, 0, "OK"
            last, longest = started, 0.0
            try:
                for message in self.stub.Generate(request, timeout=self.timeout_s):
                    now = time.monotonic()
                    longest, last = max(longest, now - last), now
                    if message.token_ids and first is None:
                        first = now
                    tokens += len(message.token_ids)
            except grpc.RpcError as exc:
                code = exc.code().name
            ended = time.monotonic()
            with self._lock:
                self.outcomes.append(Outcome(code, tokens, started, first, ended, max(longest, ended - last)))


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (from any of its threads), e.g. a worker's tensor-parallel ranks."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(child) for child in f.read().split()]
    return sorted(children)
