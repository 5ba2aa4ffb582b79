"""Prompt lookup (n-gram) drafting: vLLM's ``ngram`` method (Saxena's prompt lookup decoding).

The last ``n`` tokens of a sequence (prompt and output) are looked up in the tokens before
them, ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: at the first ``n`` that
matches, the draft is the tokens that followed its latest earlier occurrence. Strong where the
output copies its input (summaries, extraction, code edits, chats quoting earlier turns).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.core.sequence import Sequence


class NgramProposer:
    """:class:`engine.speculative.Proposer` by prompt lookup.

    Args:
        min_n, max_n: the shortest and longest n-gram matched (``1 <= min_n <= max_n``).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [propose_ngram(np.asarray(s.token_ids, dtype=np.int64), self.min_n, self.max_n, k)
                for s, k in zip(seqs, num_tokens)]

    def release(self, seq: Sequence, learn: bool = True) -> None:
        pass


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The ``k`` tokens (fewer at the end) that follow the latest earlier occurrence of the
    longest suffix of ``tokens`` of length in ``[min_n, max_n]`` that occurs earlier; ``[]``
    when none does.

    Args:
        tokens: ``[L]`` int64, the sequence's tokens.
    """
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start before the suffix itself: positions 0 .. L - n - 1.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
