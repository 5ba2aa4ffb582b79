"""The text a request streams back: each sample's tokens detokenized, stop strings applied, the
usage of the whole request counted.

The workers end a sample on its tokens (EOS, stop token ids, ``max_tokens``,
``max_model_len``); the gateway owns the text (vLLM's front-end / core split): it detokenizes
incrementally (:class:`engine.detokenizer.IncrementalDetokenizer`) and ends a sample whose text
contains a stop string, cutting the text before it. Every API streams these
``GenerateResponse`` messages back (tandem.v1 as they are, KServe and OpenAI translated).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from protos.tandem.v1 import gateway_pb2

STOP, LENGTH, ABORT = gateway_pb2.FINISH_REASON_STOP, gateway_pb2.FINISH_REASON_LENGTH, gateway_pb2.FINISH_REASON_ABORT


class Sample:
    """Output state of one sample (index ``i`` of ``n``).

    Attributes:
        detok: its detokenizer (``None`` for a model without a tokenizer: tokens only).
        token_ids: the tokens sent to the client.
        finish: its ``FinishReason``; 0 while it streams.
    """

    def __init__(self, detok: IncrementalDetokenizer | None) -> None:
        self.detok = detok
        self.token_ids: list[int] = []
        self.finish = 0

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish != 0


class RequestOutput:
    """What the client of one request has been sent: each sample's state and the usage.

    Args:
        request_id: echoed in every message.
        tokenizer: the model's tokenizer (``None``: no text, only tokens).
        prompt: the prompt's token ids (the first output token decodes in their context).
        stop: stop strings.
        n: samples.
        max_tokens: output tokens a sample may reach (``max_tokens``, within ``max_model_len``).

    Attributes:
        samples: one :class:`Sample` per index.
        usage: the request's token counts (``cached_prompt_tokens`` set by whoever learns it).
    """

    def __init__(self, request_id: str, tokenizer: Tokenizer | None, prompt: list[int], stop: list[str], n: int,
                 max_tokens: int) -> None:
        backend = tokenizer.backend if tokenizer is not None else None
        self.request_id = request_id
        self.samples = [Sample(IncrementalDetokenizer(backend, prompt, stop) if backend else None) for _ in range(n)]
        self.usage = gateway_pb2.Usage(prompt_tokens=len(prompt))
        self.max_tokens = max_tokens

    @property
    def done(self) -> bool:
        """Every sample has finished."""
        return all(s.done for s in self.samples)

    def most_tokens(self) -> int:
        """Tokens of the sample that has the most."""
        return max(s.tokens for s in self.samples)

    def piece(self, index: int, tokens: Sequence[int], logprobs: Sequence[gateway_pb2.TokenLogprobs],
              finish: int) -> gateway_pb2.GenerateResponse:
        """Feed ``tokens`` (with their ``logprobs``, one each) to sample ``index``, which the
        worker ended with ``finish`` (0: it goes on); the message for the client: the tokens up
        to a stop string, their text, the finish reason (STOP at a stop string) and, on the
        stream's last message, ``usage``."""
        sample = self.samples[index]
        kept = []
        for token in tokens:
            kept.append(token)
            if sample.detok is not None and sample.detok.push(token) is not None:
                finish = STOP
                break
        sample.token_ids += kept
        sample.finish = finish
        self.usage.completion_tokens += len(kept)
        text = sample.detok.take_new_text(bool(finish)) if sample.detok is not None else ""
        response = gateway_pb2.GenerateResponse(request_id=self.request_id, index=index, token_ids=kept, text=text,
                                                finish_reason=finish, logprobs=list(logprobs)[: len(kept)])
        if self.done:
            response.usage.CopyFrom(self.usage)
        return response
