"""Incremental detokenization with stop strings, correct across multi-byte characters.

Text is produced by ``tokenizers``' ``DecodeStream``, which buffers tokens until they form
valid UTF-8 (a byte-fallback emoji split over several tokens comes out whole, once).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns one sample's new tokens into text, and watches for stop strings.

    While generation runs, the last ``len(longest stop) - 1`` characters are held back from
    :meth:`take_new_text`, so a streaming client never sees the start of a stop string.

    Args:
        tokenizer: the ``tokenizers.Tokenizer`` (a fast HF tokenizer's ``backend_tokenizer``).
        prompt_token_ids: the prompt, so the first generated token decodes in context.
        stop: stop strings; generation ends at the first match and the text is cut before it.
        skip_special_tokens: drop special tokens (e.g. ``<|im_end|>``) from the text.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=prompt_token_ids[-8:], skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.text = ""
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._emitted = 0

    def push(self, token_id: int) -> str | None:
        """Add one generated token to :attr:`text`.

        Returns:
            The stop string this token completed (the text is then cut before it), or ``None``.
        """
        piece = self.stream.step(self.tokenizer, token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        matches = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) != -1]
        if not matches:
            return None
        at, stop = min(matches)
        self.text = self.text[:at]
        return stop

    def take_new_text(self, finished: bool) -> str:
        """Return the text not returned before (all of it once ``finished``)."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        new_text = self.text[self._emitted : end]
        self._emitted = end
        return new_text
