"""Request checks: turn a public ``GenerateRequest`` into prompt token ids and sampling params.

Everything here is pure (no I/O, no gRPC context): each check raises :class:`InvalidArgument`
whose message starts with the offending field's name (``sampling.top_p: must be in (0, 1],
got 1.5``); the servicer answers it with ``INVALID_ARGUMENT``. Checks run cheapest first, so a
request that is too large is refused before its prompt is tokenized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protos.tandem.v1 import gateway_pb2


class InvalidArgument(ValueError):
    """A request field is out of range; ``field`` names it (dotted path in the request)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    """What the gateway accepts (``GatewaySettings`` caps plus the model's sizes).

    Attributes:
        max_model_len: prompt + generated tokens at most.
        vocab_size: every token id must be below it.
        max_tokens_cap: largest ``max_tokens``; ``max_tokens=0`` means "up to max_model_len",
            capped at this value.
        max_n, max_logprobs, max_stop, max_stop_len, max_stop_token_ids: per-field caps.
        max_request_bytes: serialized request size at most.
    """

    max_model_len: int
    vocab_size: int
    max_tokens_cap: int = 4096
    max_n: int = 8
    max_logprobs: int = 20
    max_stop: int = 16
    max_stop_len: int = 256
    max_stop_token_ids: int = 64
    max_request_bytes: int = 4 << 20


def check_request_size(request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest, limits: Limits) -> None:
    """Refuse a request larger than ``limits.max_request_bytes`` (serialized)."""
    size = request.ByteSize()
    if size > limits.max_request_bytes:
        raise InvalidArgument("request", f"is {size} bytes, more than the limit of {limits.max_request_bytes}")


def check_input(request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest) -> str:
    """Return which input form the request uses (``prompt``, ``chat`` or ``token_ids``).

    Raises:
        InvalidArgument: no input, an empty one, or a chat message without a role.
    """
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidArgument("input", "one of prompt, chat or token_ids is required")
    if which == "prompt" and not request.prompt:
        raise InvalidArgument("prompt", "must not be empty")
    if which == "chat":
        if not request.chat.messages:
            raise InvalidArgument("chat.messages", "must not be empty")
        for i, message in enumerate(request.chat.messages):
            if not message.role:
                raise InvalidArgument(f"chat.messages[{i}].role", "must not be empty")
    if which == "token_ids" and not request.token_ids.ids:
        raise InvalidArgument("token_ids.ids", "must not be empty")
    return which


def check_prompt_ids(field: str, ids: list[int], limits: Limits) -> None:
    """Refuse an empty prompt, one that leaves no room for a generated token, or bad token ids."""
    if not ids:
        raise InvalidArgument(field, "renders to no tokens")
    if len(ids) >= limits.max_model_len:
        raise InvalidArgument(field, f"is {len(ids)} tokens; max_model_len is {limits.max_model_len}, so at most "
                                     f"{limits.max_model_len - 1} prompt tokens fit")
    bad = next((t for t in ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(field, f"token id {bad} is not below vocab_size={limits.vocab_size}")


def check_sampling(sampling: gateway_pb2.SamplingParams, prompt_len: int, limits: Limits) -> gateway_pb2.SamplingParams:
    """Check ``sampling`` and return a copy with the defaults made explicit.

    The copy has ``n >= 1`` and ``1 <= max_tokens <= max_model_len - prompt_len`` (a larger
    request is clamped there: the sample then ends with LENGTH at max_model_len); every unset
    optional field keeps its proto default meaning, so workers read it as the client sent it.

    Raises:
        InvalidArgument: naming ``sampling.<field>``.
    """
    room = limits.max_model_len - prompt_len

    def fail(name: str, message: str) -> None:
        raise InvalidArgument(f"sampling.{name}", message)

    if sampling.max_tokens > limits.max_tokens_cap:
        fail("max_tokens", f"must be <= {limits.max_tokens_cap}, got {sampling.max_tokens}")
    if sampling.HasField("temperature") and not (sampling.temperature >= 0 and math.isfinite(sampling.temperature)):
        fail("temperature", f"must be a finite number >= 0, got {sampling.temperature}")
    if sampling.HasField("top_p") and not 0 < sampling.top_p <= 1:
        fail("top_p", f"must be in (0, 1], got {sampling.top_p}")
    if sampling.HasField("top_k") and sampling.top_k < -1:
        fail("top_k", f"must be -1 or 0 (off) or >= 1, got {sampling.top_k}")
    if sampling.HasField("min_p") and not 0 <= sampling.min_p <= 1:
        fail("min_p", f"must be in [0, 1], got {sampling.min_p}")
    if sampling.n > limits.max_n:
        fail("n", f"must be <= {limits.max_n}, got {sampling.n}")
    if sampling.logprobs > limits.max_logprobs:
        fail("logprobs", f"must be <= {limits.max_logprobs}, got {sampling.logprobs}")
    if len(sampling.stop) > limits.max_stop:
        fail("stop", f"at most {limits.max_stop} stop strings, got {len(sampling.stop)}")
    for i, stop in enumerate(sampling.stop):
        if not stop:
            fail(f"stop[{i}]", "must not be empty")
        if len(stop) > limits.max_stop_len:
            fail(f"stop[{i}]", f"is {len(stop)} characters, more than {limits.max_stop_len}")
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        fail("stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(sampling.stop_token_ids)}")
    for i, token in enumerate(sampling.stop_token_ids):
        if token >= limits.vocab_size:
            fail(f"stop_token_ids[{i}]", f"token id {token} is not below vocab_size={limits.vocab_size}")

    checked = gateway_pb2.SamplingParams()
    checked.CopyFrom(sampling)
    checked.n = sampling.n or 1
    wanted = sampling.max_tokens or limits.max_tokens_cap
    checked.max_tokens = max(1, min(wanted, room))
    return checked


def render_prompt(request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest, which: str,
                  tokenizer) -> list[int]:
    """The prompt's token ids, exactly as Generate sees them.

    ``prompt`` is encoded with the tokenizer's special tokens (BOS where the model expects
    one); ``chat`` is rendered by the chat template with the generation prompt appended;
    ``token_ids`` are used as is.

    Raises:
        InvalidArgument: the chat template refuses the conversation, or the model has none.
    """
    if which == "token_ids":
        return list(request.token_ids.ids)
    if which == "prompt":
        return tokenizer.encode(request.prompt, add_special_tokens=True)
    from engine.llm import apply_chat_template

    messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    try:
        return apply_chat_template(tokenizer, messages)
    except Exception as exc:  # jinja's TemplateError, or ValueError: the template rejects the chat
        raise InvalidArgument("chat", f"the model's chat template refused it: {exc}") from exc
