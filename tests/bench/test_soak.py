"""The short soak CI runs (5 minutes of traffic): a local cluster of 2 prefill + 2 decode
workers under mixed traffic with a fault every 30 s (SIGKILL, SIGSTOP, SIGTERM of workers, a
Redis restart). Every request is accounted for, none hangs, and
once idle no block, registry entry, fd or thread is left behind. ``python -m bench.soak --minutes 60``
is the long form, its results under bench/results/soak/."""

import contextlib
import json
import os
import socket
import struct

import pytest

from bench.soak import _connections_to, _fd_table, _sockets, main
from cluster.registry import REDIS_MAX_CONNECTIONS

pytestmark = pytest.mark.slow


def test_a_short_soak_leaves_nothing_hung_or_leaked(tmp_path) -> None:
    assert main(["--minutes", "5", "--streams", "8", "--fault-every-s", "30", "--out-dir", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("soak-*.json")
    metrics = json.loads(result.read_text())["metrics"]
    assert metrics["completed"] >= 100, metrics
    assert metrics["accounted"] == 1 and metrics["hung"] == 0 and metrics["workers_not_exiting"] == 0, metrics
    assert metrics["leaked_blocks"] == 0 and metrics["stale_registry_entries"] == 0, metrics
    assert sum(v for k, v in metrics.items() if k.startswith("faults_")) >= 5, metrics
    # The gateway's fds (its Redis pool aside) and threads: a channel reconnecting at the moment
    # of measurement may hold one more of each.
    assert metrics["leaked_fds"] <= 1 and metrics["leaked_threads"] <= 1, metrics
    assert 1 <= metrics["redis_connections_after"] <= REDIS_MAX_CONNECTIONS, metrics


def test_a_connection_its_peer_reset_is_still_known_by_what_it_was() -> None:
    """A socket the peer reset leaves ``/proc/<pid>/net/tcp`` while its fd stays open; named
    before the reset, it is counted with the connections to that port (a Redis connection the
    soak's Redis restart reset, still held by the gateway's pool)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            known = {link: d for link, d in _sockets(os.getpid()).items() if d.endswith(f" -> {port}")}
            assert len(known) == 1
            accepted.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            accepted.close()  # an RST, not a FIN
            with contextlib.suppress(ConnectionResetError):
                client.recv(1)
            table = _fd_table(os.getpid(), known)
            assert table[client.fileno()] == f"reset {next(iter(known.values()))}"
            assert _connections_to(table, port) == 1
            assert _fd_table(os.getpid())[client.fileno()].startswith("socket:[")  # unnamed without it
