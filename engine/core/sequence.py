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

    ``token_ids`` holds the prompt followed by the generated tokens that have reached the host.
    The scheduler only moves ``num_computed_tokens`` (tokens whose K/V are, or are being, written
    to the cache) towards :attr:`num_tokens_with_placeholders`, so prefill, chunked prefill,
    prefix-cache hits, decode and recompute after preemption are one code path (vLLM v1's model).
    A step that computes a sequence's last token samples a new one from its logits. Under async
    scheduling the next step is scheduled before that token reaches the host: it counts as an
    output placeholder until it does, and the next step reads it on the device.

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
        num_output_placeholders: tokens sampled by launched steps that have not reached the
            host yet (at most two: the one being sampled and the one the next step reads).
        scheduled_step: the id of the last step that computes a token of this sequence
            (``Scheduler``'s count); its blocks are written until that step completes.
        sample_row: the sequence's row among the sampled tokens of the last step it sampled in
            (where the next step finds its input token on the device).
        num_preemptions: times the sequence was preempted (its KV freed, to be recomputed).
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
    num_output_placeholders: int = 0
    scheduled_step: int = -1
    sample_row: int = -1
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens including those sampled but not yet on the host."""
        return len(self.token_ids) + self.num_output_placeholders

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
