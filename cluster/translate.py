"""Translation between the wire messages and the engine's types: one function per message,
used by every side (the gateway and both workers check a request with the same code).

Every refusal is a :class:`protos.status.StatusError` with ``INVALID_ARGUMENT`` whose message
starts with the offending field's name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from cluster.registry import Role, WorkerConfig
from cluster.settings import RequestLimits
from engine.sampling_params import SamplingParams
from engine.validation import check_prompt
from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2, worker_pb2

REQUEST_ID_MAX_CHARS = 128
# The gateway names a worker's request "{client's id}-{8 hex digits}" (one per attempt).
WORKER_REQUEST_ID_MAX_CHARS = REQUEST_ID_MAX_CHARS + 16
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")
CACHE_SALT_MAX_CHARS = 128

_FINISH_REASONS = {None: gateway_pb2.FINISH_REASON_UNSPECIFIED, "stop": gateway_pb2.FINISH_REASON_STOP,
                   "length": gateway_pb2.FINISH_REASON_LENGTH, "abort": gateway_pb2.FINISH_REASON_ABORT}


def check_request_id(request_id: str, max_chars: int = WORKER_REQUEST_ID_MAX_CHARS) -> None:
    """Refuse a request id that is empty, longer than ``max_chars`` characters, or has a
    character outside ``A-Z a-z 0-9 . _ : -`` (it is echoed in responses and written in every
    log line of its request, so it can neither be huge nor forge a line).

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``request_id`` (the id itself is not repeated).
    """
    if not request_id:
        raise StatusError.invalid_argument("request_id", "must not be empty")
    if len(request_id) > max_chars:
        raise StatusError.invalid_argument("request_id", f"is {len(request_id)} characters, more than {max_chars}")
    if not _REQUEST_ID.fullmatch(request_id):
        raise StatusError.invalid_argument("request_id", "may contain only A-Z a-z 0-9 . _ : -")


def check_cache_salt(cache_salt: str) -> None:
    """Refuse a prefix-cache salt longer than :data:`CACHE_SALT_MAX_CHARS` characters.

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``cache_salt``.
    """
    if len(cache_salt) > CACHE_SALT_MAX_CHARS:
        raise StatusError.invalid_argument("cache_salt", f"is {len(cache_salt)} characters, more than "
                                                         f"{CACHE_SALT_MAX_CHARS}")


def check_prompt_ids(field: str, prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """:func:`engine.validation.check_prompt` as a status: ``INVALID_ARGUMENT`` naming ``field``.

    Raises:
        StatusError: the prompt is empty, too long, or has an id outside the vocabulary.
    """
    try:
        check_prompt(prompt_token_ids, max_model_len, vocab_size)
    except ValueError as exc:
        raise StatusError.invalid_argument(field, str(exc).removeprefix("prompt ")) from None


def sampling_params_from_proto(msg: gateway_pb2.SamplingParams, prompt_len: int, config: WorkerConfig,
                               limits: RequestLimits) -> SamplingParams:
    """``tandem.v1.SamplingParams`` → ``engine.SamplingParams``, checked against ``limits``.

    Proto defaults mean what gateway.proto says: ``max_tokens`` 0 = until a stop condition or
    ``max_model_len``; a larger ``max_tokens`` than ``max_model_len - prompt_len`` is clamped to
    it (the sample then ends with LENGTH); ``n`` 0 = 1; unset optional fields take the engine's
    defaults.

    Args:
        msg: as received.
        prompt_len: tokens in the (valid) prompt.
        config: the pool's settings (``max_model_len``, ``vocab_size``).
        limits: the request caps.

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``sampling.<field>``.
    """
    def fail(name: str, message: str) -> StatusError:
        return StatusError.invalid_argument(f"sampling.{name}", message)

    n = msg.n or 1
    if n > limits.max_n:
        raise fail("n", f"must be <= {limits.max_n}, got {n}")
    if msg.logprobs > limits.max_logprobs:
        raise fail("logprobs", f"must be <= {limits.max_logprobs}, got {msg.logprobs}")
    # An empty stop string matches nothing: it is dropped, not refused (grpcurl's
    # ``describe -msg-template`` body has one: a template must be accepted as it comes).
    stops = [stop for stop in msg.stop if stop]
    if len(stops) > limits.max_stop:
        raise fail("stop", f"at most {limits.max_stop} stop strings, got {len(stops)}")
    for i, stop in enumerate(msg.stop):
        if len(stop) > limits.max_stop_len:
            raise fail(f"stop[{i}]", f"is {len(stop)} characters, more than {limits.max_stop_len}")
    if len(msg.stop_token_ids) > limits.max_stop_token_ids:
        raise fail("stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(msg.stop_token_ids)}")
    for i, token in enumerate(msg.stop_token_ids):
        if token >= config.vocab_size:
            raise fail(f"stop_token_ids[{i}]", f"token id {token} is not below vocab_size={config.vocab_size}")
    for name in ("temperature", "top_p", "min_p"):
        if msg.HasField(name) and not math.isfinite(getattr(msg, name)):
            raise fail(name, f"must be a finite number, got {getattr(msg, name)}")
    room = config.max_model_len - prompt_len
    kwargs = {name: getattr(msg, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed")
              if msg.HasField(name)}
    try:
        return SamplingParams(
            max_tokens=min(msg.max_tokens, room) if msg.max_tokens else room, stop=stops,
            stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos, n=n,
            logprobs=msg.logprobs, **kwargs)
    except ValueError as exc:  # SamplingParams names the field first: "top_p must be in (0, 1], ..."
        name, _, message = str(exc).partition(" ")
        raise fail(name, message) from None


def token_logprobs(token_id: int, logprobs: dict[int, float], num_top: int) -> gateway_pb2.TokenLogprobs:
    """One generated token and its log-probabilities as ``tandem.v1.TokenLogprobs``.

    ``logprobs`` is the engine's ``{token_id: logprob}`` of the sampled token plus the top
    ``num_top``; the top list is its ``num_top`` most likely entries.
    """
    top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:num_top] if num_top else []
    return gateway_pb2.TokenLogprobs(
        token_id=token_id, logprob=logprobs.get(token_id, 0.0),
        top_logprobs=[gateway_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top])


def finish_reason_to_proto(reason: str | None) -> int:
    """The engine's ``"stop"``/``"length"``/``"abort"``/``None`` as ``tandem.v1.FinishReason``."""
    return _FINISH_REASONS[reason]


def worker_config_to_proto(config: WorkerConfig, role: Role) -> worker_pb2.WorkerConfig:
    """A worker's published settings as ``tandem.v1.WorkerConfig``."""
    return worker_pb2.WorkerConfig(
        model_id=config.model_id, block_size=config.block_size, max_model_len=config.max_model_len,
        kv_cache_dtype=config.kv_cache_dtype, hash_seed=config.hash_seed, vocab_size=config.vocab_size,
        role=role.value, tensor_parallel_size=config.tensor_parallel_size, kv_transports=config.kv_transports,
        quantization=config.quantization, max_num_batched_tokens=config.max_num_batched_tokens,
        device_ids=config.device_ids, serves_prefill=config.serves_prefill)


def worker_config_from_proto(msg: worker_pb2.WorkerConfig) -> WorkerConfig:
    """``tandem.v1.WorkerConfig`` → :class:`cluster.registry.WorkerConfig` (the role is dropped:
    the caller knows which pool it asked)."""
    return WorkerConfig(msg.model_id, msg.block_size, msg.max_model_len, msg.kv_cache_dtype, msg.hash_seed,
                        msg.vocab_size, msg.tensor_parallel_size, tuple(msg.kv_transports), msg.quantization,
                        msg.max_num_batched_tokens, tuple(msg.device_ids), msg.serves_prefill)
