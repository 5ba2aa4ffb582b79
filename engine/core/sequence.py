"""A sequence: one stream of tokens that owns its block table and its count of computed tokens."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of one request.

    ``token_ids`` holds the prompt followed by the generated tokens. The scheduler only moves
    ``num_computed_tokens`` (tokens whose K/V are in the cache) towards ``len(token_ids)``, so
    prefill, chunked prefill, prefix-cache hits, decode and recompute after preemption are one
    code path (vLLM v1's model). When ``num_computed_tokens`` reaches ``len(token_ids)`` at the end
    of a step, the step's logits for this sequence are sampled into a new token.

    Attributes:
        request_id: the owning request.
        index: which of the request's ``n`` samples this is.
        num_prompt_tokens: length of the prompt at the start of ``token_ids``.
        block_table: physical block ids, in order; block ``i`` holds tokens
            ``[i * block_size, (i + 1) * block_size)``.
        block_hashes: chained hashes of the full blocks of ``token_ids`` computed so far.
        num_cached_tokens: prompt tokens found in the prefix cache at first admission.
        forks: the request's other samples (n > 1), forked from this one once its prompt is
            computed; they share its blocks from then on.
        arrival: admission order, used for FCFS and to pick the newest for preemption.
        cache_salt: the tenant's salt of the chained block hashes (``engine.block_hash.salted_seed``;
            ``""``: none): sequences of different salts never share a cached block.
    """

    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = -1
    forks: list["Sequence"] = field(default_factory=list)
    cache_salt: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def key(self) -> tuple[str, int]:
        """(request_id, index): unique per sequence."""
        return (self.request_id, self.index)
