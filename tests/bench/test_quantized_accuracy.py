"""The accuracy cost of computing the real GGUF's weights quantized stays small (bench/quantized_accuracy.py
at a reduced size: 16 chat prompts x 32 greedy tokens; the recorded run is 64 x 64)."""

import pytest

from bench.quantized_accuracy import measure

pytestmark = pytest.mark.slow


def test_quantized_weights_agree_with_the_dequantized_model():
    metrics = measure(num_prompts=16, max_tokens=32)
    # Measured: agreement 0.81, mean |Δ log-prob| 0.020 (max 0.15), every first disagreement a
    # near-tie, perplexity ratio 0.9996. A wrong scale, zero or row order gives unrelated tokens.
    assert metrics["greedy_agreement"] >= 0.6, metrics
    assert metrics["mean_logprob_diff"] <= 0.06, metrics
    assert metrics["disagreements_in_top5"] >= 0.9, metrics
    assert metrics["perplexity_ratio"] <= 1.03, metrics
