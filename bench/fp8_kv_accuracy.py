"""What an fp8 KV cache costs in accuracy: ``kv_cache_dtype="fp8_e4m3"`` (K and V stored in
float8 e4m3, scale 1.0, saturated to ±448: engine/runner/kv_cache.py) against ``"auto"`` (the float32
cache of a float32 model), on the real SmolLM2-135M-Instruct (the default model, dequantized:
``quantization="none"``, float32 weights and activations), the CPU path.

- Greedy agreement (:mod:`bench.agreement`): 64 chat prompts x 64 new tokens, EOS ignored; the
  share of positions with the same token, and |Δ log-prob| of the picked token until a
  sequence's first disagreement.
- Perplexity of ``bench/data/perplexity.txt``, every token scored by one forward pass over the
  whole text, its K and V read back from a cache of the engine's KV dtype.

Both engines run in this one process. Prints the JSON record and writes it under
``bench/results/fp8_kv_accuracy/``. Usage: ``python -m bench.fp8_kv_accuracy [--prompts 64] [--max-tokens 64]``
"""

from __future__ import annotations

from bench.accuracy import compare, evaluate, main
from engine import LLM


def _llm(kv_cache_dtype: str) -> LLM:
    return LLM(quantization="none", dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype)


def measure(num_prompts: int = 64, max_tokens: int = 64) -> dict[str, float]:
    """Agreement and perplexities of the fp8 KV cache against the float32 one (see the module
    docstring)."""
    exact = evaluate(_llm("auto"), num_prompts, max_tokens)
    fp8 = evaluate(_llm("fp8_e4m3"), num_prompts, max_tokens)
    return compare(exact, fp8, ("float32", "fp8_e4m3"))


if __name__ == "__main__":
    main("fp8_kv_accuracy", __doc__.splitlines()[0], measure,
         {"quantization": "none", "dtype": "float32", "kv_cache_dtype": "fp8_e4m3",
          "reference": "kv_cache_dtype=auto (float32)"})
