"""OpenAI's requests ↔ Tandem's request and responses.

:func:`generate_request` is the one mapping of an OpenAI request onto a native
``tandem.v1.GenerateRequest``: every field the engine serves is set there (OpenAI's, and
vLLM's extras: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``bad_words``,
``stop_token_ids``, ``ignore_eos``, ``structured_outputs`` and its earlier ``guided_*`` names).
Ranges are the native path's to check (:mod:`gateway.request`); its refusals name the native
field, which :data:`CHAT_NAMES` and :data:`COMPLETION_NAMES` rename into OpenAI's, and the
renames :func:`generate_request` returns name the field a structured output came from.

The responses are built from the native messages (:class:`Choices` collects them): text, finish
reasons (``stop``, ``length``, ``abort``), log-probabilities with each token's text and bytes,
and usage with ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.openai_models import (ChatCompletionRequest, ChatLogprobs, CompletionLogprobs, CompletionRequest,
                                   PromptTokensDetails, SamplingRequest, TokenLogprob, TopLogprob, Usage)
from gateway.vllm_params import STRUCTURED_OUTPUTS, set_logit_bias, set_structured_output
from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2

# vLLM's earlier names of structured outputs' kinds, still sent by many clients.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# The native field an error names → OpenAI's, tried in order (gateway.frontend.renamed).
_COMMON_NAMES = {"sampling.": "", "token_ids.ids": "prompt", "request_id": "x-request-id"}
CHAT_NAMES = {"sampling.logprobs": "top_logprobs", "chat.messages": "messages", "chat": "messages", **_COMMON_NAMES}
COMPLETION_NAMES = _COMMON_NAMES
FINISH_REASONS = {gateway_pb2.FINISH_REASON_STOP: "stop", gateway_pb2.FINISH_REASON_LENGTH: "length",
                  gateway_pb2.FINISH_REASON_ABORT: "abort"}


def generate_request(request: ChatCompletionRequest | CompletionRequest,
                     request_id: str) -> tuple[gateway_pb2.GenerateRequest, dict[str, str]]:
    """The native request of an OpenAI one, and the renames of the native fields it set under
    other names (``sampling.json_schema`` → ``response_format.json_schema.schema``, ...), for
    :func:`gateway.frontend.renamed` before :data:`CHAT_NAMES` / :data:`COMPLETION_NAMES`.

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming the OpenAI field: a content part that is not
            text, more than one prompt, a ``response_format`` type other than ``text``,
            ``json_object`` and ``json_schema`` (or one without a schema), more than one
            structured output, a ``logit_bias`` key that is not a token id.
    """
    sampling, renames = _sampling(request)
    generate = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs and not request.logprobs:
            raise StatusError.invalid_argument("top_logprobs", "needs logprobs true")
        generate.sampling.logprobs = (request.top_logprobs or 0) if request.logprobs else 0
        if request.max_completion_tokens is not None:
            generate.sampling.max_tokens = request.max_completion_tokens
        generate.chat.messages.extend(gateway_pb2.ChatMessage(role=m.role, content=_text(i, m.content))
                                      for i, m in enumerate(request.messages))
        return generate, renames
    if request.echo:
        raise StatusError.invalid_argument("echo", "not supported yet")
    if request.suffix:
        raise StatusError.invalid_argument("suffix", "not supported yet")
    if request.best_of is not None and request.best_of != request.n:
        raise StatusError.invalid_argument("best_of", "not supported yet (only best_of = n)")
    generate.sampling.logprobs = request.logprobs or 0
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise StatusError.invalid_argument("prompt", f"one prompt per request (a batch of {len(prompt)} is not "
                                                         "supported yet)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        generate.prompt = prompt
    else:
        generate.token_ids.ids.extend(prompt)
    return generate, renames


def _sampling(request: SamplingRequest) -> tuple[gateway_pb2.SamplingParams, dict[str, str]]:
    sampling = gateway_pb2.SamplingParams(n=request.n, ignore_eos=request.ignore_eos,
                                          stop=[request.stop] if isinstance(request.stop, str) else request.stop,
                                          stop_token_ids=request.stop_token_ids, min_tokens=request.min_tokens,
                                          bad_words=request.bad_words)
    # OpenAI's completions default to 16 new tokens; a chat goes on until a stop or max_model_len.
    sampling.max_tokens = request.max_tokens or (16 if isinstance(request, CompletionRequest) else 0)
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(request, name)
        if value is not None:
            if isinstance(value, float) and not math.isfinite(value):
                raise StatusError.invalid_argument(name, f"must be a finite number, got {value}")
            setattr(sampling, name, value)
    if request.logit_bias:
        set_logit_bias(sampling, request.logit_bias, "logit_bias")
    return sampling, _structured_output(request, sampling)


def _structured_output(request: SamplingRequest, sampling: gateway_pb2.SamplingParams) -> dict[str, str]:
    """Set the request's structured output (``response_format``, ``structured_outputs`` or a
    ``guided_*`` field) on ``sampling``; returns the rename of the native field it set."""
    given: list[tuple[str, object, str]] = []  # (vLLM's kind, value, OpenAI's field)
    form = request.response_format
    if form is not None and form.type != "text":
        if form.type == "json_object":
            given.append(("json_object", True, "response_format"))
        elif form.type == "json_schema":
            if form.json_schema is None or form.json_schema.schema_ is None:
                raise StatusError.invalid_argument("response_format.json_schema.schema", "is required")
            given.append(("json", form.json_schema.schema_, "response_format.json_schema.schema"))
        else:
            raise StatusError.invalid_argument("response_format.type", f"must be text, json_object or json_schema, "
                                                                       f"got {form.type!r}")
    if request.structured_outputs is not None:
        chosen = {kind: getattr(request.structured_outputs, "json_" if kind == "json" else kind)
                  for kind in STRUCTURED_OUTPUTS}
        given += [(kind, value, f"structured_outputs.{kind}") for kind, value in chosen.items() if value is not None]
    given += [(kind, getattr(request, name), name) for name, kind in GUIDED.items()
              if getattr(request, name) is not None]
    for kind, value, field in given:
        set_structured_output(sampling, kind, value, field)
    if not given:
        return {}
    kind, _, field = given[0]
    return {f"sampling.{STRUCTURED_OUTPUTS[kind]}": field}


def _text(index: int, content: str | list | None) -> str:
    """A message's content as text (its text parts joined by newlines, as vLLM does)."""
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise StatusError.invalid_argument(f"messages[{index}].content[{j}].type",
                                               f"{part.type!r} is not supported (text only)")
    return "\n".join(part.text for part in content)


def usage(native: gateway_pb2.Usage) -> Usage:
    """OpenAI's usage of the native one."""
    return Usage(prompt_tokens=native.prompt_tokens, completion_tokens=native.completion_tokens,
                 total_tokens=native.prompt_tokens + native.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=native.cached_prompt_tokens))


class TokenText:
    """Each token's own text (a token that is part of a multi-byte character decodes to U+FFFD),
    for log-probabilities; ``decode``: the tokenizer's ``decode`` of a list of ids."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode

    def __call__(self, token_id: int) -> str:
        return self.decode([token_id])

    def top(self, logprobs: gateway_pb2.TokenLogprobs) -> list[TopLogprob]:
        return [self._top(t.token_id, t.logprob) for t in logprobs.top_logprobs]

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def chat(self, logprobs: Sequence[gateway_pb2.TokenLogprobs]) -> ChatLogprobs:
        """The ``logprobs`` of a chat choice (or chunk)."""
        return ChatLogprobs(content=[TokenLogprob(**self._top(lp.token_id, lp.logprob).model_dump(),
                                                  top_logprobs=self.top(lp)) for lp in logprobs])

    def completion(self, logprobs: Sequence[gateway_pb2.TokenLogprobs], offset: int) -> CompletionLogprobs:
        """The ``logprobs`` of a completion choice (or chunk) whose text starts ``offset``
        characters into the choice's."""
        out = CompletionLogprobs()
        for lp in logprobs:
            text = self(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({t.token: t.logprob for t in self.top(lp)})
            out.text_offset.append(offset)
            offset += len(text)
        return out


@dataclass
class Choice:
    """One choice collected from the native messages of its sample."""

    text: list[str] = field(default_factory=list)
    logprobs: list[gateway_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class Choices:
    """The choices of a whole (not streamed) response, and its usage once the last message came.

    Args:
        n: choices.
    """

    def __init__(self, n: int) -> None:
        self.choices = [Choice() for _ in range(n)]
        self.usage: gateway_pb2.Usage | None = None

    def add(self, message: gateway_pb2.GenerateResponse) -> None:
        choice = self.choices[message.index]
        choice.text.append(message.text)
        choice.logprobs.extend(message.logprobs)
        choice.finish_reason = FINISH_REASONS.get(message.finish_reason, choice.finish_reason)
        if message.HasField("usage"):
            self.usage = message.usage
