"""The gateway's own checks of a public request, before it is tokenized, and the tokenization.

What the workers check too (the prompt's length and ids, the sampling parameters) is not here:
that is :mod:`cluster.translate`, one function per message for every side. Each check raises
:class:`protos.status.StatusError` (``INVALID_ARGUMENT``) naming the offending field. Checks run
cheapest first, so a request that is too large is refused before its prompt is tokenized.
"""

from __future__ import annotations

import math

from engine.tokenizer import Tokenizer
from gateway.placement import ServiceLevel
from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2

Request = gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest


def check_request_size(size: int, max_request_bytes: int) -> None:
    """Refuse a request of ``size`` serialized bytes when that is more than ``max_request_bytes``."""
    if size > max_request_bytes:
        raise StatusError.invalid_argument("request", f"is {size} bytes, more than the limit of {max_request_bytes}")


def check_input(request: Request) -> str:
    """Return which input form the request uses (``prompt``, ``chat`` or ``token_ids``).

    Raises:
        StatusError: no input, an empty one, or a chat message without a role.
    """
    which = request.WhichOneof("input")
    if which is None:
        raise StatusError.invalid_argument("input", "one of prompt, chat or token_ids is required")
    if which == "prompt" and not request.prompt:
        raise StatusError.invalid_argument("prompt", "must not be empty")
    if which == "chat":
        if not request.chat.messages:
            raise StatusError.invalid_argument("chat.messages", "must not be empty")
        for i, message in enumerate(request.chat.messages):
            if not message.role:
                raise StatusError.invalid_argument(f"chat.messages[{i}].role", "must not be empty")
    if which == "token_ids" and not request.token_ids.ids:
        raise StatusError.invalid_argument("token_ids.ids", "must not be empty")
    return which


def check_prompt_bytes(request: Request, which: str, max_prompt_bytes: int) -> None:
    """Refuse prompt text longer than ``max_prompt_bytes`` UTF-8 bytes (``prompt``, or the
    roles and contents of all ``chat`` messages together), before any of it is tokenized."""
    if which == "prompt":
        size = len(request.prompt.encode())
    elif which == "chat":
        size = sum(len(m.role.encode()) + len(m.content.encode()) for m in request.chat.messages)
    else:
        return
    if size > max_prompt_bytes:
        raise StatusError.invalid_argument(
            "chat.messages" if which == "chat" else "prompt",
            f"is {size} bytes of text, more than the limit of {max_prompt_bytes} (TANDEM_MAX_PROMPT_BYTES)")


def input_field(which: str) -> str:
    """The request field a prompt error names (``prompt``, ``chat`` or ``token_ids.ids``)."""
    return "token_ids.ids" if which == "token_ids" else which


def render_prompt(request: Request, which: str, tokenizer: Tokenizer | None) -> list[int]:
    """The prompt's token ids, exactly as Generate sees them.

    ``prompt`` is encoded with the special tokens the model's post-processor adds (the offline
    ``LLM`` encodes text the same way); ``chat`` is rendered by the chat template with the
    generation prompt appended; ``token_ids`` are used as they are.

    Raises:
        StatusError: text for a model without a tokenizer, or a chat the template refuses.
    """
    if which == "token_ids":
        return list(request.token_ids.ids)
    if tokenizer is None:
        raise StatusError.invalid_argument(which, "this model has no tokenizer; send token_ids")
    if which == "prompt":
        return tokenizer.encode(request.prompt)
    messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    try:
        return tokenizer.apply_chat_template(messages)
    except ValueError as exc:  # no template, or the template refuses the conversation
        raise StatusError.invalid_argument("chat", str(exc)) from exc


def check_service_level(request: gateway_pb2.GenerateRequest) -> ServiceLevel:
    """The request's latency objectives (``0``: the gateway's default).

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``slo.ttft_s``, ``slo.itl_s`` or ``slo.tpot_s``
            when one is negative or not finite.
    """
    for name in ("ttft_s", "itl_s", "tpot_s"):
        value = getattr(request.slo, name)
        if not math.isfinite(value) or value < 0:
            raise StatusError.invalid_argument(f"slo.{name}", f"must be a finite number of seconds >= 0, got {value}")
    return ServiceLevel(request.slo.ttft_s, request.slo.itl_s, request.slo.tpot_s)
