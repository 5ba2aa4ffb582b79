"""Structured output's grammars: a :class:`~engine.sampling_params.StructuredOutput` compiled
over the model's tokenizer by xgrammar (what vLLM and SGLang use), and the matchers that follow
one sequence's output through it and fill its token bitmask.

A compiled grammar holds, for each state of the grammar, which tokens of the vocabulary can
continue it; a ``GrammarMatcher`` walks one output through it and writes the tokens allowed
next as a bitmask (``int32`` words, bit ``t % 32`` of word ``t // 32`` for token ``t``), which
the sampler turns into ``-inf`` logits. Compiling is the expensive part (milliseconds to tens
of milliseconds a JSON schema over a 50k vocabulary); xgrammar's compiler caches what it
compiled under the kind and text of the spec, and one compiler serves one tokenizer, so a
grammar is compiled once per engine. Compiling releases the GIL, and the compiler is
thread-safe: the engine core's input thread compiles a request's grammar before the busy loop
sees the request (``engine.core.core_proc``), and the busy loop finds it in the cache.

xgrammar (and its FFI layer) imports torch, so only the engine loads this module; the gateway
checks structured output without it (``engine.sampling_params.StructuredOutput``).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Collection

import numpy as np

from engine.sampling_params import StructuredOutput
from engine.tokenizer import Tokenizer

# Compiled grammars kept per engine at most (xgrammar's cache, least recently used out).
GRAMMAR_CACHE_BYTES = 512 << 20
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class Grammars:
    """Compiles structured-output specs over one model's tokenizer, and makes matchers.

    Args:
        tokenizer: the model's tokenizer (``None``: the model has none, and structured output
            is refused).
        vocab_size: the logits' width (the model's vocabulary, which may be larger than the
            tokenizer's: tokens past the tokenizer's are never allowed).
        eos_token_ids: the model's end-of-sequence tokens: the grammar allows them, and only
            them, where the structure is complete.

    xgrammar is imported, and the tokenizer's vocabulary read (0.2 s for 50k tokens), on the
    first compile.
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.bitmask_words = -(-vocab_size // 32)
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import transformers
                try:
                    import xgrammar
                except ImportError as exc:  # a dependency (pyproject.toml): refuse the request, not the engine
                    raise ValueError(f"structured_output needs the xgrammar package: {exc}") from None

                # transformers' fast tokenizer over our tokenizers backend: what xgrammar reads the
                # vocabulary, its byte encoding and its prefix-space rule from.
                hf = transformers.PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler

    def compile(self, spec: StructuredOutput):
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (from the cache after the first time).

        Raises:
            ValueError: the model has no tokenizer, or xgrammar refuses the spec; the message
                names the field (``json_schema``, ``regex``, ``choice``, ``grammar``).
        """
        if self.tokenizer is None:
            raise ValueError(f"{spec.kind} needs the model's tokenizer, and this model has none")
        compiler = self._get_compiler()
        try:
            if spec.json_schema is not None:
                return compiler.compile_json_schema(spec.json_schema, any_whitespace=False)
            if spec.json_object:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                # JSON's string escapes are the EBNF literals' (quotes, backslashes, \n, \uXXXX).
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as exc:
            # xgrammar's messages start with a time and the C++ source line: keep what follows.
            reason = _XGRAMMAR_PREFIX.sub("", str(exc).strip().splitlines()[0])
            raise ValueError(f"{spec.kind} is not valid: {reason}") from None

    def matcher(self, spec: StructuredOutput):
        """A fresh ``xgrammar.GrammarMatcher`` at the start of ``spec``'s grammar.

        Raises:
            ValueError: as :meth:`compile`.
        """
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec))

    def replay(self, spec: StructuredOutput, token_ids: list[int], field: str) -> None:
        """Check that ``spec``'s grammar accepts ``token_ids`` as the start of an output (the
        output a sequence joins with: the prefill worker's first token, a resumed stream's).

        Raises:
            ValueError: as :meth:`compile`, or naming ``field`` when a token is not allowed.
        """
        matcher = self.matcher(spec)
        for i, token in enumerate(token_ids):
            if not matcher.accept_token(token):
                raise ValueError(f"{field} has token {token} at output position {i}, which {spec.kind} does not allow")

    def stop_only_bitmask(self) -> np.ndarray:
        """``[bitmask_words]`` int32: only the EOS tokens allowed (a matcher that has accepted
        EOS has nothing left to allow; a sample that ignores EOS goes on with EOS alone)."""
        words = np.zeros(self.bitmask_words, dtype=np.uint32)
        for token in self.eos_token_ids:
            words[token // 32] |= np.uint32(1 << (token % 32))
        return words.view(np.int32)
