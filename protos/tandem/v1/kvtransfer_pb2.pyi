from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVBlockLayout(_message.Message):
    __slots__ = ("dtype", "block_shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., block_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class NixlRankPool(_message.Message):
    __slots__ = ("base_address", "device_id", "first_head", "num_heads")
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_HEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    base_address: int
    device_id: int
    first_head: int
    num_heads: int
    def __init__(self, base_address: _Optional[int] = ..., device_id: _Optional[int] = ..., first_head: _Optional[int] = ..., num_heads: _Optional[int] = ...) -> None: ...

class NixlSource(_message.Message):
    __slots__ = ("agent_metadata", "agent_name", "num_blocks", "memory_type", "ranks")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    agent_name: str
    num_blocks: int
    memory_type: str
    ranks: _containers.RepeatedCompositeFieldContainer[NixlRankPool]
    def __init__(self, agent_metadata: _Optional[bytes] = ..., agent_name: _Optional[str] = ..., num_blocks: _Optional[int] = ..., memory_type: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[NixlRankPool, _Mapping]]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("reservation_id", "request_id", "first_block_index", "num_blocks", "layout", "data", "crc32", "source_block_ids", "nixl_source", "has_crc32", "block_digests")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NIXL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    HAS_CRC32_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    request_id: str
    first_block_index: int
    num_blocks: int
    layout: KVBlockLayout
    data: bytes
    crc32: int
    source_block_ids: _containers.RepeatedScalarFieldContainer[int]
    nixl_source: NixlSource
    has_crc32: bool
    block_digests: bytes
    def __init__(self, reservation_id: _Optional[str] = ..., request_id: _Optional[str] = ..., first_block_index: _Optional[int] = ..., num_blocks: _Optional[int] = ..., layout: _Optional[_Union[KVBlockLayout, _Mapping]] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., source_block_ids: _Optional[_Iterable[int]] = ..., nixl_source: _Optional[_Union[NixlSource, _Mapping]] = ..., has_crc32: _Optional[bool] = ..., block_digests: _Optional[bytes] = ...) -> None: ...

class TransferKVResponse(_message.Message):
    __slots__ = ("num_blocks_received",)
    NUM_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_received: int
    def __init__(self, num_blocks_received: _Optional[int] = ...) -> None: ...
