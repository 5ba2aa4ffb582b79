"""Iteration-level scheduling: continuous batching with chunked prefill and preemption.

Each step the scheduler hands out a token budget (``max_num_batched_tokens``): first to the
running sequences (one token for each decoding sequence, the next chunk for each sequence
still in prefill), then to waiting sequences in arrival order (FCFS) while ``max_num_seqs``
allows. When the block pool runs dry, the newest running sequence is preempted: its blocks are
freed and it is recomputed later from its tokens (Orca; vLLM v1's recompute policy: see
docs/references.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: ``num_new_tokens`` tokens from ``num_computed_tokens``.

    ``samples`` is true when the step computes the sequence's last token, so its logits are
    sampled into a new token.
    """

    seq: Sequence
    num_new_tokens: int
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """What to run this step: decode sequences (one token each) first, then prefill chunks.

    Attributes:
        scheduled: the batch in execution order.
        num_decodes: how many leading entries are single-token decodes.
        block_copies: ``(src, dst)`` block copies to perform before the forward (copy-on-write).
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_decodes: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and the running batch; the only code that decides who runs.

    Args:
        kv_manager: maps sequences onto blocks.
        max_num_seqs: sequences in the running batch at most.
        max_num_batched_tokens: tokens per step at most (decode tokens plus prefill chunks).
        max_model_len: tokens per sequence at most.
    """

    def __init__(
        self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose blocks are already filled (a KV transfer) to the running batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Build the next step.

        Returns:
            The step to run; empty when nothing can run (e.g. every waiting sequence needs more
            blocks than exist, which admission prevents).
        """
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []

        running = sorted(self.running, key=lambda s: s.arrival)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = running.pop()  # the newest sequence gives way
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                i += 1
        self.running = running

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_blocks(seq) if not seq.block_table else []
            num_new = min(
                seq.num_tokens - seq.num_computed_tokens - len(cached) * self.kv.block_size, budget
            )
            if not self.kv.allocate_slots(seq, num_new, cached):
                break
            self.waiting.popleft()
            if seq.num_cached_tokens < 0:
                self.kv.record_prefix_lookup(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

        decodes = [s for s in scheduled if s.num_new_tokens == 1 and s.samples]
        prefills = [s for s in scheduled if not (s.num_new_tokens == 1 and s.samples)]
        out.scheduled = decodes + prefills
        out.num_decodes = len(decodes)
        out.block_copies, self.kv.pending_copies = self.kv.pending_copies, []
        return out

    def complete_forks(self, step: SchedulerOutput) -> None:
        """After ``step`` ran: each parent that computed its prompt shares its blocks with its
        fork children, which join the running batch."""
        for s in step.scheduled:
            if s.samples and s.seq.forks:
                for child in s.seq.forks:
                    self.kv.fork(s.seq, child)
                    child.status = SequenceStatus.RUNNING
                    self.running.append(child)
                s.seq.forks = []

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks (blocks pinned for a KV
        transfer keep their extra reference)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
