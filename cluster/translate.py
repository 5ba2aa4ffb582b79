"""Translation between the wire messages and the engine's types: one function per message,
used by every side (the gateway and both workers check a request with the same code).

Every refusal is a :class:`protos.status.StatusError` with ``INVALID_ARGUMENT`` whose message
starts with the offending field's name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from cluster.registry import Role, WorkerConfig
from cluster.settings import RequestLimits
from engine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams, StructuredOutput
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
                               limits: RequestLimits, num_resumed_tokens: int = 0) -> SamplingParams:
    """``tandem.v1.SamplingParams`` → ``engine.SamplingParams``, checked against ``limits``.

    Proto defaults mean what gateway.proto says: ``max_tokens`` 0 = until a stop condition or
    ``max_model_len``; a larger ``max_tokens`` than ``max_model_len - prompt_len`` is clamped to
    it (the sample then ends with LENGTH), and ``min_tokens`` with it; ``n`` 0 = 1; unset
    optional fields take the engine's defaults; ``json_object`` false is no structured output.
    ``bad_words`` are text, which the gateway tokenizes into ``bad_words_token_ids`` before this
    (``gateway.request.with_bad_words_tokenized``): a worker refuses them. A structured output's text is
    checked here (its size, a schema's JSON); whether it compiles, by the engine.

    Args:
        msg: as received.
        prompt_len: tokens in the (valid) prompt.
        config: the pool's settings (``max_model_len``, ``vocab_size``).
        limits: the request caps.
        num_resumed_tokens: of the prompt, the output already sent (a resumed stream).

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``sampling.<field>`` (``num_resumed_tokens``
            itself).
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
    _check_token_ids(fail, "stop_token_ids", msg.stop_token_ids, limits.max_stop_token_ids, config.vocab_size)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(msg, name)):
            raise fail(name, f"must be a finite number, got {getattr(msg, name)}")
    if len(msg.logit_bias) > limits.max_logit_bias:
        raise fail("logit_bias", f"at most {limits.max_logit_bias} entries, got {len(msg.logit_bias)}")
    for token, bias in msg.logit_bias.items():
        if token >= config.vocab_size:
            raise fail(f"logit_bias[{token}]", f"token id {token} is not below vocab_size={config.vocab_size}")
        if not math.isfinite(bias):
            raise fail(f"logit_bias[{token}]", f"must be a finite number, got {bias}")
    if msg.bad_words:
        raise fail("bad_words", "is text: the gateway sends it tokenized, as bad_words_token_ids")
    if len(msg.bad_words_token_ids) > limits.max_bad_words:
        raise fail("bad_words_token_ids", f"at most {limits.max_bad_words} token sequences, "
                                          f"got {len(msg.bad_words_token_ids)}")
    for i, word in enumerate(msg.bad_words_token_ids):
        _check_token_ids(fail, f"bad_words_token_ids[{i}]", word.ids, MAX_BAD_WORD_TOKENS, config.vocab_size)
    if msg.max_tokens and msg.min_tokens > msg.max_tokens:
        raise fail("min_tokens", f"must be <= max_tokens={msg.max_tokens}, got {msg.min_tokens}")
    if not 0 <= num_resumed_tokens < prompt_len:
        raise StatusError.invalid_argument("num_resumed_tokens", f"must be below the prompt's {prompt_len} tokens, "
                                                                 f"got {num_resumed_tokens}")
    room = config.max_model_len - prompt_len
    max_tokens = min(msg.max_tokens, room) if msg.max_tokens else room
    kwargs = {name: getattr(msg, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed",
                                                    "repetition_penalty", "num_speculative_tokens")
              if msg.HasField(name)}
    try:
        return SamplingParams(
            max_tokens=max_tokens, stop=stops, stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
            n=n, logprobs=msg.logprobs, presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty, logit_bias=dict(msg.logit_bias),
            min_tokens=min(msg.min_tokens, max_tokens),
            bad_words_token_ids=[list(w.ids) for w in msg.bad_words_token_ids],
            structured_output=structured_output_from_proto(msg, limits), num_resumed_tokens=num_resumed_tokens,
            **kwargs)
    except ValueError as exc:
        raise engine_refusal(exc) from None


def engine_refusal(exc: ValueError) -> StatusError:
    """The engine's refusal of sampling parameters (its message starts with the field: ``top_p
    must be in (0, 1], ...``) as ``INVALID_ARGUMENT`` naming ``sampling.<field>``."""
    name, _, message = str(exc).partition(" ")
    return StatusError.invalid_argument(f"sampling.{name}", message)


def structured_output_from_proto(msg: gateway_pb2.SamplingParams, limits: RequestLimits) -> StructuredOutput | None:
    """``SamplingParams``' ``structured_output`` oneof as the engine's
    :class:`~engine.sampling_params.StructuredOutput` (``None``: unset, or ``json_object`` false).

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``sampling.<field>``: more than
            ``max_structured_output_bytes`` of text, no choice, an empty one, a schema that is
            not JSON of an object or a boolean.
    """
    kind = msg.WhichOneof("structured_output")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    texts = value if kind == "choice" else [] if kind == "json_object" else [value]
    size = sum(len(text.encode()) for text in texts)
    if size > limits.max_structured_output_bytes:
        raise StatusError.invalid_argument(f"sampling.{kind}", f"is {size} bytes, more than "
                                                              f"{limits.max_structured_output_bytes}")
    if kind == "choice" and not value:
        raise StatusError.invalid_argument("sampling.choice", "must hold at least one choice")
    try:
        return StructuredOutput(**{kind: value})
    except ValueError as exc:
        raise engine_refusal(exc) from None


def _check_token_ids(fail: Callable[[str, str], StatusError], field: str, ids: Sequence[int], max_count: int,
                     vocab_size: int) -> None:
    """Refuse more than ``max_count`` ids, or one not below ``vocab_size``, naming ``field``."""
    if len(ids) > max_count:
        raise fail(field, f"at most {max_count} ids, got {len(ids)}")
    for i, token in enumerate(ids):
        if token >= vocab_size:
            raise fail(f"{field}[{i}]", f"token id {token} is not below vocab_size={vocab_size}")


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
