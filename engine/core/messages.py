"""The messages between a worker's front end and its engine-core process (vLLM v1's
``EngineCoreRequest`` / ``EngineCoreOutputs`` split), one msgspec struct per kind of event.

They travel as msgpack over ZeroMQ (:mod:`engine.core.core_proc`, :mod:`engine.core.core_client`);
nothing on these sockets is pickled. Requests carry a ``call_id`` when the front end waits for a
:class:`Reply`; a request's tokens come back as :class:`RequestDelta` s, each holding only what
the request gained since the last one (O(new tokens) a step, whatever its length).
"""

from __future__ import annotations

import msgspec

from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams


# ------------------------------------------------------------------ front end -> engine core
class AddRequest(msgspec.Struct, tag=True):
    """Queue a request (``EngineCore.add_request``); its outputs stream back."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    pin_prompt_blocks: bool = False
    release_blocks: list[int] = []
    cache_salt: str = ""
    block_hashes: list[bytes] | None = None


class AddPrefilledRequest(msgspec.Struct, tag=True):
    """Join a request whose prompt KV fills ``block_ids`` to the running batch
    (``EngineCore.add_prefilled_request``); the engine core owns the blocks from now on and
    frees them if it refuses the request."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    cache_salt: str = ""
    block_hashes: list[bytes] | None = None


class Call(msgspec.Struct, tag=True):
    """Run one of the engine core's utility methods (``core_proc.UTILITIES``) between two steps
    and answer with a :class:`Reply` of the same ``call_id`` (0: no answer wanted)."""

    call_id: int
    method: str
    args: list = []


class Shutdown(msgspec.Struct, tag=True):
    """Abort everything, stop the tensor-parallel ranks and exit."""


class PoolHandles(msgspec.Struct, tag=True):
    """The KV pools the front end allocated, one handle per rank
    (``engine.parallel.shared_memory.allocate_shared``), answering :class:`AllocatePools`."""

    handles: list[dict]


Request = AddRequest | AddPrefilledRequest | Call | Shutdown | PoolHandles


# ------------------------------------------------------------------ engine core -> front end
class SampleDelta(msgspec.Struct, array_like=True):
    """What one sample gained: its new tokens, their ``{token_id: logprob}``, and its finish."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestDelta(msgspec.Struct, array_like=True, tag=True):
    """What one request gained in a step (or when it was added, or ended)."""

    request_id: str
    samples: list[SampleDelta]
    num_cached_tokens: int
    pinned_block_ids: list[int]
    finished: bool


class RequestFailed(msgspec.Struct, array_like=True, tag=True):
    """A request ended in failure: ``kind`` is ``"invalid"`` (the engine refused it: a
    ``ValueError``), ``"failed"`` (a step failed while it ran) or ``"dead"`` (the engine cannot
    step any more)."""

    request_id: str
    kind: str
    message: str


class Outputs(msgspec.Struct, tag=True):
    """One iteration's news: request deltas and failures in order, the load snapshot, and the
    prefix-cache events (block hashes stored and removed) since the last message."""

    deltas: list[RequestDelta | RequestFailed]
    stats: EngineStats
    stored: list[bytes] = []
    removed: list[bytes] = []


class Reply(msgspec.Struct, tag=True):
    """The answer to a :class:`Call`: ``value``, or ``error_type`` (``"ValueError"``,
    ``"NoFreeBlocksError"``, ...) with ``error``."""

    call_id: int
    value: object = None
    error_type: str | None = None
    error: str = ""


class Heartbeat(msgspec.Struct, tag=True):
    """Sent every ``HEARTBEAT_S`` by the engine core's output thread: ``stalled_s`` is how long
    its busy loop has been inside one iteration (0 while it waits for work)."""

    stalled_s: float


class EngineInfo(msgspec.Struct):
    """What the front end needs to know of the engine it talks to, sent once it is ready.

    Attributes:
        model_id, block_size, max_model_len, kv_cache_dtype, hash_seed, vocab_size,
        tensor_parallel_size, quantization, max_num_batched_tokens, max_num_seqs: the settings
            a worker publishes (``engine.core.engine_core.EngineCore``'s resolved ones).
        num_blocks: KV blocks per rank.
        eos_token_ids: the model's end-of-sequence tokens (for ``check_stop``).
        device: the engine's device (rank 0's), as ``str(torch.device)`` writes it.
        num_threads: PyTorch's intra-op threads of the engine core's busy loop.
    """

    model_id: str
    block_size: int
    max_model_len: int
    kv_cache_dtype: str
    hash_seed: bytes
    vocab_size: int
    tensor_parallel_size: int
    quantization: str
    max_num_batched_tokens: int
    max_num_seqs: int
    num_blocks: int
    eos_token_ids: list[int]
    device: str
    num_threads: int


class AllocatePools(msgspec.Struct, tag=True):
    """Start-up: the engine core asks the front end for its KV pools (one per rank, on
    ``devices``), which the front end allocates and keeps (it serves their KV transfers)."""

    shape: list[int]
    dtype: str
    devices: list[str]


class Ready(msgspec.Struct, tag=True):
    """Start-up is over: the engine's settings (and every rank has mapped its pool)."""

    info: EngineInfo


class StartupFailed(msgspec.Struct, tag=True):
    """Start-up failed: ``error_type`` (``"ValueError"``: a bad setting) and its message."""

    error_type: str
    error: str


Output = Outputs | Reply | Heartbeat | AllocatePools | Ready | StartupFailed
