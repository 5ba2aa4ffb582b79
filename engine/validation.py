"""Checks of a request's prompt, shared by the engine, the workers and the gateway (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence


def check_prompt(prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """Refuse a prompt that is empty, leaves no room for one generated token, or has ids outside
    the vocabulary.

    Args:
        prompt_token_ids: the prompt's token ids.
        max_model_len: tokens per sequence at most (prompt + generated).
        vocab_size: every id must be in ``[0, vocab_size)``.

    Raises:
        ValueError: the message starts with ``prompt`` and says what is wrong.
    """
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"prompt is {len(prompt_token_ids)} tokens; max_model_len is {max_model_len}, so at "
                         f"most {max_model_len - 1} prompt tokens fit")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is not in [0, vocab_size={vocab_size})")
