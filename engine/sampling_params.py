"""Per-request sampling parameters, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each new token of a request (vLLM's field names and meanings).

    Attributes:
        max_tokens: new tokens to generate at most (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0 from a protobuf default) disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top one, in [0, 1].
        seed: makes this request's samples reproducible regardless of its batch mates.
        stop: strings that end generation; the text is cut before them.
        stop_token_ids: token ids that end generation (kept in the output).
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        n: parallel samples of the prompt; they share the prompt's KV blocks.
        logprobs: return the top-``logprobs`` log-probabilities per generated token (0: none;
            the sampled token's log-probability is always returned).

    Raises:
        ValueError: a field is out of range; the message names it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 (disabled) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("n", self.n >= 1, "must be >= 1"),
            ("logprobs", self.logprobs >= 0, "must be >= 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be >= 0"),
            ("seed", self.seed is None or 0 <= self.seed <= 2**64 - self.n,
             "must be in [0, 2**64 - n] (sample i is seeded with seed + i)"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """True when the argmax token is always chosen (temperature 0)."""
        return self.temperature == 0
