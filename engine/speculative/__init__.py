"""Speculative decoding: proposers draft tokens, the target verifies them in one forward.

A proposer (:class:`Proposer`) drafts up to ``k`` tokens for each decoding sequence before a
step is scheduled. The scheduler gives such a sequence a query of ``1 + len(drafts)`` tokens (its
last token, then the drafts) over its paged KV, counted in the step's token budget (a step of
decodes and verifications runs them as decode rows, one per token, in the decode CUDA graphs); the sampler samples every one of those positions
(:mod:`engine.runner.sampler`), and :func:`engine.speculative.acceptance.num_accepted` keeps the
longest run of drafts equal to what the target sampled, plus the target's token after it. The
KV written for rejected drafts is dropped (``KVCacheManager.rewind``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import SpeculativeConfig
from engine.speculative.proposer import Proposer

if TYPE_CHECKING:
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.runner.model_runner import ModelRunner


def build_proposer(config: SpeculativeConfig, draft: ModelRunner | None = None,
                   kv_manager: KVCacheManager | None = None) -> Proposer:
    """The proposer ``config.method`` names; ``draft_model`` runs ``draft`` (the draft model's
    runner: :attr:`engine.runner.model_shard.ModelShard.draft`) and reserves its drafts' slots
    through ``kv_manager`` (the target's)."""
    if config.method == "ngram":
        from engine.speculative.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        from engine.speculative.draft_model import DraftModelProposer
        return DraftModelProposer(draft, kv_manager)
    from engine.speculative.suffix import SuffixProposer
    return SuffixProposer(config.suffix_max_depth, config.suffix_max_cached_requests, config.suffix_min_token_prob)


__all__ = ["Proposer", "build_proposer"]
