"""The interface every proposer of speculative decoding implements."""

from __future__ import annotations

from typing import Protocol

from engine.core.sequence import Sequence


class Proposer(Protocol):
    """Drafts tokens that the target model then verifies (:mod:`engine.speculative`).

    A model-free proposer (n-gram, suffix) reads the sequences' tokens on the host; a draft
    model or an EAGLE-style head would run its own forward here, over the same sequences.
    """

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """Draft tokens to follow each sequence's ``token_ids``.

        Args:
            seqs: decoding sequences (every token but the last has its KV computed).
            num_tokens: per sequence, the most drafts it may take (>= 1).

        Returns:
            Per sequence, up to ``num_tokens[i]`` token ids (possibly none).
        """
        ...

    def release(self, seq: Sequence, learn: bool = True) -> None:
        """``seq`` was preempted or has ended (``seq.is_finished``: finished or aborted): drop
        what is held for it. A proposer that learns from past requests keeps an ended one's
        tokens when ``learn`` (the engine speculates at its batch size: above it, learning
        would cost the batch time for drafts nobody asks for)."""
        ...
