"""Moving KV blocks between workers (prefill -> decode): wire format, reservations, transports.

Receive side (decode worker): ``ReservationTable`` (reserved blocks, leases) ->
``KVReceiver`` (check, then write into the cache) <- ``GrpcKVReceiver`` (``TransferKV`` stream).
Send side (prefill worker): ``GrpcKVSender`` opens ``GrpcKVTransfer`` streams, behind the
``KVSender`` / ``KVTransfer`` protocols.
"""

from kvtransfer.grpc_receiver import GrpcKVReceiver
from kvtransfer.grpc_sender import (
    DEFAULT_MAX_CHUNK_BYTES, GRPC_MESSAGE_OPTIONS, MAX_MESSAGE_BYTES, GrpcKVSender, GrpcKVTransfer, iter_chunks,
)
from kvtransfer.pool import KVPool
from kvtransfer.receiver import KVReceiver
from kvtransfer.reservations import DEFAULT_LEASE_S, Reservation, ReservationTable
from kvtransfer.transport import KVDestination, KVSender, KVTransfer
from kvtransfer.wire import KV_DTYPES, BlockLayout, decode_chunk, encode_chunk

__all__ = [
    "BlockLayout", "DEFAULT_LEASE_S", "DEFAULT_MAX_CHUNK_BYTES", "GRPC_MESSAGE_OPTIONS", "GrpcKVReceiver",
    "GrpcKVSender", "GrpcKVTransfer", "KVDestination", "KVPool", "KVReceiver", "KVSender", "KVTransfer", "KV_DTYPES",
    "MAX_MESSAGE_BYTES", "Reservation", "ReservationTable", "decode_chunk", "encode_chunk", "iter_chunks",
]
