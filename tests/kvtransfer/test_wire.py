"""Blocks survive encode -> decode bit-exact in every KV dtype, and bad chunks are refused by name."""

import grpc
import pytest
import torch

from kvtransfer import KV_DTYPES, BlockLayout, decode_chunk, encode_chunk
from protos.status import StatusError
from protos.tandem.v1 import kvtransfer_pb2

BLOCK_SHAPE = (2, 2, 4, 2, 8)  # [num_layers, 2, block_size, num_kv_heads, head_dim]


def random_blocks(count: int, dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included) viewed as ``dtype``."""
    layout = BlockLayout(dtype, BLOCK_SHAPE)
    raw = torch.randint(0, 256, (count * layout.block_nbytes,), dtype=torch.uint8)
    return raw.view(dtype).view(count, *BLOCK_SHAPE)


@pytest.mark.parametrize("dtype_name", sorted(KV_DTYPES))
def test_round_trip_is_bit_exact(dtype_name: str) -> None:
    blocks = random_blocks(3, KV_DTYPES[dtype_name])
    chunk = encode_chunk(blocks, reservation_id="r", request_id="q", first_block_index=5)
    wire = kvtransfer_pb2.KVChunk.FromString(chunk.SerializeToString())
    assert (wire.layout.dtype, wire.num_blocks, wire.first_block_index) == (dtype_name, 3, 5)
    decoded = decode_chunk(wire, BlockLayout(KV_DTYPES[dtype_name], BLOCK_SHAPE))
    assert decoded.dtype == blocks.dtype and decoded.shape == blocks.shape
    assert torch.equal(decoded.view(torch.uint8), blocks.view(torch.uint8))


def _mutations() -> dict:
    def wrong_dtype(c):
        c.layout.dtype = "float16"

    def unknown_dtype(c):
        c.layout.dtype = "object"

    def wrong_shape(c):
        c.layout.block_shape[2] = 8

    def short_data(c):
        c.data = c.data[:-2]

    def no_blocks(c):
        c.num_blocks = 0

    return {
        "wrong_dtype": (wrong_dtype, grpc.StatusCode.INVALID_ARGUMENT, "dtype 'float16' != expected 'bfloat16'"),
        "unknown_dtype": (unknown_dtype, grpc.StatusCode.INVALID_ARGUMENT, "dtype 'object'"),
        "wrong_shape": (wrong_shape, grpc.StatusCode.INVALID_ARGUMENT, "block_shape [2, 2, 8, 2, 8]"),
        "short_data": (short_data, grpc.StatusCode.INVALID_ARGUMENT, "bytes != 2 blocks"),
        "no_blocks": (no_blocks, grpc.StatusCode.INVALID_ARGUMENT, "num_blocks must be >= 1"),
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_bad_chunk_is_refused_with_a_clear_status(name: str) -> None:
    mutate, code, text = _mutations()[name]
    chunk = encode_chunk(random_blocks(2, torch.bfloat16), reservation_id="r", request_id="q", first_block_index=0)
    mutate(chunk)
    with pytest.raises(StatusError) as info:
        decode_chunk(chunk, BlockLayout(torch.bfloat16, BLOCK_SHAPE))
    assert info.value.code == code and text in info.value.message


def test_flipped_byte_is_data_loss() -> None:
    chunk = encode_chunk(random_blocks(2, torch.float32), reservation_id="r", request_id="q", first_block_index=0)
    data = bytearray(chunk.data)
    data[100] ^= 0x01
    chunk.data = bytes(data)
    with pytest.raises(StatusError) as info:
        decode_chunk(chunk, BlockLayout(torch.float32, BLOCK_SHAPE))
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "CRC-32" in info.value.message


def test_layout_rejects_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        BlockLayout(torch.int64, BLOCK_SHAPE)


def test_layout_proto_round_trip_and_unknown_dtype() -> None:
    layout = BlockLayout(torch.bfloat16, BLOCK_SHAPE)
    assert BlockLayout.from_proto(layout.to_proto()) == layout
    with pytest.raises(StatusError) as info:
        BlockLayout.from_proto(kvtransfer_pb2.KVBlockLayout(dtype="object", block_shape=BLOCK_SHAPE))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
