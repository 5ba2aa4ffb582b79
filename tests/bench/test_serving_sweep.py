"""A sweep of the serving benchmark measures the service, not its prefix cache: every run draws
prompts of its own, so no run finds another run's prompts (or their first block) cached; the
setups compared draw the same prompts."""

from __future__ import annotations

from argparse import Namespace

import pytest

from bench.serving import WORKLOADS, sweep

BLOCK_SIZE = 16


def args(workloads: str) -> Namespace:
    return Namespace(workloads=workloads, num_requests=8, concurrency=[4, 8], rates=[2.0, 4.0])


@pytest.mark.parametrize("workload", [w for w in WORKLOADS if w != "multi_turn"])
def test_two_runs_of_a_sweep_share_no_prompt(workload: str) -> None:
    runs = sweep(args(workload), vocab_size=49152)
    assert len(runs) == 4
    first_blocks = [{tuple(r.prompt[:BLOCK_SIZE]) for r in requests} for *_, requests in runs]
    for i, mine in enumerate(first_blocks):
        for theirs in first_blocks[i + 1:]:
            assert not mine & theirs


def test_conversations_of_two_runs_start_apart() -> None:
    runs = sweep(args("multi_turn"), vocab_size=49152)
    openings = [{tuple(r.prompt[:BLOCK_SIZE]) for r in requests if r.turn == 0} for *_, requests in runs]
    assert all(len(o) == 8 for o in openings)
    assert not set.intersection(*openings[:2]) and not openings[0] & openings[3]


def test_each_setup_draws_the_same_prompts() -> None:
    once, again = sweep(args("random,long"), vocab_size=49152), sweep(args("random,long"), vocab_size=49152)
    assert [[r.prompt for r in requests] for *_, requests in once] == \
           [[r.prompt for r in requests] for *_, requests in again]
