"""The penalties' per-sequence state on the device, and the batched formulas that read it.

A sequence with a repetition, presence or frequency penalty, or a bad word of two tokens or
more, holds one *slot*: a row of :class:`PenaltyRows`' tensors with its output's token counts
(``int32``), which tokens its prompt holds (``bool``) and its last output tokens (``int64``, for
bad words). A slot is filled once, from the host's tokens, when the sequence joins the sampling
batch; after that each step adds the tokens it sampled to the counts and the tails on the
device (:meth:`PenaltyRows.record`), so nothing is rebuilt from a whole output, and a step
launched before the last one's tokens reached the host (async scheduling) reads counts that
already include them (the device runs the two in order).

The formulas are transformers' logits processors' and OpenAI's (tests compare them on the same
logits): :func:`apply_penalties` (``RepetitionPenaltyLogitsProcessor``, then OpenAI's frequency
and presence penalties) and :func:`bad_word_matches` (``NoBadWordsLogitsProcessor``).
"""

from __future__ import annotations

import torch

from engine.runner.devices import upload
from engine.sampling_params import MAX_BAD_WORD_TOKENS

# A tail entry no token matches: the tail of an output shorter than the tail.
NO_TOKEN = -1
# A bad word's prefix entry that matches anything: prefixes shorter than the tail are right-aligned.
ANY_TOKEN = -2
TAIL_TOKENS = MAX_BAD_WORD_TOKENS - 1


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The penalized logits of ``k`` rows (a new tensor).

    A token seen in the prompt or the output has a positive logit divided by the repetition
    penalty and a negative one multiplied by it (Keskar et al., 2019, "CTRL", as transformers'
    ``RepetitionPenaltyLogitsProcessor``); then ``frequency * count + presence * (count > 0)`` is
    subtracted, the count being the token's in the output (OpenAI's API reference).

    Args:
        logits: ``[k, vocab]`` float32.
        counts: ``[k, vocab]`` int32, each token's count in the output.
        in_prompt: ``[k, vocab]`` bool, whether the prompt holds the token.
        repetition, frequency, presence: ``[k]`` float32 penalties (1, 0, 0: off).
    """
    seen = in_prompt | (counts > 0)
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def bad_word_matches(tails: torch.Tensor, prefixes: torch.Tensor) -> torch.Tensor:
    """Which of ``p`` (output, bad word) pairs have the output end with all but the last token
    of the word: that last token is then banned (``NoBadWordsLogitsProcessor``).

    Args:
        tails: ``[p, TAIL_TOKENS]`` int64, each pair's output's last tokens, oldest first
            (:data:`NO_TOKEN` before the output's start).
        prefixes: ``[p, TAIL_TOKENS]`` int64, each word but its last token, right-aligned,
            :data:`ANY_TOKEN` before its start.

    Returns:
        ``[p]`` bool.
    """
    return ((tails == prefixes) | (prefixes == ANY_TOKEN)).all(dim=1)


class PenaltyRows:
    """The slots of the sequences that need penalty state, on one device.

    Args:
        vocab_size: the logits' width.
        device: where the rows live (the logits' device).

    Attributes:
        counts: ``[capacity, vocab]`` int32, each slot's output token counts.
        in_prompt: ``[capacity, vocab]`` bool, each slot's prompt tokens.
        tails: ``[capacity, TAIL_TOKENS]`` int64, each slot's last output tokens, oldest first.

    The tensors grow (doubling) when every slot is taken: ``5 * vocab_size`` bytes a slot, 640 KB
    at a 128k vocabulary, allocated outside the memory profile that sized the KV cache.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.tails = torch.zeros(0, TAIL_TOKENS, dtype=torch.int64, device=device)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """Take a slot and fill it from a sequence's tokens on the host; returns the slot.

        Ops run on the device's current stream, after any step already queued on it, so a
        slot freed while a step in flight still records into it is refilled after that.
        """
        if not self._free:
            self._grow(max(8, 2 * self.capacity))
        slot = self._free.pop()
        self.counts[slot] = 0
        self.in_prompt[slot] = False
        if prompt_ids:
            self.in_prompt[slot, upload(torch.tensor(prompt_ids, dtype=torch.int64), self.device)] = True
        tail = torch.full((TAIL_TOKENS,), NO_TOKEN, dtype=torch.int64)
        if output_ids:
            out = torch.tensor(output_ids, dtype=torch.int64)
            self.counts[slot] = upload(torch.bincount(out, minlength=self.vocab_size).to(torch.int32), self.device)
            last = out[-TAIL_TOKENS:]
            tail[TAIL_TOKENS - len(last):] = last
        self.tails[slot] = upload(tail, self.device)
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back (its rows are refilled by the next :meth:`allocate` that takes it)."""
        self._free.append(slot)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add one sampled token to each of ``slots``' counts and tails (on the device).

        Args:
            slots: ``[k]`` int64, distinct.
            token_ids: ``[k]`` int64, the tokens the slots' sequences sampled.
        """
        self.counts.index_put_((slots, token_ids), torch.ones_like(slots, dtype=torch.int32), accumulate=True)
        tails = torch.cat([self.tails.index_select(0, slots)[:, 1:], token_ids[:, None]], dim=1)
        self.tails.index_copy_(0, slots, tails)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name in ("counts", "in_prompt", "tails"):
            tensor = getattr(self, name)
            grown = torch.zeros(capacity, *tensor.shape[1:], dtype=tensor.dtype, device=self.device)
            grown[:old] = tensor
            setattr(self, name, grown)
        self._free.extend(range(capacity - 1, old - 1, -1))
