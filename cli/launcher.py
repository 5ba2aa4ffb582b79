"""A local cluster on loopback: Redis, prefill and decode workers and a gateway, as processes.

``tandem serve --local`` and the end-to-end tests use :class:`LocalCluster`. Redis comes from
``TANDEM_REDIS_URL`` when set, else a private ``redis-server`` (from PATH, free port, temp
dir, no persistence); without either, the workers run unregistered and the gateway is given
their addresses (``gateway.static_cluster``: loads from GetStats, an in-process prefix index
built from the gateway's own routing), and the log says so.

Every child runs in its own process group (a terminal's Ctrl-C reaches only the launcher,
which then stops them in order: gateway first so it drains, then workers, then Redis) and
gets SIGTERM if the launcher dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# This process starts workers (fork + exec, a death signal set between the two) while its gRPC
# health-check channels exist; gRPC's fork handlers would now and then abort a child before it
# execs. The children need none of them. Effective when set before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from cli.healthcheck import check  # noqa: E402
from cli.redis_server import RedisServer  # noqa: E402
from cluster.tls import issue_instance_cert  # noqa: E402
from engine.config import NVLINK_MULTICAST_OFF  # noqa: E402
from engine.model_source import resolve_model  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or died."""


_LISTEN_PORTS = (10000, 32768)  # where free_port looks, unless the ephemeral range overlaps it
# Ports free_port has returned: one picked but not bound yet looks free to the next call (a full
# run gave a prefill and a decode worker of one cluster the same port; the decode worker could
# not listen, and its health check, answered by the prefill worker, said SERVING).
_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and bind(0) (Linux's default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback TCP port free now, outside the kernel's ephemeral range: a port from bind(0)
    is an ephemeral one, which any outgoing connection of any process (a gRPC channel, a Redis
    client) may take before the process it was picked for binds it (seen: a worker's metrics
    port taken, the cluster failing to start). Never one this process was given before."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(*_LISTEN_PORTS) if not low <= p <= high and p not in _HANDED_OUT] \
        or [p for p in range(1024, low) if p not in _HANDED_OUT]
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise ClusterError("no free port for the cluster's servers")


def _child_setup() -> None:  # runs in the child between fork and exec
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    """One process of the cluster; its output goes line by line to ``sink`` (tagged with the name)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    address: str | None = None  # gRPC address to health-check
    proc: subprocess.Popen | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=40))

    def start(self, sink: Callable[[str, str], None], log_dir: Path | None) -> None:
        log = open(log_dir / f"{self.name}.log", "ab") if log_dir else None
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
        threading.Thread(target=self._pump, args=(sink, log), daemon=True, name=f"log-{self.name}").start()

    def _pump(self, sink: Callable[[str, str], None], log) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            if log:
                log.write(raw)
                log.flush()
            sink(self.name, line)
        if log:
            log.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> None:
        """Wait for exit; SIGKILL after ``timeout_s``."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit within %.0f s: killing it", self.name, timeout_s)
            self.proc.kill()
            self.proc.wait()


def gpu_placement(workers: list[tuple[str, int]], gpus: int) -> dict[str, int]:
    """The first GPU of each worker, given as ``(name, tensor_parallel_size)`` in start order:
    each worker takes that many consecutive GPUs (its ranks), the next worker the GPUs after
    them, round robin over the host's ``gpus``; a worker whose ranks would run past the last
    GPU starts again at GPU 0. More workers than GPUs share them.

    Raises:
        ValueError: a worker needs more GPUs than the host has.
    """
    placement, cursor = {}, 0
    for name, tp in workers:
        if tp > gpus:
            raise ValueError(f"{name} has tensor_parallel_size={tp}, more than the {gpus} GPUs")
        if cursor + tp > gpus:
            cursor = 0
        placement[name] = cursor
        cursor = (cursor + tp) % gpus
    return placement


def cpu_threads_per_worker(num_workers: int) -> int:
    """This process's usable cores divided among ``num_workers`` worker processes (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, num_workers))


class LocalCluster:
    """Redis + ``num_prefill`` prefill + ``num_decode`` decode workers + a gateway, on loopback.

    Args:
        model: model for all processes (``None``: the default).
        gateway_addr: the gateway's listen address (``None``: 127.0.0.1 on a free port).
        http_addr: the address of its OpenAI-compatible HTTP API (``None``: 127.0.0.1 on a free
            port; ``""``: off).
        num_prefill, num_decode: pool sizes.
        env: extra ``TANDEM_*`` settings for every process (e.g. ``TANDEM_NUM_BLOCKS``).
        worker_env: extra settings per worker name (``prefill-0``, ``decode-1``...).
        redis: ``"auto"`` (TANDEM_REDIS_URL, else redis-server, else none), a URL, or ``None`` (none).
        sink: receives ``(process name, log line)``; default: print ``[name] line`` to stderr.
        log_dir: also write each process' output to ``log_dir/<name>.log``.
        metrics: serve every process's Prometheus metrics, each on a free port of its own
            (``metrics_ports`` says which).
        gpus: GPUs of this host to place the workers on (:func:`gpu_placement`; each worker's
            ``TANDEM_DEVICE`` is its first GPU); 0: the workers' own ``device`` setting.
        prefill_tp, decode_tp: the tensor-parallel size of every prefill / decode worker (its
            ranks are started by the worker itself).
        decode_serves_prefill: every decode worker also serves prefill for the others
            (``TANDEM_SERVES_PREFILL``: the gateway's adaptive placement may lend it a prompt);
            ``worker_env`` may still set it per worker.
        tls_dir: a TLS directory of ``cluster.tls.init_certs`` (its CA key included): the
            gateway serves its certificates, each worker one of its own instance issued there
            (:meth:`_instance_tls`); gateway and workers authenticate each other with mTLS;
            ``None``: plaintext (the processes get ``TANDEM_INSECURE=1``).

    Without GPUs the workers share this host's cores: each pool (prefill, decode) gets all of
    them, divided among its workers (``OMP_NUM_THREADS``, :func:`cpu_threads_per_worker`), unless
    ``OMP_NUM_THREADS`` is already set. A prefill and its decode mostly run one after the other;
    on 2 cores (AMD EPYC, SmolLM2-135M Q4_1, probe) two threads for each worker gave one stream
    through the gateway 123 tok/s and 16 streams 322, against 88 and 241 with one thread each
    (the offline engine: 125-133 and, batched, ~330).
    """

    def __init__(self, model: str | None = None, gateway_addr: str | None = None, http_addr: str | None = None,
                 num_prefill: int = 1, num_decode: int = 1, env: dict[str, str] | None = None,
                 worker_env: dict[str, dict[str, str]] | None = None, redis: str | None = "auto",
                 sink: Callable[[str, str], None] | None = None, log_dir: Path | None = None,
                 metrics: bool = True, tls_dir: str | None = None, gpus: int = 0, prefill_tp: int = 1,
                 decode_tp: int = 1, decode_serves_prefill: bool = False) -> None:
        self.model = model
        self.tls_dir = tls_dir
        self.gateway_addr = gateway_addr or f"127.0.0.1:{free_port()}"
        self.http_addr = f"127.0.0.1:{free_port()}" if http_addr is None else http_addr
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.env = dict(env or {})
        names = [(f"prefill-{i}", prefill_tp) for i in range(num_prefill)] + [(f"decode-{i}", decode_tp)
                                                                             for i in range(num_decode)]
        placement = gpu_placement(names, gpus) if gpus else {}
        pool_size = {"prefill": num_prefill, "decode": num_decode}
        threads = {} if gpus or "OMP_NUM_THREADS" in {**os.environ, **self.env} else {
            name: {"OMP_NUM_THREADS": str(cpu_threads_per_worker(pool_size[name.split("-")[0]]))} for name, _ in names}
        lends = {"TANDEM_SERVES_PREFILL": "1"} if decode_serves_prefill else {}
        self.worker_env = {name: {"TANDEM_TENSOR_PARALLEL_SIZE": str(tp), **threads.get(name, {}),
                                  **({"TANDEM_DEVICE": f"cuda:{placement[name]}"} if gpus else {}),
                                  **(lends if name.startswith("decode") else {}),
                                  **(worker_env or {}).get(name, {})} for name, tp in names}
        self.redis_mode = redis
        self.sink = sink or (lambda name, line: print(f"[{name}] {line}", file=sys.stderr, flush=True))
        self.log_dir = log_dir
        self.metrics = metrics
        self.metrics_ports: dict[str, int] = {}
        self.redis_url: str | None = None
        self.redis: RedisServer | None = None
        self.workers: dict[str, Child] = {}
        self.gateway: Child | None = None
        self.phases: dict[str, float] = {}

    # -- start -----------------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0, on_wait: Callable[[str], None] | None = None) -> None:
        """Find the model, start everything and wait until every process reports SERVING; the
        seconds each phase took go in :attr:`phases` (``model_files_s``, ``processes_ready_s``).

        Raises:
            ClusterError: the model cannot be found, a process exited, or ``timeout_s`` passed;
                everything is stopped.
        """
        try:
            started = time.perf_counter()
            self._prepare_model()
            self.phases["model_files_s"] = time.perf_counter() - started
            self._start_redis()
            base = {**os.environ, "PYTHONUNBUFFERED": "1", **NVLINK_MULTICAST_OFF, **self.env}
            if self.model:
                base["TANDEM_MODEL"] = self.model
            base["TANDEM_REDIS_URL"] = self.redis_url or ""
            if self.redis is not None:
                base["TANDEM_REDIS_PASSWORD"] = self.redis.password
            base["TANDEM_TLS_DIR"] = self.tls_dir or ""
            base["TANDEM_INSECURE"] = "0" if self.tls_dir else "1"  # plaintext, chosen by passing no tls_dir
            for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
                for i in range(count):
                    name, address = f"{role}-{i}", f"127.0.0.1:{free_port()}"
                    worker_id = f"{role}-{i}-{os.getpid()}"
                    env = {**base, "TANDEM_WORKER_ID": worker_id, **self._instance_tls(role, worker_id),
                           **self.worker_env.get(name, {})}
                    self.workers[name] = Child(name, [sys.executable, "-m", f"{role}_worker", "--listen", address,
                                                      *self._metrics_flag(name)], env, address)
            argv = [sys.executable, "-m", "gateway", "--listen", self.gateway_addr, "--http-addr", self.http_addr,
                    *self._metrics_flag("gateway")]
            if not self.redis_url:
                argv += ["--static-prefill", ",".join(w.address for n, w in self.workers.items() if n[0] == "p"),
                         "--static-decode", ",".join(w.address for n, w in self.workers.items() if n[0] == "d")]
            self.gateway = Child("gateway", argv, base, self.gateway_addr)
            for child in [*self.workers.values(), self.gateway]:
                child.start(self.sink, self.log_dir)
            self._wait_healthy(timeout_s, on_wait)
            self.phases["processes_ready_s"] = time.perf_counter() - started - self.phases["model_files_s"]
        except BaseException:
            self.stop()
            raise

    def _prepare_model(self) -> None:
        """Resolve the processes' model once, here: on a machine's first run a GGUF's config and
        tokenizer are converted now (:mod:`engine.loading.gguf`), and the processes find them ready
        instead of queueing on the conversion's lock."""
        model = self.model or {**os.environ, **self.env}.get("TANDEM_MODEL") or None
        try:
            resolve_model(model)
        except ValueError as exc:
            raise ClusterError(str(exc)) from None

    def _instance_tls(self, role: str, worker_id: str) -> dict[str, str]:
        """The worker's own TLS directory (``TANDEM_TLS_DIR``): a certificate naming ``worker_id``
        issued from ``tls_dir``'s CA into ``tls_dir/instances/{worker_id}`` (``cluster.identity``);
        none without TLS."""
        if not self.tls_dir:
            return {}
        out = Path(self.tls_dir) / "instances" / worker_id
        try:
            issue_instance_cert(self.tls_dir, role, worker_id, str(out))
        except ValueError as exc:
            raise ClusterError(f"cannot issue {worker_id}'s certificate: {exc}") from None
        return {"TANDEM_TLS_DIR": str(out)}

    def _metrics_flag(self, name: str) -> list[str]:
        """``--metrics-port`` on a free port of its own for process ``name`` (two local clusters
        never collide), or ``0`` (off) when the cluster serves no metrics."""
        port = free_port() if self.metrics else 0
        self.metrics_ports[name] = port
        return ["--metrics-port", str(port)]

    def _start_redis(self) -> None:
        if self.redis_mode not in ("auto", None):
            self.redis_url = self.redis_mode
            return
        if self.redis_mode is None:
            return
        if os.environ.get("TANDEM_REDIS_URL"):
            self.redis_url = os.environ["TANDEM_REDIS_URL"]
            logger.info("using Redis at %s (TANDEM_REDIS_URL)", self.redis_url)
            return
        if shutil.which("redis-server") is None:
            logger.warning("no TANDEM_REDIS_URL and no redis-server on PATH: workers run unregistered and the "
                           "gateway routes over their fixed addresses with an in-process prefix index")
            return
        self.redis = RedisServer(password=secrets.token_urlsafe(24))  # every process gets it, nobody else
        try:
            self.redis.start()
        except RuntimeError as exc:
            raise ClusterError(str(exc)) from None
        self.redis_url = self.redis.url
        logger.info("started redis-server at %s", self.redis_url)

    def _wait_healthy(self, timeout_s: float, on_wait: Callable[[str], None] | None) -> None:
        """Wait until every process reports SERVING, then until the gateway has re-read the worker
        registry since the last worker did (two of its refresh intervals): it reports SERVING as
        soon as one decode worker can take a request, and a request sent before it knows the
        prefill workers is prefilled on its decode worker (a full run's first request was)."""
        deadline = time.monotonic() + timeout_s
        pending = {c.name: c for c in [*self.workers.values(), self.gateway]}
        workers_ready = None
        while pending:
            for name, child in list(pending.items()):
                if not child.alive:
                    raise ClusterError(f"{name} exited with {child.proc.returncode}; last lines:\n"
                                       + "\n".join(list(child.tail)[-15:]))
                if check(child.address, timeout_s=1.0, tls_dir=self.tls_dir or ""):
                    del pending[name]
            if on_wait is not None:
                on_wait(f"waiting for {', '.join(pending) or 'nothing'} to report SERVING")
            if workers_ready is None and not set(pending) & set(self.workers):
                workers_ready = time.monotonic()
            if pending and time.monotonic() > deadline:
                raise ClusterError(f"not SERVING after {timeout_s:.0f} s: {sorted(pending)}")
            if pending:
                time.sleep(0.5)
        refresh_s = float({**os.environ, **self.env}.get(
            "TANDEM_REFRESH_INTERVAL_S", GatewaySettings.model_fields["refresh_interval_s"].default))
        time.sleep(max(0.0, workers_ready + 2 * refresh_s - time.monotonic()))

    # -- run and stop ----------------------------------------------------------------------

    def dead(self) -> list[str]:
        """Names of cluster processes that have exited."""
        return [c.name for c in self.children() if c.proc is not None and not c.alive]

    def restart(self, name: str, timeout_s: float = 300.0) -> None:
        """Start worker ``name`` again (same address, settings and worker id) once it has
        exited, and wait until it reports SERVING. Call it from a thread that outlives the
        worker (the main one): the child's PR_SET_PDEATHSIG fires when the thread that
        started it exits.

        Raises:
            ClusterError: it is still running, exited again, or was not SERVING within ``timeout_s``.
        """
        child = self.workers[name]
        if child.alive:
            raise ClusterError(f"{name} is still running")
        child.start(self.sink, self.log_dir)
        deadline = time.monotonic() + timeout_s
        while not check(child.address, timeout_s=1.0, tls_dir=self.tls_dir or ""):
            if not child.alive:
                raise ClusterError(f"{name} exited with {child.proc.returncode}; last lines:\n"
                                   + "\n".join(list(child.tail)[-15:]))
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.2)

    def children(self) -> list[Child]:
        return [c for c in [self.gateway, *self.workers.values()] if c is not None]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the gateway (it drains), then the workers, then Redis; SIGKILL stragglers."""
        if self.gateway is not None:
            self.gateway.signal(signal.SIGTERM)
            self.gateway.wait(timeout_s)
        for worker in self.workers.values():
            worker.signal(signal.SIGTERM)
        for worker in self.workers.values():
            worker.wait(timeout_s)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
