"""What changes the logits before a token is sampled: structured output, bad words,
``min_tokens``, ``logit_bias`` and the repetition, frequency and presence penalties
(:class:`engine.sampling_params.SamplingParams` says what each does, and in which order).

:class:`LogitsProcessors` owns every sequence's state for them, and nothing else does: a
penalty slot on the device (:class:`engine.runner.penalties.PenaltyRows`) and a grammar
matcher (:mod:`engine.runner.grammar`). A sequence's state is made when it joins the sampling
batch (the first step that samples it after it was added or preempted), from the tokens on the
host, and dropped when it ends or is preempted (:meth:`LogitsProcessors.release`, called by the
scheduler), so a preempted sequence rebuilds its state from its tokens when it runs again: the
same path as a decode worker continuing a request another worker prefilled, or a stream
resumed elsewhere after the tokens already sent.

Per step, everything is batched on the device with per-row parameters, gathered once per batch
composition into a :class:`LogitsBatch` (index tensors; the model runner rebuilds it only when
the sampled sequences change): the structured rows' token bitmask, one accumulating
``index_put_`` for bias and bans, one gather-compute-scatter for the penalties. A batch without
any of it has no ``LogitsBatch`` and costs nothing.

A grammar matcher is brought up to date with the host's tokens when its row's bitmask is
filled: it accepts the output tokens that reached the host since (at join: all of them, which
replays the output into a fresh matcher). Under async scheduling a step's tokens reach the host
only after the next step was launched, so while any sequence holds a matcher the engine
completes the step in flight before it schedules the next (``EngineCore.step``): those steps
lose the overlap, no other step does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.sequence import Sequence
from engine.runner.devices import upload
from engine.runner.grammar import Grammars
from engine.runner.penalties import ANY_TOKEN, TAIL_TOKENS, PenaltyRows, apply_penalties, bad_word_matches

logger = logging.getLogger(__name__)


@dataclass
class _SequenceState:
    output_start: int  # where the output begins in token_ids (resumed tokens count as output)
    slot: int | None  # the penalty slot (penalties or a bad word of 2+ tokens)
    matcher: object | None  # xgrammar.GrammarMatcher of the structured output
    num_accepted: int = 0  # output tokens the matcher has been given


@dataclass
class LogitsBatch:
    """One batch composition's logit processing, as index tensors on the logits' device.

    Attributes:
        penalties: the slots the indices below point into.
        rows: ``[r]`` int64, the rows with any processing, ascending.
        bans_rows, bans_tokens: ``[a]`` int64, the (row, token) pairs a step adds a value to:
            first the static ones (``logit_bias``, one-token bad words), then one per
            (row, bad word of 2+ tokens), then one per (row, stop token) of ``min_tokens``.
        static_values: ``[s]`` float32, the static pairs' values (bias, ``-inf``).
        word_slots, word_prefixes: ``[p]`` int64 and ``[p, TAIL_TOKENS]`` int64, each (row,
            bad word)'s penalty slot and right-aligned prefix.
        min_output_starts, min_tokens: ``[m]`` int64, each ``min_tokens`` pair's first output
            position and its ``min_tokens``.
        penalty_rows, penalty_slots: ``[k]`` int64, the penalized rows and their slots.
        repetition, frequency, presence: ``[k]`` float32.
        record_rows, record_slots: ``[q]`` int64, the rows whose sampled token goes into their
            slot (every row with one).
        structured: ``(row, sequence, state)`` of each structured row, in row order.
        structured_rows, structured_in_rows: ``[c]`` int64, their rows, and where they are in ``rows``.
        structured_banned: whether a structured row also has bans (which may leave it no token).
        changes_values: whether a row has a bias or a penalty (they move the logits of tokens
            that stay allowed; a mask or a ban only takes tokens away).
        all_rows: whether ``rows`` is every row of the batch.
    """

    penalties: PenaltyRows
    rows: torch.Tensor
    bans_rows: torch.Tensor
    bans_tokens: torch.Tensor
    static_values: torch.Tensor
    word_slots: torch.Tensor
    word_prefixes: torch.Tensor
    min_output_starts: torch.Tensor
    min_tokens: torch.Tensor
    penalty_rows: torch.Tensor
    penalty_slots: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    record_rows: torch.Tensor
    record_slots: torch.Tensor
    structured: list[tuple[int, Sequence, _SequenceState]]
    structured_rows: torch.Tensor
    structured_in_rows: torch.Tensor
    structured_banned: bool
    changes_values: bool
    all_rows: bool

    def apply(self, logits: torch.Tensor, positions: torch.Tensor, bitmask: torch.Tensor | None,
              keep_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Process ``logits`` in place; returns, for the model's log-probabilities, the processed
        rows' log-sum-exp as they came (``[r]``) and, where the caller asks (``keep_rows``: its
        top-N log-probabilities) or the processing needs it (a bias or penalty moves the sampled
        token's logit; a structured row with bans may fall back to its bitmask alone), the rows
        as they came (``[r, vocab]``; else ``None``: the sampled token's logit is unchanged).

        Args:
            logits: ``[n, vocab]`` float32, one row per sampled sequence.
            positions: ``[n]`` int64, the position of the token each row samples.
            bitmask: ``[n', ceil(vocab / 32)]`` int32 on the device, row ``i`` the allowed tokens
                of row ``i`` where it is structured (:meth:`LogitsProcessors.fill_bitmask`), or
                ``None`` without any.
            keep_rows: return the rows as they came.
        """
        before = logits if self.all_rows else logits.index_select(0, self.rows)
        model_lse = torch.logsumexp(before, dim=-1)
        raw = None
        if keep_rows or self.changes_values or self.structured_banned:
            raw = before.clone() if self.all_rows else before
        if bitmask is not None:
            _mask(logits, bitmask, self.structured_rows)
        if self.bans_rows.numel():
            values = [self.static_values]
            if self.word_slots.numel():
                banned = bad_word_matches(self.penalties.tails.index_select(0, self.word_slots), self.word_prefixes)
                values.append(torch.where(banned, float("-inf"), 0.0))
            if self.min_tokens.numel():
                min_rows = self.bans_rows[-self.min_tokens.numel():]
                num_output = positions.index_select(0, min_rows) - self.min_output_starts
                values.append(torch.where(num_output < self.min_tokens, float("-inf"), 0.0))
            logits.index_put_((self.bans_rows, self.bans_tokens), torch.cat(values), accumulate=True)
        if self.penalty_rows.numel():
            rows = self.penalty_rows
            counts = self.penalties.counts.index_select(0, self.penalty_slots)
            in_prompt = self.penalties.in_prompt.index_select(0, self.penalty_slots)
            penalized = apply_penalties(logits.index_select(0, rows), counts, in_prompt, self.repetition,
                                        self.frequency, self.presence)
            logits.index_copy_(0, rows, penalized)
        if bitmask is not None and self.structured_banned:
            # A ban may take the grammar's last allowed tokens (min_tokens at a complete
            # structure): such a row samples under its bitmask alone.
            processed = logits.index_select(0, self.structured_rows)
            alone = raw.index_select(0, self.structured_in_rows)
            _mask(alone, bitmask.index_select(0, self.structured_rows))
            starved = processed.amax(dim=1, keepdim=True) == float("-inf")
            logits.index_copy_(0, self.structured_rows, torch.where(starved, alone, processed))
        return model_lse, raw


def _mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set to ``-inf`` the logits of the tokens ``bitmask`` disallows, in place, in the ``rows``
    of ``logits`` (``None``: all), row ``i`` by bitmask row ``i`` (xgrammar's kernel: Triton on
    CUDA, C++ on the CPU)."""
    import xgrammar

    if rows is not None and logits.device.type == "cpu":
        rows = rows.tolist()  # the C++ kernel takes a list
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


class LogitsProcessors:
    """Every sampled sequence's logit-processing state, and the batches built from it.

    Args:
        vocab_size: the logits' width.
        device: the logits' device.
        eos_token_ids: the model's end-of-sequence tokens (what ``min_tokens`` bans with the
            request's ``stop_token_ids``, unless it ignores EOS).
        grammars: compiles structured output and makes matchers.

    Attributes:
        version: counts releases; a batch built before the last one may hold a freed slot
            (the model runner rebuilds it).
    """

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: list[int], grammars: Grammars) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)
        self.grammars = grammars
        self.penalties = PenaltyRows(vocab_size, device)
        self.version = 0
        self._states: dict[Sequence, _SequenceState] = {}
        self._num_structured = 0
        self._stop_only = grammars.stop_only_bitmask()
        self._bitmask = torch.zeros(0, grammars.bitmask_words, dtype=torch.int32)

    @property
    def num_sequences(self) -> int:
        """Sequences holding state (joined, not yet ended or preempted)."""
        return len(self._states)

    @property
    def num_structured(self) -> int:
        """Those of them with a grammar matcher."""
        return self._num_structured

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s state (it ended or was preempted); nothing happens for one without."""
        state = self._states.pop(seq, None)
        if state is None:
            return
        if state.slot is not None:
            self.penalties.free(state.slot)
        self._num_structured -= state.matcher is not None
        self.version += 1

    def batch(self, seqs: list[Sequence]) -> LogitsBatch | None:
        """The processing of a step that samples ``seqs`` (row ``i`` samples ``seqs[i]``);
        ``None`` when none of them has any. A sequence without state joins here (one that
        ended while the step was in flight gets none: its token is dropped anyway).

        Raises:
            ValueError: a structured output xgrammar refuses (the engine checked it when the
                request was added, so only a grammar that no longer compiles).
        """
        if not any(s.params.processes_logits for s in seqs):
            return None
        rows: list[int] = []
        static: list[tuple[int, int, float]] = []  # (row, token, bias or -inf)
        words: list[tuple[int, int, int]] = []  # (row, last token, slot) of bad words of 2+ tokens
        prefixes: list[list[int]] = []
        mins: list[tuple[int, int, int, int]] = []  # (row, stop token, first output position, min_tokens)
        penalized: list[tuple[int, int, float, float, float]] = []  # (row, slot, repetition, frequency, presence)
        recorded: list[tuple[int, int]] = []  # (row, slot)
        structured: list[tuple[int, Sequence, _SequenceState]] = []
        structured_in_rows: list[int] = []
        structured_banned = changes_values = False
        for row, seq in enumerate(seqs):
            p = seq.params
            if not p.processes_logits or seq.is_finished:
                continue
            state = self._states.get(seq) or self._join(seq)
            rows.append(row)
            static += [(row, token, bias) for token, bias in p.logit_bias.items()]
            static += [(row, word[0], float("-inf")) for word in p.bad_words_token_ids if len(word) == 1]
            for word in (w for w in p.bad_words_token_ids if len(w) > 1):
                words.append((row, word[-1], state.slot))
                prefixes.append([ANY_TOKEN] * (TAIL_TOKENS - len(word) + 1) + word[:-1])
            if p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                mins += [(row, token, seq.num_prompt_tokens, p.min_tokens) for token in sorted(stops)]
            if p.penalized:
                penalized.append((row, state.slot, p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
            if state.slot is not None:
                recorded.append((row, state.slot))
            if state.matcher is not None:
                structured.append((row, seq, state))
                structured_in_rows.append(len(rows) - 1)
                structured_banned |= bool(p.bad_words_token_ids) or p.min_tokens > 0
            changes_values |= p.penalized or bool(p.logit_bias)
        if not rows:
            return None
        ints = _upload_lists({
            "rows": rows, "bans_rows": _column(static, 0) + _column(words, 0) + _column(mins, 0),
            "bans_tokens": _column(static, 1) + _column(words, 1) + _column(mins, 1), "word_slots": _column(words, 2),
            "min_starts": _column(mins, 2), "min_tokens": _column(mins, 3), "penalty_rows": _column(penalized, 0),
            "penalty_slots": _column(penalized, 1), "record_rows": _column(recorded, 0),
            "record_slots": _column(recorded, 1), "structured_rows": _column(structured, 0),
            "structured_in_rows": structured_in_rows}, np.int64, self.device)
        floats = _upload_lists({"static_values": _column(static, 2), "repetition": _column(penalized, 2),
                                "frequency": _column(penalized, 3), "presence": _column(penalized, 4)},
                               np.float32, self.device)
        word_prefixes = upload(torch.tensor(prefixes, dtype=torch.int64).reshape(-1, TAIL_TOKENS), self.device)
        return LogitsBatch(
            penalties=self.penalties, rows=ints["rows"], bans_rows=ints["bans_rows"], bans_tokens=ints["bans_tokens"],
            static_values=floats["static_values"], word_slots=ints["word_slots"], word_prefixes=word_prefixes,
            min_output_starts=ints["min_starts"], min_tokens=ints["min_tokens"], penalty_rows=ints["penalty_rows"],
            penalty_slots=ints["penalty_slots"], repetition=floats["repetition"], frequency=floats["frequency"],
            presence=floats["presence"], record_rows=ints["record_rows"], record_slots=ints["record_slots"],
            structured=structured, structured_rows=ints["structured_rows"],
            structured_in_rows=ints["structured_in_rows"], structured_banned=structured_banned,
            changes_values=changes_values, all_rows=len(rows) == len(seqs))

    def _join(self, seq: Sequence) -> _SequenceState:
        p = seq.params
        output_start = seq.num_prompt_tokens - p.num_resumed_tokens
        slot = None
        if p.penalized or any(len(word) > 1 for word in p.bad_words_token_ids):
            slot = self.penalties.allocate(seq.token_ids[:output_start], seq.token_ids[output_start:])
        matcher = self.grammars.matcher(p.structured_output) if p.structured_output is not None else None
        state = self._states[seq] = _SequenceState(output_start, slot, matcher)
        self._num_structured += matcher is not None
        return state

    def fill_bitmask(self, batch: LogitsBatch) -> torch.Tensor | None:
        """The structured rows' token bitmask for this step, on the device (``None`` without
        any): row ``i`` for batch row ``i`` (rows that are not structured hold stale words
        nobody reads), up to the last structured row. Each matcher first accepts the output
        tokens that reached the host since its last fill. Every token a structured row sampled
        must be on the host (``EngineCore.step`` completes the step in flight first, and with it
        the copy of the last bitmask from the pinned buffer this one is written into).
        """
        if not batch.structured:
            return None
        count = batch.structured[-1][0] + 1  # rows up to the last structured one
        if self._bitmask.shape[0] < count:
            self._bitmask = torch.zeros(max(count, 2 * self._bitmask.shape[0]), self.grammars.bitmask_words,
                                        dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host = self._bitmask
        for i, seq, state in batch.structured:
            matcher = state.matcher
            new = seq.token_ids[state.output_start + state.num_accepted:]
            for token in new:
                if not matcher.is_terminated() and not matcher.accept_token(token):
                    logger.error("request %s sample %d: token %d is outside its structured output",
                                 seq.request_id, seq.index, token)
            state.num_accepted += len(new)
            if matcher.is_terminated():
                host[i].numpy()[:] = self._stop_only
            else:
                matcher.fill_next_token_bitmask(host, i)
        return host[:count] if self.device.type == "cpu" else host[:count].to(self.device, non_blocking=True)

    def record(self, batch: LogitsBatch, token_ids: torch.Tensor) -> None:
        """Count each row's sampled token into its slot (on the device, behind the sampling)."""
        if batch.record_rows.numel():
            self.penalties.record(batch.record_slots, token_ids.index_select(0, batch.record_rows))


def _column(entries: list[tuple], i: int) -> list:
    return [entry[i] for entry in entries]


def _upload_lists(lists: dict[str, list], dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Each list as a 1-D tensor on ``device``, all of them in one copy (views of one tensor)."""
    sizes = [len(values) for values in lists.values()]
    packed = upload(torch.from_numpy(np.concatenate([np.asarray(v, dtype=dtype) for v in lists.values()])), device)
    return dict(zip(lists, packed.split(sizes)))
