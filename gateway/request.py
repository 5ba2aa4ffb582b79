"""Any API's request as one checked request: the input form and sizes, the request id, the
latency objectives, tokenization (the chat template included), the prompt against the pool's
limits and its block hashes, the sampling parameters against the request caps, and the
caller's tenant.

Every API translates its request into a ``tandem.v1.GenerateRequest`` first (tandem.v1 as it
comes, KServe by :mod:`gateway.kserve_io`, OpenAI by :mod:`gateway.openai_io`), and
:meth:`Intake.check_request` turns that into a :class:`CheckedRequest`, the one thing the orchestrator
takes. The checks are the gateway's own (below) and :mod:`cluster.translate`'s (the ones
every worker makes again for itself, with the same caps); each refusal is a
:class:`protos.status.StatusError` (``INVALID_ARGUMENT``) naming the native field (``prompt``,
``sampling.top_p``), which an adapter renames into its own terms
(:func:`gateway.frontend.renamed`). Checks run cheapest first, so a request that is too large is
refused before its prompt is tokenized.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass

import grpc

from cluster.registry import WorkerConfig
from cluster.settings import RequestLimits
from cluster.translate import REQUEST_ID_MAX_CHARS, check_prompt_ids, check_request_id, sampling_params_from_proto
from engine.block_hash import hash_blocks, salted_seed
from engine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from engine.tokenizer import Tokenizer
from gateway.auth import Tenant
from gateway.heap import HeapTrimmer
from gateway.placement import ServiceLevel
from gateway.router import ClusterView
from gateway.served_model import ServedModel
from gateway.tokenizer_pool import TokenizerPool
from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2

Request = gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest


@dataclass(frozen=True)
class CheckedRequest:
    """One request that passed every gateway check.

    Attributes:
        request_id: the client's id, or one the gateway made (``req-`` + 12 hex digits).
        prompt: the prompt's token ids (after the chat template).
        block_hashes: the chained hashes of the prompt's full blocks under the tenant's salt
            (:func:`engine.block_hash.hash_blocks`), what routing looks up.
        sampling: the sampling parameters as the workers get them (each checks them itself).
        params: the same, as the gateway checked them (``max_tokens`` clamped to the room left
            in ``max_model_len``).
        pool: the settings of the pool that serves it (block size, hash seed, limits).
        slo: its latency objectives (the gateway's where it sets none).
        tenant: the caller (``None``: the gateway is open).
        num_resumed_tokens: of ``prompt``, the tokens already sent (a resumed try: 0 else).
    """

    request_id: str
    prompt: list[int]
    block_hashes: list[bytes]
    sampling: gateway_pb2.SamplingParams
    params: SamplingParams
    pool: WorkerConfig
    slo: ServiceLevel
    tenant: Tenant | None
    num_resumed_tokens: int = 0

    @property
    def cache_salt(self) -> str:
        """The tenant's prefix-cache salt (``""``: none): tenants never share cached KV."""
        return self.tenant.name if self.tenant else ""

    def resumed(self, sent: list[int]) -> CheckedRequest:
        """The request as a resumed try gives it to the workers, after ``sent`` tokens of its one
        sample: the prompt followed by them (counted as output: ``num_resumed_tokens``, for the
        penalties, bad words and structured output), ``max_tokens`` and ``min_tokens`` reduced
        by them (``params`` stays the client's)."""
        prompt = self.prompt + sent
        sampling = gateway_pb2.SamplingParams()
        sampling.CopyFrom(self.sampling)
        sampling.max_tokens = self.params.max_tokens - len(sent)
        sampling.min_tokens = max(0, self.params.min_tokens - len(sent))
        return dataclasses.replace(self, prompt=prompt, sampling=sampling, num_resumed_tokens=len(sent),
                                   block_hashes=_block_hashes(prompt, self.pool, self.tenant))


def _block_hashes(prompt: list[int], pool: WorkerConfig, tenant: Tenant | None) -> list[bytes]:
    return hash_blocks(prompt, pool.block_size, salted_seed(pool.hash_seed, tenant.name if tenant else ""))


class Intake:
    """Checks and tokenizes requests for one served model and pool.

    Args:
        model: the served model.
        view: the routing state (the pool's settings come from it).
        limits: the request caps (the workers check the same ones).
        max_request_bytes: serialized request size at most.
        max_prompt_bytes: UTF-8 bytes of prompt text at most, checked before tokenization.
        tokenizer_pool: where prompts are tokenized (bounded: RESOURCE_EXHAUSTED when full).
        slo: the latency objectives of a request that sets none (:mod:`gateway.placement`).
    """

    def __init__(self, model: ServedModel, view: ClusterView, limits: RequestLimits, max_request_bytes: int,
                 max_prompt_bytes: int, tokenizer_pool: TokenizerPool, slo: ServiceLevel = ServiceLevel()) -> None:
        self.model = model
        self.view = view
        self.limits = limits
        self.max_request_bytes = max_request_bytes
        self.max_prompt_bytes = max_prompt_bytes
        self.tokenizer_pool = tokenizer_pool
        self.default_slo = slo
        self.heap = HeapTrimmer()

    def pool(self) -> WorkerConfig:
        """The settings the pool agrees on.

        Raises:
            StatusError: ``UNAVAILABLE`` while no worker has registered.
        """
        pool = self.view.pool
        if pool is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "no worker has registered yet")
        return pool

    @staticmethod
    def request_id(request: gateway_pb2.GenerateRequest) -> str:
        """The request's id, checked before it is written in a log line (empty: a new one).

        Raises:
            StatusError: ``INVALID_ARGUMENT`` naming ``request_id``.
        """
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        check_request_id(request_id, REQUEST_ID_MAX_CHARS)
        return request_id

    async def tokenize(self, request: Request) -> tuple[str, list[int]]:
        """The request's input form and prompt token ids; sizes are checked before any
        tokenizer work, which runs on the bounded pool (token ids need none). A large request
        has the heap trimmed after it (:mod:`gateway.heap`).

        Raises:
            StatusError: ``INVALID_ARGUMENT`` naming the input; ``RESOURCE_EXHAUSTED`` when the
                tokenizer pool is full.
        """
        size = request.ByteSize()
        self.heap.request_arrived(size)
        _check_request_size(size, self.max_request_bytes)
        which = _check_input(request)
        _check_prompt_bytes(request, which, self.max_prompt_bytes)
        if which == "token_ids":
            return which, list(request.token_ids.ids)
        return which, await self.tokenizer_pool.run(_render_prompt, request, which, self.model.tokenizer)

    async def check_request(self, request: gateway_pb2.GenerateRequest, request_id: str,
                    tenant: Tenant | None) -> CheckedRequest:
        """``request`` (whose id :meth:`request_id` checked) as a :class:`CheckedRequest`.

        Raises:
            StatusError: ``INVALID_ARGUMENT`` naming the field; ``UNAVAILABLE`` while no worker
                has registered; ``RESOURCE_EXHAUSTED`` when the tokenizer pool is full.
        """
        slo = _check_service_level(request).or_defaults(self.default_slo)
        which, prompt = await self.tokenize(request)
        pool = self.pool()
        check_prompt_ids(_input_field(which), prompt, pool.max_model_len, pool.vocab_size)
        sampling = request.sampling
        if sampling.bad_words:
            sampling = await self.tokenizer_pool.run(with_bad_words_tokenized, sampling, self.model.tokenizer,
                                                     self.limits.max_bad_words)
        params = sampling_params_from_proto(sampling, len(prompt), pool, self.limits)
        if params.stop and self.model.tokenizer is None:
            raise StatusError.invalid_argument("sampling.stop", "this model has no tokenizer to match text")
        return CheckedRequest(request_id, prompt, _block_hashes(prompt, pool, tenant), sampling, params,
                              pool, slo, tenant)


def with_bad_words_tokenized(sampling: gateway_pb2.SamplingParams, tokenizer: Tokenizer | None,
                             max_bad_words: int) -> gateway_pb2.SamplingParams:
    """``sampling`` with its ``bad_words`` (text) turned into token sequences after its own
    ``bad_words_token_ids``, as vLLM turns them: each word (leading spaces stripped) encoded as
    it is, and with a space before it where that encodes to as many tokens, starting with
    another (the word in the middle of a text); no special tokens.

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``sampling.bad_words``: more than
            ``max_bad_words`` words or token sequences, a word with no tokens or more than
            :data:`engine.sampling_params.MAX_BAD_WORD_TOKENS`, a model without a tokenizer.
    """
    if tokenizer is None:
        raise StatusError.invalid_argument("sampling.bad_words", "this model has no tokenizer; send "
                                                                 "bad_words_token_ids")
    if len(sampling.bad_words) > max_bad_words:
        raise StatusError.invalid_argument("sampling.bad_words", f"at most {max_bad_words} words, "
                                                                 f"got {len(sampling.bad_words)}")
    words: list[list[int]] = []
    for i, word in enumerate(sampling.bad_words):
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not 0 < len(alone) <= MAX_BAD_WORD_TOKENS:
            raise StatusError.invalid_argument(f"sampling.bad_words[{i}]", f"is {len(alone)} tokens; it must be 1 "
                                                                           f"to {MAX_BAD_WORD_TOKENS}")
        words.append(alone)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            words.append(spaced)
    if len(sampling.bad_words_token_ids) + len(words) > max_bad_words:
        raise StatusError.invalid_argument("sampling.bad_words", f"at most {max_bad_words} token sequences with "
                                                                 f"bad_words_token_ids, got "
                                                                 f"{len(sampling.bad_words_token_ids) + len(words)}")
    tokenized = gateway_pb2.SamplingParams()
    tokenized.CopyFrom(sampling)
    del tokenized.bad_words[:]
    tokenized.bad_words_token_ids.extend(gateway_pb2.TokenIds(ids=ids) for ids in words)
    return tokenized


def _check_request_size(size: int, max_request_bytes: int) -> None:
    """Refuse a request of ``size`` serialized bytes when that is more than ``max_request_bytes``."""
    if size > max_request_bytes:
        raise StatusError.invalid_argument("request", f"is {size} bytes, more than the limit of {max_request_bytes}")


def _check_input(request: Request) -> str:
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


def _check_prompt_bytes(request: Request, which: str, max_prompt_bytes: int) -> None:
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


def _input_field(which: str) -> str:
    """The request field a prompt error names (``prompt``, ``chat`` or ``token_ids.ids``)."""
    return "token_ids.ids" if which == "token_ids" else which


def _render_prompt(request: Request, which: str, tokenizer: Tokenizer | None) -> list[int]:
    """The token ids of a text prompt (``which``: ``prompt`` or ``chat``), exactly as Generate
    sees them.

    ``prompt`` is encoded with the special tokens the model's post-processor adds (the offline
    ``LLM`` encodes text the same way); ``chat`` is rendered by the chat template with the
    generation prompt appended (``token_ids`` are used as they are, without this).

    Raises:
        StatusError: text for a model without a tokenizer, or a chat the template refuses.
    """
    if tokenizer is None:
        raise StatusError.invalid_argument(which, "this model has no tokenizer; send token_ids")
    if which == "prompt":
        return tokenizer.encode(request.prompt)
    messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    try:
        return tokenizer.apply_chat_template(messages)
    except ValueError as exc:  # no template, or the template refuses the conversation
        raise StatusError.invalid_argument("chat", str(exc)) from exc


def _check_service_level(request: gateway_pb2.GenerateRequest) -> ServiceLevel:
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
