"""Iteration-level scheduling: continuous batching with chunked prefill and preemption.

Each step the scheduler hands out a token budget (``max_num_batched_tokens``): first to the
running sequences (one token for each decoding sequence, the next chunk for each sequence
still in prefill), then to waiting sequences in arrival order (FCFS) while ``max_num_seqs``
allows. When the block pool runs dry, the newest running sequence is preempted: its blocks are
freed and it is recomputed later from its tokens (Orca; vLLM v1's recompute policy: see
docs/references.md).

A step is scheduled before the one ahead of it has completed (async scheduling): a sequence's
``num_computed_tokens`` moves when it is scheduled, and a token the step samples is counted as an
output placeholder until the engine appends it. A sequence whose in-flight tokens already reach
``max_tokens`` or ``max_model_len`` is not scheduled again, and a waiting (preempted) sequence
is admitted only once its placeholders have landed, since its recompute needs every token on the
host. The blocks of a sequence that ends while a step that writes them is still in flight are
freed when that step completes (:meth:`Scheduler.complete`).

Speculative decoding: a decoding sequence given drafts is scheduled with its last token and the
drafts, ``1 + k`` tokens of the budget (a verification); the engine rewinds its
``num_computed_tokens`` to the accepted ones once the step has run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: ``num_new_tokens`` tokens from position ``start``.

    ``start`` is the sequence's ``num_computed_tokens`` when it was scheduled (the scheduler then
    moves it on by ``num_new_tokens``). ``samples`` is true when the step computes the sequence's
    last token, so its logits are sampled into a new token. ``forks`` are the request's other
    samples (``n > 1``) that sample from the same logits, when the step completes the prompt;
    they join the running batch once it has run. ``spec_token_ids``: a decoding sequence's
    drafts (speculative decoding), the step's last ``len(spec_token_ids)`` tokens, after the
    sequence's last token; the step samples after each of its ``1 + len(spec_token_ids)`` tokens.
    """

    seq: Sequence
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    start: int = field(init=False)
    samples: bool = field(init=False)
    forks: list[Sequence] = field(init=False, default_factory=list)
    _preemptions: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        end = self.seq.num_tokens_with_placeholders + len(self.spec_token_ids)
        self.samples = self.start + self.num_new_tokens == end
        self._preemptions = self.seq.num_preemptions

    @property
    def num_sampled(self) -> int:
        """Tokens the step samples for the sequence itself (forks aside)."""
        return (1 + len(self.spec_token_ids)) if self.samples else 0

    @property
    def stale(self) -> bool:
        """The sequence ended or was preempted since it was scheduled: what the step computed for
        it is no longer its KV (its sampled token, drawn from correct KV, still counts)."""
        return self.seq.is_finished or self.seq.num_preemptions != self._preemptions

    @property
    def num_computed_after(self) -> int:
        """The sequence's computed tokens once the step has run."""
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """What to run this step: decode sequences (one token each) first, then prefill chunks.

    Attributes:
        scheduled: the batch in execution order.
        num_decodes: how many leading entries are single-token decodes.
        block_copies: ``(src, dst)`` block copies to perform before the forward (copy-on-write).
        step_id: the step's number (1, 2, ...), counted by the scheduler.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_decodes: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    step_id: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def verifies_as_decodes(self) -> bool:
        """Whether the step has verifications (speculative decoding) and besides them only
        decodes: it then runs as single-token decode rows, one per token of each verification
        (its sequence's last token, then each draft), which the decode kernel and the decode
        CUDA graphs run like any other decode."""
        sched, nd = self.scheduled, self.num_decodes
        return nd < len(sched) and all(s.spec_token_ids and s.samples and not s.forks for s in sched[nd:])


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
        self.last_step_id = 0  # the last step scheduled
        self.completed_step_id = 0  # every step up to this one has completed
        # Told of each sequence that is preempted or finishes (its status already FINISHED then):
        # what the sampler (engine.runner.logits_processors) and a proposer hold for it goes
        # with its blocks.
        self.on_release: Callable[[Sequence], None] | None = None

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

    def schedule(self, spec_token_ids: dict[Sequence, list[int]] | None = None) -> SchedulerOutput:
        """Build the next step.

        Args:
            spec_token_ids: drafts of decoding sequences (speculative decoding; steps scheduled
                synchronously): each such sequence is scheduled with its last token and as many
                of its drafts as the token budget, ``max_tokens`` and ``max_model_len`` leave room
                for, or with its last token alone when the pool has no blocks for them.

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
            if self._in_flight_tokens_finish(seq):
                i += 1
                continue
            num_new = min(seq.num_tokens_with_placeholders - seq.num_computed_tokens, budget)
            drafts = self._room_for_drafts(seq, spec_token_ids.get(seq, ()), budget) if spec_token_ids else []
            if drafts and self.kv.allocate_slots(seq, num_new + len(drafts)):
                scheduled.append(ScheduledSequence(seq, num_new + len(drafts), drafts))
                budget -= num_new + len(drafts)
                i += 1
                continue
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
            if seq.num_output_placeholders:
                break  # a recompute needs every token on the host: next step
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
        if scheduled:
            self.last_step_id += 1
            out.step_id = self.last_step_id
            for s in scheduled:
                s.seq.num_computed_tokens = s.num_computed_after
                s.seq.scheduled_step = out.step_id
                if s.samples:
                    s.forks, s.seq.forks = s.seq.forks, []
                    for seq in (s.seq, *s.forks):
                        seq.num_output_placeholders += 1
        return out

    def _room_for_drafts(self, seq: Sequence, drafts: list[int], budget: int) -> list[int]:
        """The leading ``drafts`` a decoding ``seq`` can verify in a step with ``budget`` tokens left."""
        return list(drafts[:self.draft_room(seq, budget)])

    def draft_room(self, seq: Sequence, budget: int | None = None) -> int:
        """How many drafts a decoding ``seq`` can verify in a step with ``budget`` tokens left
        (default: a whole step's): every one may be accepted, and the token sampled after them
        too, so they stop short of ``max_tokens`` and their KV within ``max_model_len``."""
        budget = self.max_num_batched_tokens if budget is None else budget
        room = min(budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens)
        return max(room, 0)

    def _in_flight_tokens_finish(self, seq: Sequence) -> bool:
        """Whether the tokens ``seq`` has in flight already end it by length (``max_tokens`` or
        ``max_model_len``), so that another step for it would be wasted."""
        if not seq.num_output_placeholders:
            return False
        total = seq.num_tokens_with_placeholders
        return total - seq.num_prompt_tokens >= seq.params.max_tokens or total >= self.max_model_len

    def complete(self, step: SchedulerOutput) -> None:
        """``step`` has run: each parent that computed its prompt in it shares the blocks of its
        computed tokens with its fork children, which join the running batch, and the blocks of
        sequences that ended while the step was in flight go back to the pool."""
        for s in step.scheduled:
            for child in s.forks:
                if not child.is_finished:
                    self.kv.fork(s.seq, child, s.num_computed_after)
                    child.status = SequenceStatus.RUNNING
                    self.running.append(child)
        self.completed_step_id = max(self.completed_step_id, step.step_id)
        self.kv.release_deferred(self.completed_step_id)

    def _preempt(self, seq: Sequence) -> None:
        # Freed at once even if a step in flight writes its blocks: the next step, which may
        # reuse them, runs after it on the device, and no command runs before it completes.
        self.kv.free(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks (blocks pinned for a KV
        transfer keep their extra reference); while a step that writes them is in flight, they
        are freed when it completes, so that no other owner (a KV transfer) sees that write."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        in_flight = seq.scheduled_step > self.completed_step_id
        self.kv.free(seq, until_step=seq.scheduled_step if in_flight else None)
        seq.status = SequenceStatus.FINISHED
        if self.on_release is not None:
            self.on_release(seq)
