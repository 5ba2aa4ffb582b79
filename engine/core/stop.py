"""When a sample is finished, from its tokens alone (vLLM v1's ``check_stop``): the engine
core's rule, which the prefill worker applies to the first token it returns."""

from __future__ import annotations

from collections.abc import Collection

from engine.sampling_params import SamplingParams


def check_stop(params: SamplingParams, token_id: int, num_output_tokens: int, num_tokens: int,
               eos_token_ids: Collection[int], max_model_len: int) -> str | None:
    """Whether a sample that just produced ``token_id`` is finished.

    Args:
        params: the request's sampling parameters.
        token_id: the newest token.
        num_output_tokens: generated tokens so far, ``token_id`` included.
        num_tokens: prompt plus generated tokens.
        eos_token_ids: the model's end-of-sequence tokens.
        max_model_len: tokens per sequence at most.

    Returns:
        ``"stop"`` (a stop token id, or EOS unless ``ignore_eos``), ``"length"``
        (``max_tokens`` or ``max_model_len`` reached), or ``None``.
    """
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None
