"""The one error type of KV transfer, carrying the gRPC status both sides report."""

from __future__ import annotations

import grpc


class KVTransferError(Exception):
    """A KV transfer was refused or failed.

    Attributes:
        code: the gRPC status (DESIGN.md, "Errors"): ``INVALID_ARGUMENT`` (a chunk does not fit
            its reservation), ``DATA_LOSS`` (checksum mismatch), ``NOT_FOUND`` (unknown or
            expired reservation), ``FAILED_PRECONDITION`` (transfer incomplete), ``ALREADY_EXISTS``
            (request already holds a reservation), or whatever the peer's call ended with.
        message: what went wrong, naming the reservation and the offending value.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
