"""Soak: mixed traffic for ``--minutes`` with a fault every ``--fault-every-s`` seconds, then
the invariants: every request accounted for, none hung, no block, fd or thread leaked.

It starts a private ``redis-server`` (it is restarted during the run, so never a shared one)
and a local cluster (2 prefill + 2 decode workers and a gateway on loopback). ``--streams``
closed-loop clients send a mix: short prompts (greedy, 8-24 tokens), long prompts (~1000
tokens), ``n=2`` sampled requests, and 10% cancelled by the client after their first token.
Faults, in turn: SIGKILL of a prefill worker, SIGSTOP of a decode worker for 8 s, SIGKILL of a
decode worker, SIGTERM (drain) of a prefill worker, a Redis restart (empty); a killed or
drained worker is started again 5 s later.

Metrics: ``minutes``, ``sent``, ``completed``, ``cancelled`` (by the client, on purpose),
``failed_with_status`` (with ``failed_<CODE>`` per status), ``hung`` (calls still open 30 s
after their deadline), ``workers_not_exiting`` (a killed or drained worker still running 30 s
after its restart was due), ``unclean_drains`` (a worker that exited non-zero after SIGTERM:
its shutdown watchdog ended it, ``cluster.shutdown``), ``leaked_blocks`` (blocks not free on
any worker once idle), ``stale_registry_entries`` (registry entries beyond the live workers
after the TTL), ``leaked_fds`` / ``leaked_threads`` / ``rss_growth_fraction`` of the gateway (the one process
never restarted) between the first idle point after warm-up and the end (fds are counted once
settled: a channel retired when its worker re-registered holds its socket for
``cluster.channels.RETIRE_GRACE_S``, so the end waits up to that long for the count to come
back; the fds opened or closed between the two are printed, their peers named; connections to
Redis are not counted in ``leaked_fds``: they are its client's pool, which keeps up to
``REDIS_MAX_CONNECTIONS`` open, ``redis_connections_before`` / ``_after``; nor are the ones the
Redis restart reset, which that pool holds until it takes them again and finds them dead: a
socket in no table of ``/proc/<pid>/net/`` whose inode was a connection to Redis just before
the restart), ``faults``. The
invariant ``sent == completed + cancelled + failed_with_status + hung`` is checked.

Usage: ``python -m bench.soak --minutes 60`` (``--help`` lists the knobs).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# This process forks workers while its client threads are in gRPC calls; gRPC's fork handlers
# then abort the child now and then (SIGABRT before exec). The children exec at once and need
# none of them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402
import redis  # noqa: E402

from bench.common import machine, write_result  # noqa: E402
from cli.launcher import ClusterError, LocalCluster  # noqa: E402
from cli.redis_server import RedisServer  # noqa: E402
from cluster.channels import RETIRE_GRACE_S  # noqa: E402
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

DEADLINE_S = 60.0
SETTINGS = {"TANDEM_KEEPALIVE_TIME_S": "2", "TANDEM_KEEPALIVE_TIMEOUT_S": "2",
            "TANDEM_HEALTH_PROBE_INTERVAL_S": "0.5", "TANDEM_HEALTH_PROBE_TIMEOUT_S": "1",
            "TANDEM_LOCAL_PREFILL_MAX_TOKENS": "0", "TANDEM_KV_TRANSPORT": "grpc",
            "TANDEM_KV_CACHE_MEMORY_BYTES": str(64 << 20), "TANDEM_MAX_MODEL_LEN": "2048",
            "TANDEM_DRAIN_TIMEOUT_S": "5", "TANDEM_REGISTRY_TTL_S": "3", "TANDEM_HEARTBEAT_INTERVAL_S": "0.5"}
LONG_PROMPT = " ".join(f"Fact {i} about the sea is that it is wide." for i in range(75))  # ~1000 tokens


class Traffic:
    """``streams`` client threads sending the mixed workload until :meth:`stop`; counts outcomes."""

    def __init__(self, stub, streams: int, seed: int) -> None:
        self.stub = stub
        self.counts: collections.Counter[str] = collections.Counter()
        self.open_calls = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(random.Random(seed + i),), daemon=True)
                         for i in range(streams)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> int:
        """Stop sending; return the calls still open 30 s after the last deadline (hung)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(DEADLINE_S + 30)
        return sum(thread.is_alive() for thread in self._threads)

    def _request(self, rng: random.Random, i: int) -> gateway_pb2.GenerateRequest:
        kind = rng.random()
        if kind < 0.15:
            return gateway_pb2.GenerateRequest(prompt=f"{LONG_PROMPT} Question {i}: why?",
                                               sampling=gateway_pb2.SamplingParams(max_tokens=8, temperature=0))
        if kind < 0.3:
            return gateway_pb2.GenerateRequest(prompt=f"Name two colours ({i}).", sampling=gateway_pb2.SamplingParams(
                max_tokens=12, n=2, temperature=0.8, seed=i))
        return gateway_pb2.GenerateRequest(prompt=f"Tell me about the number {i}.", sampling=gateway_pb2.SamplingParams(
            max_tokens=rng.randint(8, 24), temperature=0, ignore_eos=True))

    def _run(self, rng: random.Random) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            cancel = rng.random() < 0.1
            with self._lock:
                self.counts["sent"] += 1
            outcome = "completed"
            call = self.stub.Generate(self._request(rng, i), timeout=DEADLINE_S)
            try:
                for message in call:
                    if cancel and message.token_ids:
                        call.cancel()
            except grpc.RpcError as exc:
                outcome = "cancelled" if cancel and exc.code() == grpc.StatusCode.CANCELLED \
                    else f"failed_{exc.code().name}"
            with self._lock:
                self.counts[outcome] += 1


def _stats(address: str, role: str) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(address) as channel:
        stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
        return stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)


def _leaked_blocks(cluster: LocalCluster, within_s: float = 10.0) -> int:
    """Blocks not free, summed over the workers, once they are back to idle (polls ``within_s``)."""
    deadline = time.monotonic() + within_s
    while True:
        leaked = 0
        for name, worker in cluster.workers.items():
            s = _stats(worker.address, name.split("-")[0])
            leaked += s.num_total_blocks - s.num_free_blocks
        if leaked == 0 or time.monotonic() > deadline:
            return leaked
        time.sleep(0.2)


def _process(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {"threads": int(fields["Threads"]), "rss_mb": int(fields["VmRSS"].split()[0]) / 1024}


def _fd_table(pid: int, known: dict[str, str] | None = None) -> dict[int, str]:
    """What each open fd of ``pid`` is: a TCP or UDP socket as ``tcp <local port> -> <peer
    port>`` (from ``/proc/<pid>/net/``), a Unix socket as ``unix <path>``, a netlink socket as
    ``netlink <protocol>``, anything else as its ``/proc/<pid>/fd`` link (a socket in none of
    these tables stays ``socket:[inode]``: e.g. a TCP socket not yet connected, or reset by its
    peer and not yet closed), unless ``known`` (link -> description, from an earlier
    :func:`_sockets`) named it: then ``reset <its description then>``."""
    sockets = {link: f"reset {description}" for link, description in (known or {}).items()}
    sockets.update(_sockets(pid))
    table = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            table[int(fd)] = sockets.get(link, link)
    return table


def _sockets(pid: int) -> dict[str, str]:
    """The sockets of ``pid``'s network namespace in ``/proc/<pid>/net/``: fd link
    (``socket:[inode]``) -> description (see :func:`_fd_table`)."""
    sockets = {}
    for name in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/{pid}/net/{name}") as f:
            for row in f.read().splitlines()[1:]:
                local, peer, inode = (row.split()[i] for i in (1, 2, 9))
                ports = [int(address.rsplit(":", 1)[1], 16) for address in (local, peer)]
                sockets[f"socket:[{inode}]"] = f"{name[:3]} {ports[0]} -> {ports[1]}"
    with open(f"/proc/{pid}/net/unix") as f:
        for row in f.read().splitlines()[1:]:
            fields = row.split()
            sockets[f"socket:[{fields[6]}]"] = f"unix {fields[7] if len(fields) > 7 else '(unnamed)'}"
    with open(f"/proc/{pid}/net/netlink") as f:
        for row in f.read().splitlines()[1:]:
            fields = row.split()
            sockets[f"socket:[{fields[9]}]"] = f"netlink {fields[1]}"
    return sockets


def _is_connection_to(description: str, port: int) -> bool:
    """Whether an :func:`_fd_table` description is a TCP connection to ``port`` (or was, and
    its peer reset it)."""
    description = description.removeprefix("reset ")
    return description.startswith("tcp ") and description.endswith(f" -> {port}")


def _connections_to(table: dict[int, str], port: int) -> int:
    """TCP connections to ``port`` in an :func:`_fd_table`, reset ones included."""
    return sum(_is_connection_to(d, port) for d in table.values())


def _settled_fd_table(pid: int, redis_port: int, baseline: int, within_s: float,
                      known: dict[str, str]) -> dict[int, str]:
    """The :func:`_fd_table` with the fewest fds besides Redis connections, sampled every second
    until that count is back to ``baseline`` or ``within_s`` seconds have passed: a socket gRPC
    is connecting or closing at one instant (not yet or no longer in ``/proc/net/tcp``), or one
    held by a channel retired within the last ``RETIRE_GRACE_S`` seconds (``cluster.channels``:
    a worker that re-registered gets a fresh channel, the old one is closed after that grace),
    is not a leak; a leaked fd is in every sample. ``known``: as for :func:`_fd_table`."""
    deadline, best = time.monotonic() + within_s, None
    while True:
        table = _fd_table(pid, known)
        count = len(table) - _connections_to(table, redis_port)
        if best is None or count < best[0]:
            best = (count, table)
        if best[0] <= baseline or time.monotonic() >= deadline:
            return best[1]
        time.sleep(1.0)


def _print_fd_change(before: dict[int, str], after: dict[int, str], ports: dict[int, str]) -> None:
    """Print to stderr the fds open only before or only after (peers named by ``ports``)."""
    def named(description: str) -> str:
        peer = description.rsplit(" ", 1)[-1]
        return f"{description} ({ports[int(peer)]})" if description.startswith("tcp") and int(peer) in ports \
            else description

    for label, mine, other in (("closed", before, after), ("opened", after, before)):
        for fd in sorted(fd for fd in mine if other.get(fd) != mine[fd]):
            print(f"gateway fd {fd} {label}: {named(mine[fd])}", file=sys.stderr, flush=True)


class Faults:
    """Injects the next fault of the cycle; :meth:`restart_due` starts again, ``restart_after_s``
    later, what it stopped. Call both from the main thread: a worker is started with
    PR_SET_PDEATHSIG, which fires when the *thread* that started it exits."""

    def __init__(self, cluster: LocalCluster, redis_server: RedisServer, restart_after_s: float = 5.0) -> None:
        self.cluster, self.redis = cluster, redis_server
        self.restart_after_s = restart_after_s
        self.done: collections.Counter[str] = collections.Counter()
        self._cycle = [self._kill("prefill-0"), self._freeze("decode-0"), self._kill("decode-1"),
                       self._drain("prefill-1"), self._redis_restart]
        self._next = 0
        self._restarts: list[tuple[float, str]] = []
        self.not_exiting, self.unclean_drains = 0, 0
        self._draining: set[str] = set()
        # the gateway's connections to Redis when it was restarted: the restart resets those its
        # pool holds, which stay open there until redis-py takes them again and finds them dead
        self.redis_sockets: dict[str, str] = {}

    def inject(self) -> None:
        fault = self._cycle[self._next % len(self._cycle)]
        self._next += 1
        fault()

    def restart_due(self, everything: bool = False) -> None:
        """Start again the stopped workers whose time has come (``everything``: all of them)."""
        now = time.monotonic()
        due = [name for at, name in self._restarts if everything or at <= now]
        self._restarts = [(at, name) for at, name in self._restarts if name not in due]
        for name in due:
            proc = self.cluster.workers[name].proc
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:  # a worker that did not exit: counted, then killed
                self.not_exiting += 1
                print(f"{name} did not exit within 30 s of its fault", file=sys.stderr, flush=True)
                proc.kill()
                proc.wait()
            if name in self._draining and proc.returncode != 0:
                self.unclean_drains += 1
                print(f"{name} exited {proc.returncode} after SIGTERM", file=sys.stderr, flush=True)
            self._draining.discard(name)
            try:
                self.cluster.restart(name)
            except ClusterError as exc:  # counted, and tried again at the next call
                self.done["restart_failed"] += 1
                print(f"restart of {name} failed: {exc}", file=sys.stderr, flush=True)
                self._restarts.append((now + 1.0, name))

    def _restart_later(self, name: str) -> None:
        self._restarts.append((time.monotonic() + self.restart_after_s, name))

    def _kill(self, name: str):
        def fault() -> None:
            self.cluster.workers[name].proc.send_signal(signal.SIGKILL)
            self.done[f"sigkill_{name.split('-')[0]}"] += 1
            self._restart_later(name)
        return fault

    def _drain(self, name: str):
        def fault() -> None:
            self.cluster.workers[name].proc.send_signal(signal.SIGTERM)
            self._draining.add(name)
            self.done[f"sigterm_{name.split('-')[0]}"] += 1
            self._restart_later(name)
        return fault

    def _freeze(self, name: str):
        def fault() -> None:
            proc = self.cluster.workers[name].proc
            proc.send_signal(signal.SIGSTOP)
            self.done[f"sigstop_{name.split('-')[0]}"] += 1
            threading.Timer(8.0, proc.send_signal, args=(signal.SIGCONT,)).start()
        return fault

    def _redis_restart(self) -> None:
        gateway = self.cluster.gateway.proc.pid
        self.redis_sockets.update((link, description) for link, description in _sockets(gateway).items()
                                  if _is_connection_to(description, self.redis.port))
        self.redis.kill()
        self.redis.start()
        self.done["redis_restart"] += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="minutes of traffic")
    parser.add_argument("--streams", type=int, default=16, help="closed-loop client streams")
    parser.add_argument("--fault-every-s", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=0, help="seed of the traffic mix")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the result JSON goes (default: bench/results/soak/)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    redis_server = RedisServer(tmp)
    redis_server.start()
    cluster = LocalCluster(num_prefill=2, num_decode=2, env=SETTINGS, redis=redis_server.url,
                           sink=lambda name, line: None, log_dir=tmp, metrics=False)
    try:
        cluster.start(timeout_s=600)
        channel = grpc.insecure_channel(cluster.gateway_addr)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        warm = Traffic(stub, args.streams, args.seed - 1000)
        time.sleep(20)
        warm.stop()
        gateway_before, fds_before = _process(cluster.gateway.proc.pid), _fd_table(cluster.gateway.proc.pid)
        redis_before = _connections_to(fds_before, redis_server.port)
        traffic, faults = Traffic(stub, args.streams, args.seed), Faults(cluster, redis_server)
        started = time.monotonic()
        next_fault = started + args.fault_every_s
        while time.monotonic() < started + args.minutes * 60:
            if time.monotonic() >= next_fault:
                faults.inject()
                next_fault += args.fault_every_s
            faults.restart_due()
            time.sleep(0.2)
        hung = traffic.stop()
        time.sleep(8.0)  # a last freeze ends
        faults.restart_due(everything=True)
        time.sleep(float(SETTINGS["TANDEM_REGISTRY_TTL_S"]) + 2)
        leaked_blocks = _leaked_blocks(cluster)
        client = redis.Redis.from_url(redis_server.url)
        entries = sum(not key.endswith(b":blocks") for key in client.scan_iter(match="tandem:*:worker:*"))
        client.close()
        gateway_after = _process(cluster.gateway.proc.pid)
        ports = {int(w.address.rsplit(":", 1)[1]): name for name, w in cluster.workers.items()}
        ports[redis_server.port] = "redis"
        settle_started = time.monotonic()
        fds_after = _settled_fd_table(cluster.gateway.proc.pid, redis_server.port,
                                      baseline=len(fds_before) - redis_before, within_s=RETIRE_GRACE_S + 5,
                                      known=faults.redis_sockets)
        print(f"gateway fds settled in {time.monotonic() - settle_started:.0f} s", file=sys.stderr, flush=True)
        redis_after = _connections_to(fds_after, redis_server.port)
        _print_fd_change(fds_before, fds_after, ports)
        channel.close()
    finally:
        cluster.stop()
        redis_server.stop()
    counts = traffic.counts
    failed = {k: v for k, v in counts.items() if k.startswith("failed_")}
    metrics = {"minutes": args.minutes, "sent": counts["sent"], "completed": counts["completed"],
               "cancelled": counts["cancelled"], "failed_with_status": sum(failed.values()), **failed,
               "hung": hung, "workers_not_exiting": faults.not_exiting, "unclean_drains": faults.unclean_drains,
               "leaked_blocks": leaked_blocks, "stale_registry_entries": max(0, entries - 4),
               "leaked_fds": (len(fds_after) - redis_after) - (len(fds_before) - redis_before),
               "redis_connections_before": redis_before, "redis_connections_after": redis_after,
               "leaked_threads": gateway_after["threads"] - gateway_before["threads"],
               "rss_growth_fraction": round(gateway_after["rss_mb"] / gateway_before["rss_mb"] - 1, 4),
               **{f"faults_{k}": v for k, v in faults.done.items()}}
    accounted = metrics["completed"] + metrics["cancelled"] + metrics["failed_with_status"] + hung
    metrics["accounted"] = int(accounted == metrics["sent"])
    write_result("soak", metrics, tag="cpu", out_dir=args.out_dir, model="SmolLM2-135M-Instruct", machine=machine(),
                 workload={"prefill_workers": 2, "decode_workers": 2, "streams": args.streams,
                           "fault_every_s": args.fault_every_s, "deadline_s": DEADLINE_S, "seed": args.seed,
                           "mix": "70% short greedy (8-24 tokens), 15% ~1000-token prompts, 15% n=2 sampled; "
                                  "10% of all cancelled after their first token",
                           "faults": "SIGKILL prefill, SIGSTOP decode 8 s, SIGKILL decode, SIGTERM prefill, "
                                     "Redis restart; workers restarted 5 s later",
                           "settings": SETTINGS})
    return 0 if accounted == metrics["sent"] and hung == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
