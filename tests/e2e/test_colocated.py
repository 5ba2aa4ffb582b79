"""Conditional disaggregation end to end: a deployment with no prefill worker is a working
colocated server (the decode worker prefills every prompt itself), and a multi-turn chat's later
turns reuse what the decode worker holds: the previous turns are neither recomputed nor resent."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import SP, collect, free_blocks, shared_redis_cluster, wait_free_blocks

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # the workers' default


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url):
    with shared_redis_cluster(tmp_path_factory.mktemp("colocated"), "colocated", redis_url, num_prefill=0,
                              num_decode=1, kv_transport="auto",
                              env={"TANDEM_LOCAL_PREFILL_MAX_TOKENS": "256"}) as cluster:
        yield cluster


def test_decode_workers_alone_serve_greedy_output_equal_to_the_offline_engine(cluster):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    offline = LLM(max_model_len=2048, kv_cache_memory_bytes=64 << 20)
    expected = offline.generate(prompts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    before = free_blocks(cluster)
    for prompt, ref in zip(prompts, expected):
        out = collect(cluster.stub, gateway_pb2.GenerateRequest(prompt=prompt, sampling=SP(max_tokens=16, temperature=0)))
        assert out["samples"][0]["token_ids"] == ref.outputs[0].token_ids, prompt
    assert wait_free_blocks(cluster, before, within_s=3) == before


def test_a_chat_s_later_turns_reuse_the_decode_worker_s_blocks(cluster):
    """Four turns, each prompt the previous prompt + its answer + a new question (token ids, as
    the serving benchmark sends them): from turn 2 on, every full block of the previous turn whose
    KV was computed (its prompt and all but the last answer token, which was sampled and never
    fed back) is reported as cached prompt tokens."""
    stub = cluster.stub
    tokenize = lambda text: list(stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=text), timeout=10).token_ids)
    prompt = tokenize("Tell me about the history of printing, starting with the earliest techniques.")
    cached, expected = [], []
    for turn, question in enumerate(["What came next?", "Who improved it?", "Why did it matter?"] + [None]):
        out = collect(stub, gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=SP(max_tokens=48, temperature=0,
                                                                    ignore_eos=True)))
        if turn:
            cached.append(out["usage"].cached_prompt_tokens)
        if question is None:
            break
        answer = out["samples"][0]["token_ids"]
        expected.append((len(prompt) + len(answer) - 1) // BLOCK_SIZE * BLOCK_SIZE)
        prompt = prompt + answer + tokenize(" " + question)
    assert cached == expected
