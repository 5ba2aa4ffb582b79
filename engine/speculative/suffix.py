"""Suffix drafting: vLLM's ``suffix`` method (Oliaro et al., 2024, "SuffixDecoding"), model-free.

Each running sequence has a suffix tree of its own tokens (prompt and output), and one tree is
shared by the outputs of recently finished requests (the paper's global tree); both are tries of every substring up to
``max_depth`` tokens, each node counting the occurrences of its path. To draft, the longest
suffix of the sequence (up to ``max_depth - 1`` tokens) that occurs earlier with a continuation
is found in each tree, the longer match wins (the sequence's own on a tie), and the draft
follows the most frequent child from there while its frequency among the node's occurrences
stays at least ``min_token_prob``. Agent loops, code edits and templated answers repeat across
requests, which the shared tree catches and prompt lookup does not.
"""

from __future__ import annotations

from collections import deque

from engine.core.sequence import Sequence


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Occurrence counts of every substring of up to ``max_depth`` tokens of the streams added.

    Args:
        max_depth: the longest substring counted.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def add(self, tokens: list[int], sign: int = 1, active: list[_Node] | None = None) -> list[_Node]:
        """Count (``sign`` 1) or uncount (-1: a stream added before) every substring of
        ``tokens``; O(len(tokens) * max_depth).

        Args:
            active: to continue a stream added before, what the call that added its tokens so
                far returned (``None``: a new stream).

        Returns:
            The nodes of the stream's suffixes (``[i]``: the suffix of ``i`` tokens; the root
            first), for the call that adds the tokens that follow.
        """
        active = active or [self.root]
        for token in tokens:
            grown = [self.root]
            for node in active[:self.max_depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += sign
                if child.count == 0:
                    del node.children[token]  # uncounted: its subtree is all zeros too
                grown.append(child)
            self.root.count += sign
            active = grown
        return active

    def match(self, tokens: list[int]) -> tuple[int, _Node | None]:
        """The longest suffix of ``tokens`` (shorter than ``max_depth``) whose node has a
        child: ``(its length, its node)``, ``(0, None)`` when none."""
        for m in range(min(self.max_depth - 1, len(tokens)), 0, -1):
            node = self.root
            for token in tokens[len(tokens) - m:]:
                node = node.children.get(token)
                if node is None:
                    break
            else:
                if node.children:
                    return m, node
        return 0, None


def draft_from(node: _Node, k: int, min_token_prob: float) -> list[int]:
    """Up to ``k`` tokens following the most frequent child from ``node`` while that child's
    share of its parent's occurrences is at least ``min_token_prob``."""
    draft = []
    while len(draft) < k and node.children:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        if child.count < min_token_prob * node.count:
            break
        draft.append(token)
        node = child
    return draft


class SuffixProposer:
    """:class:`engine.speculative.Proposer` by suffix trees.

    Args:
        max_depth: the trees' depth (the longest suffix matched is one shorter).
        max_cached_requests: finished requests whose tokens stay in the shared tree (oldest out).
        min_token_prob: a draft stops at a token rarer than this after its path.
    """

    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float) -> None:
        self.max_depth, self.min_token_prob = max_depth, min_token_prob
        self.max_cached_requests = max_cached_requests
        self.shared = SuffixTrie(max_depth)
        self._recent: deque[list[int]] = deque()
        # Each sequence's tree, the tokens added to it and the nodes of its suffixes.
        self._own: dict[Sequence, tuple[SuffixTrie, int, list[_Node]]] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, num_tokens):
            tokens = seq.token_ids
            own, added, active = self._own.get(seq) or (SuffixTrie(self.max_depth), 0, None)
            if added < len(tokens):
                self._own[seq] = (own, len(tokens), own.add(tokens[added:], active=active))
            own_len, own_node = own.match(tokens)
            shared_len, shared_node = self.shared.match(tokens) if self._recent else (0, None)
            node = own_node if own_len >= shared_len else shared_node
            drafts.append(draft_from(node, k, self.min_token_prob) if node is not None else [])
        return drafts

    def release(self, seq: Sequence, learn: bool = True) -> None:
        """A preempted sequence keeps its tree (its tokens stay); an ended one's output joins the
        shared tree when ``learn``, the oldest request's leaving it past ``max_cached_requests``
        (O(output tokens * max_depth) each)."""
        if not seq.is_finished:
            return
        self._own.pop(seq, None)
        if not (learn and self.max_cached_requests):
            return
        tokens = list(seq.output_token_ids)
        self.shared.add(tokens)
        self._recent.append(tokens)
        if len(self._recent) > self.max_cached_requests:
            self.shared.add(self._recent.popleft(), -1)
