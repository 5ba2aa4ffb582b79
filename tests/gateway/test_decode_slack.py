"""The TPOT slack of a decode worker's streams: what a prefill there may still stall them."""

from __future__ import annotations

import math

import pytest

from gateway.decode_slack import DecodeSlack
from tests.helpers.gateway import Clock


def test_the_least_slack_of_a_workers_streams_is_its_budget():
    clock = Clock()
    slack = DecodeSlack(clock)
    tokens = {"a": 0, "b": 0}
    with slack.decoding("decode-0", lambda: tokens["a"], horizon=100):
        assert slack.slack_s("decode-0", 0.040, 0.010) is None  # no stream has ended: lengths unknown
        with slack.decoding("decode-1", lambda: 100, horizon=100):
            pass
        assert slack.expected_tokens == 100
        # 100 tokens at 40 ms a token on average may take 4 s; at 10 ms a step they take 1 s.
        assert slack.slack_s("decode-0", 0.040, 0.010) == pytest.approx(3.0)
        clock.now += 2.5  # 2.5 s later (a long stall) with 50 tokens out, 50 more take 0.5 s
        tokens["a"] = 50
        assert slack.slack_s("decode-0", 0.040, 0.010) == pytest.approx(1.0)
        with slack.decoding("decode-0", lambda: tokens["b"], horizon=20):
            # The new stream: 20 tokens in 0.8 s, 0.2 s of them decoding: 0.6 s.
            assert slack.count("decode-0") == 2
            assert slack.slack_s("decode-0", 0.040, 0.010) == pytest.approx(0.6)
            tokens["b"] = 20  # done producing: no stall reaches it any more
            assert slack.slack_s("decode-0", 0.040, 0.010) == pytest.approx(1.0)
        assert slack.expected_tokens == pytest.approx(0.9 * 100 + 0.1 * 20)
    assert slack.count("decode-0") == 0 and slack.slack_s("decode-0", 0.040, 0.010) == math.inf


def test_streams_are_expected_to_last_as_long_as_the_ones_that_ended():
    """A request without max_tokens may run to max_model_len, but streams stop earlier: each is
    expected to reach the mean length seen, and one past it to end after its next token."""
    clock = Clock()
    slack = DecodeSlack(clock)
    for length in (10, 10):  # two 10-token answers
        with slack.decoding("decode-0", lambda n=length: n, horizon=8000):
            pass
    tokens = [0]
    with slack.decoding("decode-0", lambda: tokens[0], horizon=8000):
        # 10 tokens expected at 40 ms on average: 0.4 s, 0.1 s of them decoding.
        assert slack.slack_s("decode-0", 0.040, 0.010) == pytest.approx(0.3)
        clock.now += 0.5
        tokens[0] = 30  # past the mean: its earned slack, 31 tokens' 1.24 s less 0.5 s and one step
        assert slack.slack_s("decode-0", 0.040, 0.010) == pytest.approx(0.73)


def test_a_stream_leaves_the_count_when_its_block_fails():
    slack = DecodeSlack(Clock())
    with pytest.raises(RuntimeError), slack.decoding("decode-0", lambda: 3, horizon=8):
        raise RuntimeError("stream lost")
    assert slack.count("decode-0") == 0 and slack.expected_tokens == 3


def test_a_stream_past_its_objective_does_not_bound_the_slack():
    """A late stream misses the objective whatever is refused from now on, and so does one whose
    slack the local prefills already queued (``committed_s``) will spend: the budget is the least
    slack of the streams that can still meet it."""
    clock = Clock()
    slack = DecodeSlack(clock)
    with slack.decoding("decode-0", lambda: 100, horizon=100):
        pass
    with slack.decoding("decode-0", lambda: 0, horizon=100):  # 4 s allowed, 1 s of it decoding
        clock.now += 2.5  # stalled 2.5 s before its first step: 0.5 s of slack left
        with slack.decoding("decode-0", lambda: 0, horizon=100):  # a fresh stream: 3 s
            assert slack.slack_s("decode-0", 0.040, 0.010) == pytest.approx(0.5)
            clock.now += 1.0  # the first is now 0.5 s past its objective, the second has 2 s
            assert slack.slack_s("decode-0", 0.040, 0.010) == pytest.approx(2.0)
            assert slack.slack_s("decode-0", 0.040, 0.010, committed_s=1.5) == pytest.approx(2.0)
            assert slack.slack_s("decode-0", 0.040, 0.010, committed_s=2.5) == math.inf  # queued stalls doom both
        assert slack.slack_s("decode-0", 0.040, 0.010) == math.inf  # only the late one runs
