"""The accuracy cost of an fp8 KV cache on the real model stays bounded (bench/fp8_kv_accuracy.py at
a reduced size: 16 chat prompts x 32 greedy tokens; the recorded run is 64 x 64)."""

import pytest

from bench.fp8_kv_accuracy import measure

pytestmark = pytest.mark.slow


def test_fp8_kv_cache_agrees_with_the_float32_cache():
    metrics = measure(num_prompts=16, max_tokens=32)
    # Measured: agreement 0.51, mean |Δ log-prob| 0.039 (max 0.26), every first disagreement a
    # near-tie, perplexity ratio 1.0014. A wrong cast, a lost saturation (NaN) or bytes read as
    # another dtype gives unrelated tokens and a perplexity far off; a zero difference means
    # the cache was not fp8 at all.
    assert 0 < metrics["mean_logprob_diff"] <= 0.1, metrics
    assert metrics["greedy_agreement"] >= 0.3, metrics
    assert metrics["disagreements_in_top5"] >= 0.9, metrics
    assert metrics["perplexity_ratio"] <= 1.01, metrics
