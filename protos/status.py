"""The one error type that carries a gRPC status, on every side of every call.

It sits beside the wire contract because the status codes are part of that contract
(docs/architecture.md, "Errors") and every layer that speaks it raises this type: the KV data
plane (``kvtransfer``), the shared serving code (``cluster``), the workers and the gateway.
A servicer ends a call with ``context.abort(exc.code, exc.message)``.
"""

from __future__ import annotations

import grpc


class StatusError(Exception):
    """An operation ends with gRPC status ``code`` and ``message``.

    Attributes:
        code: the status (``INVALID_ARGUMENT`` for bad input, ``RESOURCE_EXHAUSTED`` when over
            capacity, ``UNAVAILABLE`` for a missing or dead peer, ``DEADLINE_EXCEEDED``, ...).
        message: what went wrong; for bad input it starts with the offending field's name.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def invalid_argument(cls, field: str, message: str) -> StatusError:
        """``INVALID_ARGUMENT`` with the message ``"<field>: <message>"`` (``field`` is the dotted
        path of the offending request field, e.g. ``sampling.top_p``)."""
        return cls(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")
