from protos.tandem.v1 import gateway_pb2 as _gateway_pb2
from protos.tandem.v1 import kvtransfer_pb2 as _kvtransfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "cache_salt", "sampling", "kv_spot_check")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_SPOT_CHECK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    sampling: _gateway_pb2.SamplingParams
    kv_spot_check: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., sampling: _Optional[_Union[_gateway_pb2.SamplingParams, _Mapping]] = ..., kv_spot_check: _Optional[bool] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("reservation_id", "num_blocks", "lease_ms", "layout", "num_cached_blocks", "kv_transports", "kv_spot_check")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    KV_SPOT_CHECK_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    num_blocks: int
    lease_ms: int
    layout: _kvtransfer_pb2.KVBlockLayout
    num_cached_blocks: int
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    kv_spot_check: bool
    def __init__(self, reservation_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., lease_ms: _Optional[int] = ..., layout: _Optional[_Union[_kvtransfer_pb2.KVBlockLayout, _Mapping]] = ..., num_cached_blocks: _Optional[int] = ..., kv_transports: _Optional[_Iterable[str]] = ..., kv_spot_check: _Optional[bool] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("address", "reservation_id", "layout", "num_cached_blocks", "kv_transports")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    address: str
    reservation_id: str
    layout: _kvtransfer_pb2.KVBlockLayout
    num_cached_blocks: int
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, address: _Optional[str] = ..., reservation_id: _Optional[str] = ..., layout: _Optional[_Union[_kvtransfer_pb2.KVBlockLayout, _Mapping]] = ..., num_cached_blocks: _Optional[int] = ..., kv_transports: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "destination", "cache_salt", "num_resumed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _gateway_pb2.SamplingParams
    destination: KVDestination
    cache_salt: str
    num_resumed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_gateway_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., cache_salt: _Optional[str] = ..., num_resumed_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_tokens", "num_cached_tokens", "kv_transport", "finish_reasons")
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    first_tokens: _containers.RepeatedCompositeFieldContainer[_gateway_pb2.TokenLogprobs]
    num_cached_tokens: int
    kv_transport: str
    finish_reasons: _containers.RepeatedScalarFieldContainer[_gateway_pb2.FinishReason]
    def __init__(self, first_tokens: _Optional[_Iterable[_Union[_gateway_pb2.TokenLogprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., kv_transport: _Optional[str] = ..., finish_reasons: _Optional[_Iterable[_Union[_gateway_pb2.FinishReason, str]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "reservation_id", "prompt_token_ids", "first_token_ids", "sampling", "local_prefill", "cache_salt", "num_resumed_tokens", "kv_spot_check")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_SPOT_CHECK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _gateway_pb2.SamplingParams
    local_prefill: bool
    cache_salt: str
    num_resumed_tokens: int
    kv_spot_check: bool
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_gateway_pb2.SamplingParams, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., num_resumed_tokens: _Optional[int] = ..., kv_spot_check: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_gateway_pb2.TokenLogprobs]
    finish_reason: _gateway_pb2.FinishReason
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_gateway_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_gateway_pb2.FinishReason, str]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerConfig(_message.Message):
    __slots__ = ("model_id", "block_size", "max_model_len", "kv_cache_dtype", "hash_seed", "vocab_size", "role", "tensor_parallel_size", "kv_transports", "quantization", "max_num_batched_tokens", "device_ids", "serves_prefill")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    SERVES_PREFILL_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    block_size: int
    max_model_len: int
    kv_cache_dtype: str
    hash_seed: bytes
    vocab_size: int
    role: str
    tensor_parallel_size: int
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    quantization: str
    max_num_batched_tokens: int
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    serves_prefill: bool
    def __init__(self, model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., hash_seed: _Optional[bytes] = ..., vocab_size: _Optional[int] = ..., role: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., kv_transports: _Optional[_Iterable[str]] = ..., quantization: _Optional[str] = ..., max_num_batched_tokens: _Optional[int] = ..., device_ids: _Optional[_Iterable[str]] = ..., serves_prefill: _Optional[bool] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting", "config")
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    config: WorkerConfig
    def __init__(self, num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., config: _Optional[_Union[WorkerConfig, _Mapping]] = ...) -> None: ...
