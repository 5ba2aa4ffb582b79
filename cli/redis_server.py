"""A private ``redis-server`` on a free loopback port, in its own directory, with no persistence
and optionally a password:
the local cluster's Redis when none is configured, and the tests' Redis that they kill and
restart."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


class RedisServer:
    """A ``redis-server`` child process.

    Args:
        directory: its working directory (default: a temporary one, removed by :meth:`kill`).
        password: what clients must AUTH with (``requirepass``, written to a config file of
            mode 0600 in ``directory``, never on the command line where ``ps`` shows it); empty:
            none.

    Raises:
        FileNotFoundError: no ``redis-server`` on PATH.
    """

    def __init__(self, directory: Path | None = None, password: str = "") -> None:
        self.password = password
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not on PATH")
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="tandem-redis-")
        self.directory = directory or Path(self._tmp.name)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (again, after :meth:`kill`, on the same port) and wait until it
        answers PING.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout_s``.
        """
        config = self.directory / "redis.conf"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'bind 127.0.0.1\nport {self.port}\ndir "{self.directory}"\nsave ""\nappendonly no\n')
            if self.password:
                f.write(f'requirepass "{self.password}"\n')
        self._proc = subprocess.Popen([self.binary, str(config)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=self.password or None, socket_timeout=0.5,
                             socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server (everything in it is lost)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def stop(self) -> None:
        """Kill the server and remove its temporary directory."""
        self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()
