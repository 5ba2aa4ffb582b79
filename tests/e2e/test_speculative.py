"""Speculative decoding across the split, real processes: a gateway, one prefill worker and two
decode workers that speculate (n-gram, ``TANDEM_SPECULATIVE_CONFIG``) on loopback, float32 weights
(``EXACT_RESUME``: a resumed stream re-prefills what was decoded before it).

What must hold: the prefill worker computes prompts as before (it drafts nothing) and the decode
workers verify drafts (their accepted-token counters grow); a client's greedy output equals the
offline engine's without speculation, token for token, and a request can turn speculation off
for itself (``num_speculative_tokens`` 0); a stream whose decode worker is killed
mid-stream goes on on the other one, and its output still equals it; every block comes back.
"""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import (
    EXACT_RESUME, SP, collect, counter, settled_free_blocks, shared_redis_cluster,
    stream_killing_its_decode_worker, wait_free_blocks,
)
from tests.helpers.prompts import GROUNDED_CHATS

pytestmark = pytest.mark.slow
MAX_TOKENS = 48
SPECULATIVE = {"TANDEM_SPECULATIVE_CONFIG": json.dumps({"method": "ngram", "num_speculative_tokens": 3})}
LIVENESS = {"TANDEM_KEEPALIVE_TIME_S": "1", "TANDEM_KEEPALIVE_TIMEOUT_S": "1",
            "TANDEM_HEALTH_PROBE_INTERVAL_S": "0.5", "TANDEM_HEALTH_PROBE_TIMEOUT_S": "1",
            "TANDEM_HOP_TIMEOUT_S": "8", "TANDEM_DECODE_STALL_TIMEOUT_S": "5", "TANDEM_OUTLIER_BASE_EJECTION_S": "2"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url):
    env = {**LIVENESS, **EXACT_RESUME, "TANDEM_PREFILL_PLACEMENT": "static"}  # every prompt from the prefill worker
    with shared_redis_cluster(tmp_path_factory.mktemp("speculative"), "speculative", redis_url, num_prefill=1,
                              num_decode=2, kv_transport="grpc", env=env,
                              worker_env={"decode-0": SPECULATIVE, "decode-1": SPECULATIVE}) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference() -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy output) of each grounded chat on the offline engine without speculation,
    float32 weights as the workers'."""
    llm = LLM(quantization="none", max_model_len=2048, kv_cache_memory_bytes=64 << 20)
    prompts = [llm.engine.tokenizer.apply_chat_template(chat) for chat in GROUNDED_CHATS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    return [(prompt, list(out.outputs[0].token_ids)) for prompt, out in zip(prompts, outs)]


def _request(prompt: list[int], **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                       sampling=SP(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **sampling))


def _decode_counter(cluster, name: str) -> float:
    return sum(counter(cluster, worker, name) for worker in ("decode-0", "decode-1"))


def test_decode_workers_speculate_and_greedy_output_equals_no_speculation(cluster, reference):
    before = settled_free_blocks(cluster, within_s=10)
    accepted = _decode_counter(cluster, "tandem_spec_decode_accepted_tokens")
    for prompt, expected in reference:
        assert collect(cluster.stub, _request(prompt))["samples"][0]["token_ids"] == expected
    assert _decode_counter(cluster, "tandem_spec_decode_accepted_tokens") - accepted >= MAX_TOKENS // 2  # the answers copy their passages
    assert counter(cluster, "prefill-0", "tandem_spec_decode_draft_tokens") == 0
    assert wait_free_blocks(cluster, before, within_s=5) == before


def test_a_request_turns_speculation_off_for_itself(cluster, reference):
    """``SamplingParams.num_speculative_tokens`` 0 reaches the decode worker: no drafts, the same output."""
    prompt, expected = reference[0]
    drafted = _decode_counter(cluster, "tandem_spec_decode_draft_tokens")
    assert collect(cluster.stub, _request(prompt, num_speculative_tokens=0))["samples"][0]["token_ids"] == expected
    assert _decode_counter(cluster, "tandem_spec_decode_draft_tokens") == drafted


def test_a_speculating_stream_whose_decode_worker_dies_is_resumed_exactly(cluster, reference):
    prompt, expected = reference[0]
    before = settled_free_blocks(cluster, within_s=10)
    seen = stream_killing_its_decode_worker(cluster, _request(prompt), after_tokens=8)
    assert seen.victim is not None and seen.code == "OK"
    assert seen.token_ids == expected and seen.usage.completion_tokens == MAX_TOKENS
    survivors = {name: blocks for name, blocks in before.items() if name != seen.victim}
    assert wait_free_blocks(cluster, survivors, within_s=5) == survivors
