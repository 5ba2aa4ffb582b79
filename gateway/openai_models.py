"""OpenAI's HTTP API as pydantic types: the requests of ``/v1/chat/completions`` and
``/v1/completions`` (with the extra sampling fields vLLM accepts), their responses and stream
chunks, the model list and the error object.

Field names and meanings are OpenAI's API reference's (and vLLM's for the extras). Requests
ignore fields they do not declare, as OpenAI's server does. The types bound what the wire form
can hold (a count is an unsigned 32-bit integer, a seed an unsigned 64-bit one); what a value
may be beyond that is checked by the gateway's one request path, not here
(:mod:`gateway.openai_io` maps a request onto it).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

UInt32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
Count = Annotated[int, Field(ge=1, le=2**32 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema the answer follows (``schema``; ``name``,
    ``description`` and ``strict`` are accepted and not read: the output always follows it)."""

    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs``: exactly one of its kinds."""

    json_: str | dict | bool | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class TextPart(_Request):
    """A part of a message's content (``text`` is the only type served)."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    """One message of ``messages``: its role and its text."""

    role: str
    content: str | list[TextPart] | None = None


class SamplingRequest(_Request):
    """The fields both endpoints share: OpenAI's, then vLLM's extras (``guided_*`` are vLLM's
    earlier names of ``structured_outputs``' kinds)."""

    model: str
    n: Count = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] | None = None
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras that the engine has
    top_k: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[UInt32] | None = None
    repetition_penalty: float | None = None
    min_tokens: UInt32 = 0
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """A ``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: UInt32 | None = None


class CompletionRequest(SamplingRequest):
    """A ``POST /v1/completions`` body (``prompt``: one text or one list of token ids)."""

    prompt: str | list[str] | list[UInt32] | list[list[UInt32]]
    logprobs: UInt32 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Count | None = None


# -- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens served from a prefix cache."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of a whole request (all choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    """A token's text, UTF-8 bytes and natural log-probability."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A generated token with its most likely alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's log-probabilities, one entry per token."""

    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """A completion choice's log-probabilities (``text_offset``: where each token starts in the text, characters)."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class AssistantMessage(BaseModel):
    """A chat choice's message."""

    role: Literal["assistant"] = "assistant"
    content: str


class Delta(BaseModel):
    """What a chunk adds to a chat choice (``role`` on its first chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatChunkChoice(BaseModel):
    """One choice's part in a chat completion chunk."""

    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class CompletionChoice(BaseModel):
    """One choice of a completion (or its part in a chunk)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    """The whole answer of ``/v1/chat/completions``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion (``usage`` only on the last, when asked for)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Completion(BaseModel):
    """A completion, or (``usage`` ``None`` but on the last) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(BaseModel):
    """The served model, as ``/v1/models`` lists it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    """What went wrong (``param``: the field a 400 names)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object."""

    error: ErrorDetail
