"""Per-request sampling parameters, validated when built."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# Tokens of one bad word at most: the engine keeps this many of each sequence's last output
# tokens on the device to match bad words against (engine.runner.penalties).
MAX_BAD_WORD_TOKENS = 32


@dataclass(frozen=True)
class StructuredOutput:
    """A structure the output must follow (vLLM's ``StructuredOutputsParams``): exactly one of
    the fields is set. The engine compiles it into a grammar over the model's tokenizer
    (``engine.runner.grammar``, xgrammar) and masks, at every step, the tokens that cannot
    continue it; a sample ends (EOS) only where the structure is complete.

    Attributes:
        json_schema: a JSON schema (the JSON text of an object or a boolean): the output is one
            JSON value valid under it, on one line (``", "`` and ``": "`` between items), no
            property outside the schema's.
        json_object: the output is one JSON object, any keys and values.
        regex: the output matches this regular expression in full (xgrammar's dialect:
            ECMAScript-like, without lookaround or backreferences).
        choice: the output is exactly one of these strings.
        grammar: the output is a sentence of this EBNF grammar (xgrammar's / GBNF's
            notation: ``root ::= ...``, the start rule named ``root``).

    Raises:
        ValueError: none or several set, an empty one, a schema that is not JSON of an object
            or a boolean; the message names the field. Whether the engine can compile it is
            checked by the engine (``EngineCore.validate_params``).
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json_schema", "json_object", "regex", "choice", "grammar") if getattr(self, name)]
        if len(kinds) != 1:
            raise ValueError(f"structured_output must set exactly one of json_schema, json_object, regex, choice, "
                             f"grammar (got {', '.join(kinds) or 'none'})")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise ValueError(f"json_schema is not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object or boolean, got {type(schema).__name__}")
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be non-empty strings")

    @property
    def kind(self) -> str:
        """The field that is set (``"json_schema"``, ``"json_object"``, ...)."""
        return next(name for name in ("json_schema", "json_object", "regex", "choice", "grammar")
                    if getattr(self, name))

    @property
    def spec(self) -> str:
        """The set field's value as one string (the choices as a JSON list; ``""`` for
        ``json_object``), what compiled grammars are cached under with :attr:`kind`."""
        value = getattr(self, self.kind)
        if self.choice is not None:
            return json.dumps(value)
        return "" if value is True else value


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
            the sampled token's log-probability is always returned). Log-probabilities are the
            model's, before any of the logit processing below.
        repetition_penalty: tokens of the prompt or the output so far have a positive logit
            divided by it and a negative one multiplied by it (CTRL, Keskar et al. 2019, as
            transformers' ``RepetitionPenaltyLogitsProcessor``); 1 is off (> 0).
        presence_penalty: subtracted from the logit of every token the output holds (OpenAI's
            rule), in [-2, 2].
        frequency_penalty: subtracted from each token's logit times its count in the output
            (OpenAI's rule), in [-2, 2].
        logit_bias: token id → added to its logit (OpenAI's ``logit_bias``), each in [-100, 100].
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many new tokens
            (>= 0, at most ``max_tokens``; vLLM's, transformers' ``MinNewTokensLengthLogitsProcessor``).
        bad_words_token_ids: token sequences the output may not contain: where the output ends
            with all but the last token of one, that last token cannot be sampled (a one-token
            word never can), as transformers' ``NoBadWordsLogitsProcessor`` over the output;
            each of 1 to :data:`MAX_BAD_WORD_TOKENS` tokens.
        structured_output: a structure the output must follow (``None``: free text).
        num_speculative_tokens: speculative decoding: draft tokens per step for this request at
            most, where the engine speculates (``None``: the engine's
            ``SpeculativeConfig.num_speculative_tokens``, which also caps it; 0: none; >= 0).
        num_resumed_tokens: the last ``num_resumed_tokens`` tokens of the prompt are output this
            sample already produced (a stream resumed on another worker after them): the
            presence and frequency penalties, bad words and the structured output count them as
            output (``max_tokens`` and ``min_tokens`` do not: the caller reduces those).

    The logits are processed in this order, each step: the structured output's token bitmask,
    bad words, ``min_tokens``, ``logit_bias``, then the repetition, frequency and presence
    penalties; where that leaves a structured sample no token, its bitmask alone applies (the
    structure is never broken).

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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured_output: StructuredOutput | None = None
    num_speculative_tokens: int | None = None
    num_resumed_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
        self.bad_words_token_ids = [list(word) for word in self.bad_words_token_ids]
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
            ("repetition_penalty", 0 < self.repetition_penalty < math.inf, "must be a finite number > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("logit_bias", all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items()),
             "must map token ids >= 0 to biases in [-100, 100]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, f"must be in [0, max_tokens={self.max_tokens}]"),
            ("bad_words_token_ids", all(0 < len(w) <= MAX_BAD_WORD_TOKENS and min(w) >= 0
                                        for w in self.bad_words_token_ids),
             f"must be sequences of 1 to {MAX_BAD_WORD_TOKENS} token ids >= 0"),
            ("num_speculative_tokens", self.num_speculative_tokens is None or self.num_speculative_tokens >= 0,
             "must be >= 0"),
            ("num_resumed_tokens", self.num_resumed_tokens >= 0, "must be >= 0"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """True when the argmax token is always chosen (temperature 0)."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the repetition, presence or frequency penalty is on."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def processes_logits(self) -> bool:
        """Whether any logit processing applies (penalties, bias, ``min_tokens``, bad words,
        structured output): a batch whose rows have none skips all of it."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words_token_ids)
                or self.structured_output is not None)
