"""What computing a GGUF's weights quantized costs in accuracy: ``quantization="gguf"`` (Q4_1 /
Q8_0 weights kept as they are, matmuls in bfloat16) against ``"none"`` (the same file
dequantized to float32, the path that matches HF transformers token for token), on the real
SmolLM2-135M-Instruct Q4_1.

- Greedy agreement (:mod:`bench.agreement`): 64 chat prompts x 64 new tokens, EOS ignored; the
  share of positions with the same token, and |Δ log-prob| of the picked token until a
  sequence's first disagreement.
- Perplexity of ``bench/data/perplexity.txt`` (a text written for this project), every token
  scored by one forward pass over the whole text.

Both engines run in this one process. Prints the JSON record and writes it under
``bench/results/quantized_accuracy/``. Usage: ``python -m bench.quantized_accuracy [--prompts 64] [--max-tokens 64]``
"""

from __future__ import annotations

from bench.accuracy import compare, evaluate, main
from engine import LLM


def measure(num_prompts: int = 64, max_tokens: int = 64) -> dict[str, float]:
    """Agreement and perplexities of ``"gguf"`` against ``"none"`` (see the module docstring)."""
    dense = evaluate(LLM(quantization="none"), num_prompts, max_tokens)
    quantized = evaluate(LLM(quantization="gguf"), num_prompts, max_tokens)
    return compare(dense, quantized, ("none", "gguf"))


if __name__ == "__main__":
    main("quantized_accuracy", __doc__.splitlines()[0], measure, {"reference": "quantization=none (float32)"})
