"""Fixtures for the cluster-state tests: the shared Redis at 127.0.0.1:6379 under a unique
test-only key prefix (deleted afterwards), and private ``redis-server`` processes that a test
may kill and restart."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def key_prefix():
    """A fresh ``test-<uuid>`` key prefix on the shared Redis; its keys are deleted after the test."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail("no Redis at 127.0.0.1:6379: redis-server --daemonize yes --bind 127.0.0.1 "
                    "--port 6379 --save '' --appendonly no")
    prefix = f"test-{uuid.uuid4().hex}"
    yield prefix
    keys = list(client.scan_iter(match=f"tandem:{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


class RedisServer:
    """A private ``redis-server`` on a free loopback port, in its own directory, no persistence."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server and wait (at most 5 s) until it answers PING."""
        self._proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 5
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        """SIGKILL the server (everything in it is lost)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


@pytest.fixture
def private_redis(tmp_path):
    """A started :class:`RedisServer`, killed after the test."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not on PATH")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis_url() -> str:
    """URL of the shared Redis (use with ``key_prefix``)."""
    return REDIS_URL
