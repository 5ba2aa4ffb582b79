"""Speculative decoding: proposers draft tokens, the target verifies them in one forward.

A proposer (:class:`Proposer`) drafts up to ``k`` tokens for each decoding sequence before a
step is scheduled. The scheduler gives such a sequence a query of ``1 + len(drafts)`` tokens (its
last token, then the drafts) over its paged KV, counted in the step's token budget (a step of
decodes and verifications runs them as decode rows, one per token, in the decode CUDA graphs); the sampler samples every one of those positions
(:mod:`engine.runner.sampler`), and :func:`engine.speculative.acceptance.num_accepted` keeps the
longest run of drafts equal to what the target sampled, plus the target's token after it. The
KV written for rejected drafts is dropped (``KVCacheManager.rewind``).
"""

from engine.config import SpeculativeConfig
from engine.speculative.proposer import Proposer


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer ``config.method`` names."""
    if config.method == "ngram":
        from engine.speculative.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from engine.speculative.suffix import SuffixProposer
    return SuffixProposer(config.suffix_max_depth, config.suffix_max_cached_requests, config.suffix_min_token_prob)


__all__ = ["Proposer", "build_proposer"]
