"""A private ``redis-server`` for tests that kill and restart Redis (shared by the gateway and
end-to-end tests)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis


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
