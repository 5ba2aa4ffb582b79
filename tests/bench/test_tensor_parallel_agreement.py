"""bench/tensor_parallel.py's agreement measure (its GPU runs: tests/engine/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from bench.tensor_parallel import agreement


def _row(tokens: list[int], logprobs: list[float], tops: list[list[int]]) -> list[tuple]:
    return [(t, lp, top, 0.1) for t, lp, top in zip(tokens, logprobs, tops)]


def test_agreement_counts_positions_and_measures_only_before_the_first_disagreement() -> None:
    a = [_row([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], [[1, 9], [2, 7], [3, 5], [4, 6]])]
    b = [_row([1, 2, 5, 4], [-1.5, -2.0, -9.0, -9.0], [[1, 9], [2, 7], [5, 3], [4, 6]])]
    result = agreement(a, b)
    assert result["agreement"] == 0.75  # the last position agrees again, and counts
    assert result["max_logprob_diff"] == 0.5 and result["mean_logprob_diff"] == 0.25  # the 7.0 after it does not
    assert result["disagreements_in_top5"] == 1.0  # 5 in a's top, 3 in b's


def test_a_disagreement_outside_the_other_top_is_not_a_near_tie() -> None:
    a = [_row([1], [-1.0], [[1, 2]]), _row([3], [-1.0], [[3, 4]])]
    b = [_row([2], [-1.0], [[2, 1]]), _row([8], [-1.0], [[8, 9]])]
    result = agreement(a, b)
    assert result["agreement"] == 0.0
    assert result["disagreements_in_top5"] == pytest.approx(0.5)
    assert agreement(a, a) == {"agreement": 1.0, "max_logprob_diff": 0.0, "mean_logprob_diff": 0.0,
                               "disagreements_in_top5": 1.0}
