"""The offline front end's half of the engine: text and stop strings (vLLM's ``OutputProcessor``).

The engine core finishes samples on tokens only; this turns its outputs into text with one
:class:`engine.detokenizer.IncrementalDetokenizer` per sample and ends a sample through
``EngineCore.stop_sample`` as soon as its text contains a stop string, before the next step
runs, so no token is generated past it. The gateway plays the same role when serving.
"""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.core.engine_core import EngineCore
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class OutputProcessor:
    """Detokenizes the outputs of requests added through it and applies their stop strings.

    Args:
        engine: the engine whose outputs are processed; its ``tokenizer`` decodes (a model
            without one yields outputs with empty text, and stop strings are refused).
    """

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self._samples: dict[str, list[IncrementalDetokenizer]] = {}
        self._seen: dict[str, list[int]] = {}

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request (text or token ids) in the engine and start following its text.

        Raises:
            ValueError: stop strings for a model without a tokenizer, or the engine's refusal.
        """
        tokenizer = self.engine.tokenizer
        if params.stop and tokenizer is None:
            raise ValueError("stop: this model has no tokenizer, so stop strings cannot match")
        prompt_token_ids = self.engine.add_request(request_id, prompt, params)
        if tokenizer is not None:
            self._samples[request_id] = [IncrementalDetokenizer(tokenizer.backend, prompt_token_ids, params.stop)
                                         for _ in range(params.n)]
        self._seen[request_id] = [0] * params.n

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Append each sample's new text (holding back a possible stop string's start until it
        is decided) and stop the samples whose text now contains a stop string.

        Returns:
            ``outputs``, with ``text`` (and for stopped samples ``finish_reason``/``stop_reason``)
            up to date.
        """
        for out in outputs:
            detoks, seen = self._samples.get(out.request_id), self._seen.get(out.request_id)
            if seen is None:
                continue
            for sample in out.outputs:
                new_tokens = sample.token_ids[seen[sample.index]:]
                seen[sample.index] = len(sample.token_ids)
                if detoks is None:
                    continue
                detok = detoks[sample.index]
                for i, token_id in enumerate(new_tokens):
                    stop = detok.push(token_id)
                    if stop is not None:
                        if not sample.finished:
                            self.engine.stop_sample(out.request_id, sample.index, stop)
                        sample.finish_reason, sample.stop_reason = "stop", stop
                        # A step that yields several tokens (speculative decoding) may run past it.
                        kept = seen[sample.index] - len(new_tokens) + i + 1
                        del sample.token_ids[kept:], sample.logprobs[kept:]
                        seen[sample.index] = kept
                        break
                sample.text += detok.take_new_text(finished=sample.finished)
            out.finished = all(s.finished for s in out.outputs)
            if out.finished:
                self.forget(out.request_id)
        return outputs

    def forget(self, request_id: str) -> None:
        """Stop following a request (finished or aborted)."""
        self._samples.pop(request_id, None)
        self._seen.pop(request_id, None)
