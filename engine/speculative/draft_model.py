"""Draft-model drafting: vLLM's ``draft_model`` method (Leviathan et al., 2023; Chen et al., 2023).

A smaller model of the target's vocabulary drafts ``k`` tokens greedily, one forward per token,
over its own paged KV cache. That cache has the target's block count and is indexed by the
target's block tables: block ``b`` of it holds the draft's KV of the tokens whose target KV is in
block ``b``, so the draft needs no allocator of its own and the pool's accounting covers both
(a block's bytes are the target's plus the draft's: :func:`engine.runner.model_shard.build_shard`).

The draft's KV is caught up lazily. A sequence the draft has not seen (a new request, one whose
prompt KV came from a prefill worker or the prefix cache, a preempted one) has its tokens run
through the draft first, in chunks of the step's token budget. Afterwards each proposal runs the
tokens the target accepted since the last one: the draft's KV of the accepted drafts is already
written (their inputs were the same tokens), so mostly only the target's own token is new. A
block-table entry that changed (copy-on-write, a rewind and a new block) drops the draft's KV from
that block on. The draft's KV affects only which tokens are proposed, never the output: the
target verifies every draft (:mod:`engine.speculative.acceptance`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_pool import cdiv
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import ScheduledSequence, SchedulerOutput
from engine.core.sequence import Sequence
from engine.runner.model_runner import ModelRunner


# Tokens up to which a row is run as decode rows, one per token, rather than as a prefill chunk.
DECODE_ROWS = 33


class _DraftRow:
    """A sequence as a draft step runs it (what :class:`ScheduledSequence` and the input buffers
    read of a sequence): the target sequence's tokens and then the drafts so far, the target's
    block table, and how many of those tokens have the draft's KV."""

    __slots__ = ("token_ids", "block_table", "num_computed_tokens", "num_preemptions", "sample_row")

    def __init__(self, token_ids: list[int], block_table: list[int], num_computed: int) -> None:
        self.token_ids = token_ids
        self.block_table = block_table
        self.num_computed_tokens = num_computed
        self.num_preemptions = 0
        self.sample_row = -1  # every input token is on the host

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.token_ids)


@dataclass
class _DraftKV:
    """What a sequence's draft KV held after its last proposal: the tokens through
    ``num_tokens`` (the sequence's then) plus ``drafts``, in the blocks of ``block_table``."""

    num_tokens: int
    drafts: list[int]
    block_table: list[int]


class DraftModelProposer:
    """:class:`engine.speculative.Proposer` by a draft model.

    Args:
        runner: the draft model's runner, over its KV cache of the target's block count
            (:attr:`engine.runner.model_shard.ModelShard.draft`).
        kv_manager: the target's KV cache manager: a proposal reserves the slots its drafts'
            KV goes to (the ones the target's verification of them writes next), or drafts
            fewer tokens when the pool has no block for them.
    """

    def __init__(self, runner: ModelRunner, kv_manager: KVCacheManager) -> None:
        self.runner, self.kv = runner, kv_manager
        self.block_size = kv_manager.block_size
        self.max_num_tokens = runner.buffers.max_num_tokens
        self._kv: dict[Sequence, _DraftKV] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        rows, room = [], []
        for seq, k in zip(seqs, num_tokens):
            room.append(self._reserve(seq, k))  # (first: a copy-on-write changes the block table)
            rows.append(_DraftRow(list(seq.token_ids), seq.block_table, self._num_computed(seq)))
        drafts: list[list[int]] = [[] for _ in seqs]
        live = [i for i in range(len(seqs)) if room[i]]
        self._catch_up([rows[i] for i in live], [drafts[i] for i in live])
        for j in range(1, max((room[i] for i in live), default=0)):
            live = [i for i in live if room[i] > j]
            for i in live:
                rows[i].token_ids.append(drafts[i][-1])
            self._run([rows[i] for i in live], [1] * len(live), [drafts[i] for i in live])
        for seq, row in zip(seqs, rows):
            n = min(seq.num_tokens, row.num_computed_tokens)
            self._kv[seq] = _DraftKV(n, row.token_ids[n:row.num_computed_tokens], list(seq.block_table))
        return drafts

    def release(self, seq: Sequence, learn: bool = True) -> None:
        self._kv.pop(seq, None)

    def _num_computed(self, seq: Sequence) -> int:
        """How many of ``seq``'s leading tokens have valid draft KV, at most all but its last."""
        held = self._kv.get(seq)
        if held is None:
            return 0
        n = held.num_tokens
        tokens = seq.token_ids
        for draft in held.drafts:
            if n >= len(tokens) or tokens[n] != draft:
                break
            n += 1
        table = seq.block_table
        for i in range(min(cdiv(n, self.block_size), len(held.block_table))):
            if table[i] != held.block_table[i]:
                n = i * self.block_size
                break
        return min(n, len(tokens) - 1)

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Reserve slots for the KV of ``seq``'s last token and its first ``k - 1`` drafts (the
        draft writes them; the verification rewrites them with the target's); returns how many
        drafts fit (fewer than ``k`` when the pool is out of blocks)."""
        if self.kv.allocate_slots(seq, k):
            return k
        return max(0, min(k, len(seq.block_table) * self.block_size - seq.num_computed_tokens))

    def _catch_up(self, rows: list[_DraftRow], drafts: list[list[int]]) -> None:
        """Run each row's tokens from its draft KV's end through its last token, in chunks of
        the step's token budget; each row's first draft joins ``drafts``."""
        pending = list(range(len(rows)))
        while pending:
            budget, chunk = self.max_num_tokens, []
            for i in pending:
                n = min(len(rows[i].token_ids) - rows[i].num_computed_tokens, budget)
                if n <= 0:
                    break
                chunk.append((i, n))
                budget -= n
            chosen = [i for i, _ in chunk]
            self._run([rows[i] for i in chosen], [n for _, n in chunk], [drafts[i] for i in chosen])
            pending = [i for i in pending if rows[i].num_computed_tokens < len(rows[i].token_ids)]

    def _run(self, rows: list[_DraftRow], num_new: list[int], drafts: list[list[int]]) -> None:
        """One draft forward of ``num_new[i]`` tokens of each row; a row that reaches its last
        token appends the draft's argmax after it to its ``drafts``.

        A row of a few tokens that ends at its last token (the tokens accepted since the last
        proposal) is laid out as a verification is, one decode row per token (its first token,
        then the others as if drafts), so that a step of such rows and decodes runs as decode
        rows (:attr:`SchedulerOutput.verifies_as_decodes`), in the draft's decode CUDA graphs.
        """
        scheduled = []
        for row, n in zip(rows, num_new):
            start = row.num_computed_tokens
            if 1 < n <= DECODE_ROWS and start + n == len(row.token_ids):
                head = _DraftRow(row.token_ids[:start + 1], row.block_table, start)
                scheduled.append(ScheduledSequence(head, n, row.token_ids[start + 1:]))
            else:
                scheduled.append(ScheduledSequence(row, n))
        order = sorted(range(len(rows)), key=lambda i: (not (num_new[i] == 1 and scheduled[i].samples),
                                                        not scheduled[i].spec_token_ids))
        step = SchedulerOutput([scheduled[i] for i in order],
                               sum(num_new[i] == 1 and scheduled[i].samples for i in order))
        sampled = iter(self.runner.greedy(step).tolist())
        for i in order:
            rows[i].num_computed_tokens += num_new[i]
            for _ in range(scheduled[i].num_sampled):
                token = next(sampled)
            if scheduled[i].samples:
                drafts[i].append(token)
