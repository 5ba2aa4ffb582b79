"""Per-request placement of the prefill: the predictions and the decisions they lead to."""

from __future__ import annotations

import pytest

from gateway.decode_slack import DecodeSlack
from gateway.placement import (
    LENT, LOCAL_ONLY, LOCAL_PREDICTED, LOCAL_SHARED, LOCAL_SHORT, REMOTE, Lender, Placement, PlacementModel,
    ServiceLevel,
)
from gateway.prefill_pace import PrefillPace

PREFILL, DECODE = "prefill-0", "decode-0"
NONE = ServiceLevel()


def model(prefill_s_per_token: float | None = 1e-3, decode_s_per_token: float | None = 1e-3,
          local_prefill_max_tokens: int = 16, adaptive: bool = True) -> PlacementModel:
    m = PlacementModel(PrefillPace(base_s=60, default_s_per_token=0.05), local_prefill_max_tokens, adaptive=adaptive)
    for pace, worker, s_per_token in ((m.pace, PREFILL, prefill_s_per_token),
                                      (m.local_pace, DECODE, decode_s_per_token)):
        if s_per_token is not None:
            pace.observe(worker, 1000, 1000 * s_per_token)
    return m


def test_static_overrides_come_first():
    m = model()
    assert m.decide(None, 0, DECODE, 4000, decode_running=8, slo=NONE).kind == LOCAL_ONLY
    assert m.decide(PREFILL, 4000, DECODE, 16, decode_running=8, slo=NONE).kind == LOCAL_SHORT
    assert m.decide(PREFILL, 17, DECODE, 17, decode_running=0, slo=NONE).kind == REMOTE  # equal paces, no queue


def test_a_prefill_worker_on_the_decode_workers_gpu_is_not_used_in_adaptive_placement():
    """Two processes on one GPU time-slice it: a remote prefill there slows the decode worker's
    steps as a local one would, and adds a transfer. Whatever the queues and objectives, adaptive
    placement prefills on the decode worker; a static split keeps its prefill worker."""
    m = model()
    m.started(DECODE, 50_000)  # the local prediction alone would say remote
    slo = ServiceLevel(ttft_s=0.5, itl_s=0.02)
    assert m.decide(PREFILL, 4000, DECODE, 4000, decode_running=8, slo=slo, shared_device=True).kind == LOCAL_SHARED
    assert m.decide(PREFILL, 4000, DECODE, 4000, decode_running=8, slo=slo).kind == REMOTE
    assert model(adaptive=False).decide(PREFILL, 4000, DECODE, 4000, 8, slo, shared_device=True).kind == REMOTE
    assert m.decide(None, 0, DECODE, 4000, 8, slo, shared_device=True).kind == LOCAL_ONLY


def test_an_unmeasured_prefill_worker_keeps_requests_disaggregated():
    m = model(prefill_s_per_token=None, decode_s_per_token=None)
    m.started(PREFILL, 100_000)
    placement = m.decide(PREFILL, 1000, DECODE, 1000, decode_running=0, slo=NONE)
    assert placement.kind == REMOTE and placement.predicted_ttft_s is None
    assert model(prefill_s_per_token=None).decide(PREFILL, 1000, DECODE, 1000, 0, NONE).kind == REMOTE


def test_an_unmeasured_decode_worker_is_taken_to_prefill_at_the_prefill_workers_pace():
    """Long prompts only: the decode worker never prefilled, so nothing measured it; the prefill
    worker's pace stands in until its own first local prefill."""
    m = model(decode_s_per_token=None)
    m.started(PREFILL, 100_000)  # a long prefill queue: an idle decode worker is borrowed
    placement = m.decide(PREFILL, 1000, DECODE, 1000, decode_running=0, slo=NONE)
    assert placement.kind == LOCAL_PREDICTED and placement.predicted_ttft_s == pytest.approx(1.0)
    m.observe_step(DECODE, 0.020)  # busy: its running sequences' steps would take 20 + 1000 ms
    assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(itl_s=0.04)).kind == REMOTE
    chunked = m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(itl_s=0.04), decode_step_tokens=16)
    assert chunked.kind == LOCAL_PREDICTED  # 20 + 16 ms a step
    m.local_pace.observe(DECODE, 1000, 10.0)  # its own pace, once measured, rules: 10 ms a token
    assert m.decide(PREFILL, 1000, DECODE, 1000, 0, NONE).predicted_ttft_s == pytest.approx(10.0)


def test_an_idle_decode_worker_is_borrowed_while_the_prefill_queue_is_long():
    m = model()
    m.started(PREFILL, 3000)
    placement = m.decide(PREFILL, 1000, DECODE, 1000, decode_running=0, slo=NONE)
    assert placement.kind == LOCAL_PREDICTED and placement.predicted_ttft_s == pytest.approx(1.0)
    m.ended(PREFILL, 3000)
    assert m.queued(PREFILL) == 0
    assert m.decide(PREFILL, 1000, DECODE, 1000, decode_running=0, slo=NONE).kind == REMOTE


def test_a_short_prompt_is_not_prefilled_where_it_would_break_the_itl_objective():
    m = model(decode_s_per_token=0.1e-3)
    m.observe_step(DECODE, 0.015)
    # 16 tokens at 0.1 ms each: predicted ITL 16.6 ms for the decode worker's 4 running sequences.
    assert m.decide(PREFILL, 16, DECODE, 16, 4, ServiceLevel(itl_s=0.02)).kind == LOCAL_SHORT
    assert m.decide(PREFILL, 16, DECODE, 16, 4, ServiceLevel(itl_s=0.01)).kind == REMOTE
    assert m.decide(PREFILL, 16, DECODE, 16, 0, ServiceLevel(itl_s=0.01)).kind == LOCAL_SHORT  # nothing runs there
    assert m.decide(PREFILL, 16, DECODE, 16, 4, NONE).kind == LOCAL_SHORT  # no objective: the threshold rules
    assert model(adaptive=False).decide(PREFILL, 16, DECODE, 16, 4, ServiceLevel(itl_s=1e-6)).kind == LOCAL_SHORT
    unmeasured = model(prefill_s_per_token=None, decode_s_per_token=None)  # nothing predicts it: the threshold rules
    assert unmeasured.decide(PREFILL, 16, DECODE, 16, 4, ServiceLevel(itl_s=1e-6)).kind == LOCAL_SHORT
    prior = model(decode_s_per_token=None)  # the prefill worker's pace stands in: 16 ms of prefill a step
    assert prior.decide(PREFILL, 16, DECODE, 16, 4, ServiceLevel(itl_s=0.01)).kind == REMOTE


def test_a_static_split_keeps_every_prefill_remote_but_the_overrides():
    m = model(adaptive=False)
    m.started(PREFILL, 3000)  # the backlog that borrows an idle decode worker in adaptive placement
    placement = m.decide(PREFILL, 1000, DECODE, 1000, decode_running=0, slo=ServiceLevel(ttft_s=0.5))
    assert placement.kind == REMOTE and placement.predicted_ttft_s == pytest.approx(4.0)
    assert m.decide(PREFILL, 1000, DECODE, 16, decode_running=0, slo=NONE).kind == LOCAL_SHORT
    assert m.decide(None, 0, DECODE, 1000, decode_running=0, slo=NONE).kind == LOCAL_ONLY


def test_a_busy_decode_worker_prefills_only_within_the_itl_objective():
    m = model()
    m.started(PREFILL, 3000)
    m.observe_step(DECODE, 0.020)
    # 1000 local tokens at 1 ms each would make its running sequences' next step ~1.02 s.
    assert m.predict_itl(DECODE, 1000) == pytest.approx(1.02)
    assert m.decide(PREFILL, 1000, DECODE, 1000, decode_running=4, slo=NONE).kind == REMOTE
    assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(itl_s=0.5)).kind == REMOTE
    assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(itl_s=1.5)).kind == LOCAL_PREDICTED


def test_a_busy_decode_worker_prefills_within_its_streams_tpot_slack():
    """A TPOT objective lets the running streams absorb a prefill's stall (1 s here: steps of
    1.02 s, which an ITL objective of 40 ms refuses) while each keeps its mean within it."""
    now = [0.0]
    m = model()
    m.slack = DecodeSlack(lambda: now[0])
    m.started(PREFILL, 3000)  # remote: 4 s
    m.observe_step(DECODE, 0.020)
    tpot = ServiceLevel(ttft_s=1.0, tpot_s=0.040)
    assert m.decide(PREFILL, 1000, DECODE, 1000, 4, tpot).kind == REMOTE  # nothing known of what runs there
    with m.slack.decoding(DECODE, lambda: 256, horizon=256):  # a stream that ran its 256 tokens
        pass
    out = [0]
    with m.slack.decoding(DECODE, lambda: out[0], horizon=256):
        # 256 tokens may take 10.24 s; at 20 ms a step they take 5.12: 5.12 s of slack.
        assert m.decide(PREFILL, 1000, DECODE, 1000, 4, tpot).kind == LOCAL_PREDICTED
        assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(ttft_s=1.0, itl_s=0.040)).kind == REMOTE
        assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(1.0, 0.040, 0.040)).kind == REMOTE  # both held
        now[0], out[0] = 4.5, 10  # a slow start: 0.82 s left, under the 1 s stall
        assert m.decide(PREFILL, 1000, DECODE, 1000, 4, tpot).kind == REMOTE
        now[0] = 2.5  # 2.82 s left, and the local prefills queued ahead stall them too
        assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(0.5, 0, 0.040)).kind == LOCAL_PREDICTED
        m.started(DECODE, 2000)  # local TTFT 3 s, under the remote 4 s, but a 3 s stall
        assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(0.5, 0, 0.040)).kind == REMOTE
        m.ended(DECODE, 2000)
        now[0] = 5.1  # 0.22 s left: a short prompt fits, but not behind 210 queued local tokens
        tpot_only = ServiceLevel(tpot_s=0.040)
        assert m.decide(PREFILL, 16, DECODE, 16, 4, tpot_only).kind == LOCAL_SHORT
        m.started(DECODE, 210)
        assert m.decide(PREFILL, 16, DECODE, 16, 4, tpot_only).kind == REMOTE
        assert m.decide(PREFILL, 16, DECODE, 16, 4, NONE).kind == LOCAL_SHORT
        # Refused, it would miss its own TTFT objective behind the remote 3 s queue: it stays.
        assert m.decide(PREFILL, 16, DECODE, 16, 4, tpot).kind == LOCAL_SHORT
        assert m.decide(PREFILL, 16, DECODE, 16, 4, ServiceLevel(ttft_s=5.0, tpot_s=0.040)).kind == REMOTE
        m.started(DECODE, 1790)  # 2 s queued: the stream misses its objective whatever is refused now
        assert m.decide(PREFILL, 16, DECODE, 16, 4, tpot_only).kind == LOCAL_SHORT
        m.ended(DECODE, 2000)
        now[0] = 20.0  # far behind: refusing no longer saves it, so it does not refuse
        assert m.decide(PREFILL, 16, DECODE, 16, 4, tpot).kind == LOCAL_SHORT
        assert m.decide(PREFILL, 1000, DECODE, 1000, 4, tpot).kind == LOCAL_PREDICTED
    unmeasured = model()  # no stream has ended: neither the step time nor the lengths are known
    with unmeasured.slack.decoding(DECODE, lambda: 0, horizon=256):
        unmeasured.started(PREFILL, 3000)
        assert unmeasured.decide(PREFILL, 1000, DECODE, 1000, 4, tpot).kind == REMOTE
        unmeasured.observe_step(DECODE, 0.020)  # a step time, but still no length
        assert unmeasured.decide(PREFILL, 1000, DECODE, 1000, 4, tpot).kind == REMOTE


def test_a_decode_worker_that_chunks_its_prefills_stretches_each_step_by_one_chunk_only():
    m = model()
    m.started(PREFILL, 3000)
    m.observe_step(DECODE, 0.020)
    # Chunks of 256 tokens: each step of its 4 running sequences takes 20 + 256 ms, not 1.02 s.
    assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(itl_s=0.5), decode_step_tokens=256).kind \
        == LOCAL_PREDICTED
    assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(itl_s=0.25), decode_step_tokens=256).kind == REMOTE
    assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(itl_s=0.5), decode_step_tokens=4096).kind == REMOTE
    # A short prompt (the static threshold's): 16 tokens in one step break a 30 ms objective, two
    # chunks of 8 do not.
    assert m.decide(PREFILL, 16, DECODE, 16, 4, ServiceLevel(itl_s=0.03), decode_step_tokens=8).kind == LOCAL_SHORT
    assert m.decide(PREFILL, 16, DECODE, 16, 4, ServiceLevel(itl_s=0.03)).kind == REMOTE


def test_a_local_prefill_is_measured_net_of_the_decode_steps_it_rode():
    """A short prompt prefilled beside 64 running sequences (7 ms steps, 256-token chunks) waits
    for the step running as it arrives and rides one more: 12 ms of TTFT, 1.5 ms of them for its 100
    tokens. Taken whole as prefill time (120 us a token), a 256-token chunk would be priced at a
    whole step of its own and break a 20 ms ITL objective; net of the ride (15 us a token) it
    does not, and a long prompt the prefill worker would start late is borrowed."""
    slo = ServiceLevel(ttft_s=0.5, itl_s=0.02)
    m = model(prefill_s_per_token=40e-6, decode_s_per_token=None, local_prefill_max_tokens=256)
    m.observe_step(DECODE, 0.007)
    short = m.decide(PREFILL, 100, DECODE, 100, 64, slo, decode_step_tokens=256)
    assert short.kind == LOCAL_SHORT and short.ride_s == pytest.approx(0.0105)
    assert m.decide(PREFILL, 100, DECODE, 100, 0, slo, decode_step_tokens=256).ride_s == 0  # nothing runs there
    m.observe_prefill(DECODE, 100, 0.012, short)
    assert m.local_pace.s_per_token(DECODE) == pytest.approx(15e-6)
    assert m.pace.s_per_token(DECODE) == pytest.approx(120e-6)  # the timeouts allow for the whole call
    assert m.predict_itl(DECODE, 256) == pytest.approx(0.007 + 256 * 15e-6)
    m.started(PREFILL, 10_000)  # remote: 0.52 s
    long = m.decide(PREFILL, 3000, DECODE, 3000, 64, slo, decode_step_tokens=256)
    assert long.kind == LOCAL_PREDICTED  # 45 ms of its tokens, riding 12 steps of 7 ms and half of one
    assert long.predicted_ttft_s == pytest.approx(3000 * 15e-6 + 12.5 * 0.007)
    remote = m.decide(PREFILL, 3000, DECODE, 3000, 64, slo)  # a decode worker taking 3000 tokens in one step
    assert remote.kind == REMOTE and remote.ride_s == 0
    m.observe_prefill(PREFILL, 13_000, 0.52, remote)  # a prefill worker's pace is its calls' time
    assert m.pace.s_per_token(PREFILL) == pytest.approx(40e-6) and m.local_pace.s_per_token(PREFILL) is None
    gross = model(prefill_s_per_token=40e-6, decode_s_per_token=None, local_prefill_max_tokens=256)
    gross.observe_step(DECODE, 0.007)
    gross.started(PREFILL, 10_000)
    gross.local_pace.observe(DECODE, 100, 0.012)
    assert gross.decide(PREFILL, 3000, DECODE, 3000, 64, slo, decode_step_tokens=256).kind == REMOTE


def test_a_ttft_objective_keeps_requests_disaggregated_while_the_prefill_worker_meets_it_with_headroom():
    m = model(decode_s_per_token=0.5e-3)  # the decode worker prefills twice as fast
    assert m.decide(PREFILL, 1000, DECODE, 1000, 0, NONE).kind == LOCAL_PREDICTED  # 0.5 s < 0.8 * 1 s
    assert m.decide(PREFILL, 1000, DECODE, 1000, 0, ServiceLevel(ttft_s=2.5)).kind == REMOTE  # 1 s of 2.5
    # 1 s spends more than half a 1.8 s objective: the decode worker, clearly sooner, takes it...
    assert m.decide(PREFILL, 1000, DECODE, 1000, 0, ServiceLevel(ttft_s=1.8)).kind == LOCAL_PREDICTED
    # ...but not when only a little sooner, nor where its streams' ITL objective does not allow it.
    assert model(decode_s_per_token=0.9e-3).decide(PREFILL, 1000, DECODE, 1000, 0, ServiceLevel(ttft_s=1.8)).kind \
        == REMOTE
    m.observe_step(DECODE, 0.020)
    assert m.decide(PREFILL, 1000, DECODE, 1000, 4, ServiceLevel(ttft_s=1.8, itl_s=0.1)).kind == REMOTE
    m = model(decode_s_per_token=0.5e-3)
    m.started(PREFILL, 2000)  # remote: 3 s, local: 0.5 s
    assert m.decide(PREFILL, 1000, DECODE, 1000, 0, ServiceLevel(ttft_s=2.0)).kind == LOCAL_PREDICTED
    # Both miss a 0.1 s objective: the lower prediction wins.
    assert m.decide(PREFILL, 1000, DECODE, 1000, 0, ServiceLevel(ttft_s=0.1)).kind == LOCAL_PREDICTED


def test_step_times_average_and_bad_samples_are_ignored():
    m = model()
    m.observe_step(DECODE, 0.010)
    m.observe_step(DECODE, 0.020)
    m.observe_step(DECODE, float("nan"))
    m.observe_step(DECODE, -1.0)
    assert m.predict_itl(DECODE, 0) == pytest.approx(0.7 * 0.010 + 0.3 * 0.020)


def test_a_request_objective_overrides_the_default_one_by_one():
    assert ServiceLevel(ttft_s=1.0).or_defaults(ServiceLevel(2.0, 0.05)) == ServiceLevel(1.0, 0.05)
    assert ServiceLevel(tpot_s=0.01).or_defaults(ServiceLevel(2.0, 0.05, 0.04)) == ServiceLevel(2.0, 0.05, 0.01)


def test_bad_knobs_are_refused():
    with pytest.raises(ValueError, match="local_gain"):
        PlacementModel(PrefillPace(1, 1), 0, adaptive=True, local_gain=0)
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        PlacementModel(PrefillPace(1, 1), local_prefill_max_tokens=-1, adaptive=True)


LENDER = "decode-1"
PACE = 1 / 38_000  # seconds per prompt token: a Llama-3-8B prefill worker on an H200 (deploy/plan/)


def lender(tokens: int = 3000, running: int = 0) -> Lender:
    return Lender(LENDER, tokens, running, step_tokens=2048)


def busy_decode_worker(m: PlacementModel, now: list[float]) -> None:
    """``DECODE`` runs streams at 20 ms a step, one 9.1 s past its first token and 200 tokens in,
    expected at 256: 10.24 s may pass for its objective of 40 ms, 1.12 s of steps are left, so it
    can absorb 20 ms of stall, less than a 3000-token prompt's 79 ms."""
    m.slack = DecodeSlack(lambda: now[0])
    with m.slack.decoding(DECODE, lambda: 256, horizon=256):  # one stream ended: streams run 256 tokens
        pass
    m.observe_step(DECODE, 0.020)


def test_long_prompts_under_a_one_second_ttft_go_to_an_idle_decode_worker_when_the_prefill_gpu_is_full():
    """The case of two GPUs of decode workers beside a prefill worker, long prompts at
    TTFT <= 1 s / TPOT <= 40 ms: the prefill worker has 40k tokens queued (1.13 s with this one),
    the request's own decode worker cannot absorb the stall; an idle decode worker that serves
    prefill takes it, at the prefill worker's pace until its own is measured."""
    now = [0.0]
    m = model(prefill_s_per_token=PACE, decode_s_per_token=None)
    busy_decode_worker(m, now)
    m.started(PREFILL, 40_000)
    slo = ServiceLevel(ttft_s=1.0, tpot_s=0.040)
    with m.slack.decoding(DECODE, lambda: 200, horizon=256):
        now[0] = 9.1
        assert m.decide(PREFILL, 3000, DECODE, 3000, 32, slo, 2048).kind == REMOTE  # no lender: today's choice
        lent = m.decide(PREFILL, 3000, DECODE, 3000, 32, slo, 2048, lender=lender())
        assert lent.kind == LENT and not lent.local and lent.on_decode_worker
        assert lent.predicted_ttft_s == pytest.approx(3000 * PACE) and lent.ride_s == 0  # nothing runs there
        now[0] = 8.0  # 1.1 s of slack: the decode worker could take it, riding 2.5 of its steps (129 ms)...
        assert m.decide(PREFILL, 3000, DECODE, 3000, 32, slo, 2048).kind == LOCAL_PREDICTED
        # ...but the idle lender is more than 20% sooner (79 ms); with 2000 tokens queued there
        # (132 ms) it is not, and the decode worker keeps the prompt, no KV moving
        assert m.decide(PREFILL, 3000, DECODE, 3000, 32, slo, 2048, lender=lender()).kind == LENT
        m.started(LENDER, 2000)
        assert m.decide(PREFILL, 3000, DECODE, 3000, 32, slo, 2048, lender=lender()).kind == LOCAL_PREDICTED
    # Whatever the lender's state, a static split never lends.
    static = model(prefill_s_per_token=PACE, adaptive=False)
    static.started(PREFILL, 40_000)
    assert static.decide(PREFILL, 3000, DECODE, 3000, 32, slo, 2048, lender=lender()).kind == REMOTE
    assert static.decide(None, 0, DECODE, 3000, 32, slo, 2048, lender=lender()).kind == LOCAL_ONLY


def test_a_busy_decode_worker_is_lent_only_within_its_own_sequences_objectives():
    """The lender runs 16 sequences at 20 ms a step: a 2048-token chunk of the prompt makes one of
    its steps 74 ms, which a 40 ms ITL objective refuses; a TPOT objective lets its streams absorb
    the 79 ms while each has the slack, and not once one has too little. (The request's decode
    worker steps at 30 ms: 84 ms with the chunk.)"""
    now = [0.0]
    m = model(prefill_s_per_token=PACE, decode_s_per_token=None)
    m.slack = DecodeSlack(lambda: now[0])
    with m.slack.decoding(LENDER, lambda: 256, horizon=256):
        pass
    m.observe_step(LENDER, 0.020)
    m.observe_step(DECODE, 0.030)
    m.started(PREFILL, 40_000)
    busy = lender(running=16)
    assert m.decide(PREFILL, 3000, DECODE, 3000, 0, ServiceLevel(1.0, 0.040), 2048, lender=busy).kind == \
        LOCAL_PREDICTED  # the request's own decode worker is idle: no need to lend
    assert m.decide(PREFILL, 3000, DECODE, 3000, 8, ServiceLevel(1.0, 0.040), 2048, lender=busy).kind == REMOTE
    assert m.decide(PREFILL, 3000, DECODE, 3000, 8, ServiceLevel(1.0, 0.074), 2048, lender=busy).kind == LENT
    tpot = ServiceLevel(ttft_s=1.0, tpot_s=0.040)
    assert m.decide(PREFILL, 3000, DECODE, 3000, 8, tpot, 2048, lender=busy).kind == REMOTE  # no stream known there
    with m.slack.decoding(LENDER, lambda: 100, horizon=256):
        now[0] = 5.0  # 10.24 - 5 - 3.12: 2.1 s of slack
        placement = m.decide(PREFILL, 3000, DECODE, 3000, 8, tpot, 2048, lender=busy)
        assert placement.kind == LENT  # riding two of its steps and half of the one running
        assert placement.ride_s == pytest.approx(2.5 * 0.020)
        assert placement.predicted_ttft_s == pytest.approx(3000 * PACE + 2.5 * 0.020)
        now[0] = 7.1  # 0.02 s of slack, under the 79 ms stall
        assert m.decide(PREFILL, 3000, DECODE, 3000, 8, tpot, 2048, lender=busy).kind == REMOTE
        assert m.decide(PREFILL, 3000, DECODE, 3000, 8, ServiceLevel(), 2048, lender=busy).kind == REMOTE


def test_without_a_prefill_worker_a_long_prompt_is_lent_when_its_decode_worker_cannot_take_it():
    """Colocated decode workers that serve prefill for each other: a long prompt whose local
    prefill breaks its decode worker's ITL objective goes to an idle one; a short one (at most
    the threshold) stays, as does one the decode worker takes within its objectives, and one whose
    local prediction is near the lender's."""
    m = model(prefill_s_per_token=None, decode_s_per_token=PACE, local_prefill_max_tokens=256)
    m.observe_step(DECODE, 0.010)
    itl = ServiceLevel(ttft_s=1.0, itl_s=0.040)
    # 2048 tokens in one step of its 32 sequences: 64 ms; the lender runs nothing (its pace: the
    # decode worker's, measured, until its own is)
    lent = m.decide(None, 0, DECODE, 3000, 32, itl, 2048, lender=lender())
    assert lent.kind == LENT and lent.predicted_ttft_s == pytest.approx(3000 * PACE)
    assert m.decide(None, 0, DECODE, 3000, 32, itl, 256, lender=lender()).kind == LOCAL_ONLY  # 17 ms chunks
    assert m.decide(None, 0, DECODE, 200, 32, itl, 2048, lender=lender(200)).kind == LOCAL_ONLY
    assert m.decide(None, 0, DECODE, 3000, 0, itl, 2048, lender=lender()).kind == LOCAL_ONLY  # idle itself
    assert m.decide(None, 0, DECODE, 3000, 32, itl, 2048).kind == LOCAL_ONLY  # no lender
    m.started(DECODE, 20_000)  # 0.6 s of local prefills queued: the idle lender is clearly sooner
    assert m.decide(None, 0, DECODE, 3000, 0, ServiceLevel(), 2048, lender=lender()).kind == LENT
    shared = model(prefill_s_per_token=PACE)  # the only prefill worker is on the decode worker's GPU
    shared.observe_step(DECODE, 0.010)
    assert shared.decide(PREFILL, 3000, DECODE, 3000, 32, itl, 2048, shared_device=True, lender=lender()).kind == LENT
    assert shared.decide(PREFILL, 3000, DECODE, 3000, 32, itl, 2048, shared_device=True).kind == LOCAL_SHARED


def test_a_lent_prefill_is_measured_net_of_the_lenders_steps_it_rode():
    m = model()
    placement = Placement(LENT, predicted_ttft_s=0.2, ride_s=0.05)
    m.observe_prefill(LENDER, 1000, 0.25, placement)
    assert m.local_pace.s_per_token(LENDER) == pytest.approx(0.2e-3)  # its prefill pace as a lender
    assert m.pace.s_per_token(LENDER) == pytest.approx(0.25e-3)  # what its Prefill calls' timeouts allow
