"""An ASGI app served by uvicorn inside the gateway's own event loop.

``uvicorn.Server.serve()`` runs as a task of the running loop (vLLM serves its OpenAI API the
same way), on a socket bound here: a busy address is a :class:`cluster.server.BindError` naming
the setting (uvicorn would exit the process), and the port is known before the task starts.
The gateway owns SIGTERM and SIGINT (it drains every port in order), so the server installs no
signal handlers of its own; HTTP/1.1 is parsed by h11, whatever else is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from cluster.server import BindError

logger = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self):  # the gateway handles the signals (module docstring)
        return contextlib.nullcontext()


class HttpServer:
    """Serves ``app`` on ``address`` (``host:port``; port 0: a free one), over TLS with
    ``ssl_context``.

    Args:
        app: the ASGI application.
        address: where to listen.
        setting: the setting that named ``address``, for errors.
        ssl_context: the server's TLS context (``None``: plaintext).
    """

    def __init__(self, app, address: str, setting: str, ssl_context: ssl.SSLContext | None = None) -> None:
        # A TLS context of our own (it rotates the certificate), not one uvicorn makes from files.
        factory = (lambda config, default: ssl_context) if ssl_context is not None else None
        self._server = _EmbeddedServer(uvicorn.Config(app, http="h11", ws="none", lifespan="off", log_config=None,
                                                      access_log=False, server_header=False,
                                                      ssl_context_factory=factory))
        self.address, self.setting = address, setting
        self._socket: socket.socket | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port.

        Raises:
            BindError: the address cannot be bound.
        """
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._socket = socket.socket(family, socket.SOCK_STREAM)
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, int(port)))
        except (OSError, ValueError) as exc:
            if self._socket is not None:
                self._socket.close()
            raise BindError(f"{self.setting}: cannot listen on {self.address}: {exc}") from None
        self._socket.set_inheritable(True)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its failure, raised here
                raise BindError(f"{self.setting}: the HTTP server on {self.address} stopped while starting")
            await asyncio.sleep(0.01)
        return self._socket.getsockname()[1]

    async def stop(self, grace_s: float) -> None:
        """Stop taking connections, give the open ones ``grace_s`` seconds, then close them."""
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
