"""Which drafts a verify step keeps.

The target samples every position of a verified run with the same sampler as any step
(:mod:`engine.runner.sampler`): the argmax for greedy rows, for random rows the Gumbel-max race
whose noise is hashed from the request's seed, the sample's index and the position. A draft is
accepted while it equals the token the target sampled at its position, and the token the target
sampled after the last accepted draft (the correction, or the bonus token when all are
accepted) is kept too.

This is exact. Greedy: the output is the target's argmax at each position, as without
speculation. Random: a position's sampled token depends only on the logits, which equal the
non-speculative ones while every earlier draft was accepted, and on that position's noise, so a
seeded request's output is token for token the one it gets without speculation. For a
model-free proposer the draft distribution ``q`` is one-hot on the draft ``d``, and the rule is
the rejection sampling of Leviathan et al. (2023) / Chen et al. (2023) with the noise coupled:
the draft is accepted with probability ``p(d) = min(1, p(d) / q(d))``, and on rejection the
token comes from ``p`` conditioned on not being ``d``, which is ``max(p - q, 0)`` normalized; the
target distribution is kept exactly.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts equal the target's sampled tokens at their positions.

    Args:
        drafts: the ``k`` draft tokens.
        sampled: ``k + 1`` tokens the target sampled: after the sequence's last token, then after
            each draft.

    Returns:
        ``a`` in ``[0, k]``; the sequence gains ``sampled[:a + 1]``.
    """
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a
