"""What generation returns: vLLM-style ``RequestOutput`` and ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: which of the request's ``n`` samples.
        text: the generated text (cut before a matched stop string).
        token_ids: the generated token ids.
        finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"`` (``max_tokens``
            or ``max_model_len``), ``"abort"``, or ``None`` while unfinished.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: per generated token, ``{token_id: logprob}`` with the sampled token and the
            requested top-N alternatives (natural log, untempered model distribution).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state: its prompt and its samples so far.

    Attributes:
        request_id: the request's id.
        prompt: the prompt text, when the request came as text.
        prompt_token_ids: the tokenized prompt.
        num_cached_tokens: prompt tokens served from the prefix cache.
        outputs: one :class:`CompletionOutput` per sample, by index.
        finished: every sample has finished.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
