"""Async scheduling on the CPU (forced on: each step launched before the last one's tokens are
processed, its decodes reading their input token from the device): every output equals a
synchronous engine's, through preemption, forked samples, stop tokens, logprobs, aborts and
pinned prompt blocks, and every block comes back."""

from __future__ import annotations

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from tests.helpers.models import save_tiny_llama, tokens


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=512)


def engine(model: str, async_scheduling: bool, num_blocks: int = 64) -> EngineCore:
    return EngineCore(model, EngineConfig(block_size=8, num_blocks=num_blocks, max_num_batched_tokens=32,
                                          async_scheduling=async_scheduling))


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]], abort: dict[str, int] = {}):
    """Every request to its end (``abort``: request id → abort once it has that many tokens); the
    final outputs by id, as (token ids, finish reason, logprobs) per sample."""
    free = core.num_free_blocks
    for request_id, (prompt, params) in requests.items():
        core.add_request(request_id, prompt, params)
    done = {}
    while core.has_unfinished_requests or core.has_steps_in_flight:
        for out in core.step().outputs:
            if out.request_id in abort and not out.finished and len(out.outputs[0].token_ids) >= abort[out.request_id]:
                out = core.abort_request(out.request_id)
            if out.finished:
                done[out.request_id] = [(list(c.token_ids), c.finish_reason, list(c.logprobs)) for c in out.outputs]
    assert core.num_free_blocks == free
    return done


REQUESTS = {
    "greedy": (tokens(20, 1), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2)),
    "forked": (tokens(13, 2), SamplingParams(max_tokens=17, temperature=0.9, seed=4, n=3, ignore_eos=True)),
    "seeded": (tokens(40, 3), SamplingParams(max_tokens=25, temperature=1.0, top_k=10, seed=9, ignore_eos=True)),
    "short": (tokens(5, 4), SamplingParams(max_tokens=1, temperature=0)),
    "stops": (tokens(9, 5), SamplingParams(max_tokens=40, temperature=1.0, seed=3, stop_token_ids=list(range(0, 96, 3)))),
}


def test_async_scheduling_equals_synchronous_scheduling(tiny_llama):
    sync, overlapped = engine(tiny_llama, False), engine(tiny_llama, True)
    assert overlapped.async_scheduling and not sync.async_scheduling
    expected = run(sync, REQUESTS)
    assert expected["stops"][0][1] == "stop"  # a stop token ended it mid-way
    assert run(overlapped, REQUESTS) == expected


def test_async_scheduling_through_preemption(tiny_llama):
    """A pool too small for the batch preempts the newest sequences, which are recomputed: the
    outputs stay those of a synchronous engine with the same pool."""
    requests = {f"r{i}": (tokens(24 + i, 10 + i), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for i in range(6)}
    sync, overlapped = engine(tiny_llama, False, num_blocks=28), engine(tiny_llama, True, num_blocks=28)
    expected = run(sync, requests)
    assert run(overlapped, requests) == expected
    assert sync.scheduler.num_preemptions > 0 and overlapped.scheduler.num_preemptions > 0


def test_an_abort_while_its_step_is_in_flight_loses_nothing_else(tiny_llama):
    overlapped = engine(tiny_llama, True)
    done = run(overlapped, REQUESTS, abort={"greedy": 5})
    [(aborted, reason, _)] = done["greedy"]
    assert reason == "abort" and len(aborted) >= 5
    alone = run(engine(tiny_llama, False), {k: v for k, v in REQUESTS.items() if k != "greedy"})
    assert done.keys() - {"greedy"} == alone.keys()
    for request_id, samples in alone.items():  # another batch: float32 logprobs move in the last bits
        for (ids, reason, logprobs), (got_ids, got_reason, got_logprobs) in zip(samples, done[request_id]):
            assert (got_ids, got_reason) == (ids, reason)
            assert all(g.keys() == e.keys() and all(abs(g[t] - e[t]) < 1e-4 for t in e)
                       for g, e in zip(got_logprobs, logprobs))


def test_prompt_blocks_are_pinned_once_their_step_has_completed(tiny_llama):
    """A prefill worker's request (its prompt blocks pinned for a transfer, one output token)
    pins every prompt block, in order, once, and samples nothing past its one token."""
    overlapped = engine(tiny_llama, True)
    prompt = tokens(70, 7)
    overlapped.add_request("prefill", prompt, SamplingParams(max_tokens=1, temperature=0), pin_prompt_blocks=True)
    pinned, final = [], None
    while overlapped.has_unfinished_requests or overlapped.has_steps_in_flight:
        for out in overlapped.step().outputs:
            assert out.pinned_block_ids[:len(pinned)] == pinned  # grows, never rewritten
            pinned, final = list(out.pinned_block_ids), out
    assert final.finished and len(final.outputs[0].token_ids) == 1
    assert len(pinned) == -(-len(prompt) // 8) == len(set(pinned))
    free = overlapped.num_free_blocks
    assert overlapped.release("prefill") and overlapped.num_free_blocks == free + len(pinned)
