"""Moving KV blocks between workers (prefill -> decode): wire format, reservations, transports.

Receive side (decode worker): ``ReservationTable`` (reserved blocks, leases) ->
``KVReceiver`` (check, then write into the cache) <- ``KVTransferServicer`` (the ``TransferKV``
stream). Send side (prefill worker): ``KVTransferClient`` opens ``KVTransferStream``s, behind
the ``KVSender`` / ``KVTransfer`` protocols. Either side's stream carries the blocks' bytes
(gRPC) or the sender's block ids for the receiver to read with NIXL.
"""

from kvtransfer.client import (
    DEFAULT_MAX_CHUNK_BYTES, GRPC_MESSAGE_OPTIONS, MAX_MESSAGE_BYTES, KVTransferClient, KVTransferStream, iter_chunks,
)
from kvtransfer.pool import KVPool
from kvtransfer.receiver import KVReceiver
from kvtransfer.reservations import DEFAULT_LEASE_S, Reservation, ReservationTable
from kvtransfer.servicer import KVTransferServicer
from kvtransfer.transport import KVDestination, KVSender, KVTransfer
from kvtransfer.wire import KV_DTYPES, BlockLayout, decode_chunk, encode_chunk

__all__ = [
    "BlockLayout", "DEFAULT_LEASE_S", "DEFAULT_MAX_CHUNK_BYTES", "GRPC_MESSAGE_OPTIONS", "KVDestination", "KVPool",
    "KVReceiver", "KVSender", "KVTransfer", "KVTransferClient", "KVTransferServicer", "KVTransferStream", "KV_DTYPES",
    "MAX_MESSAGE_BYTES", "Reservation", "ReservationTable", "decode_chunk", "encode_chunk", "iter_chunks",
]
