"""Tensor parallelism on the CPU (gloo): one process per rank, rank 0 schedules and broadcasts
each step. A TP=2 engine's greedy tokens and log-probabilities equal TP=1's, through chunked
prefill, prefix-cache hits, forked samples and preemption; a size that does not divide the
heads is refused before any process starts; a rank that dies fails the engine's next step
instead of hanging it."""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine import LLM, EngineConfig, EngineCore, SamplingParams
from engine.parallel.distributed import RankFailedError

from tests.helpers.models import save_tiny_llama

PROMPTS = [[1, 5, 7, 9, 11, 2, 3], [4, 4, 4, 4, 90, 91, 92, 17, 3, 2, 1, 5, 6, 7, 8, 9, 10, 11, 12, 13],
           [60, 61, 62, 63] * 9, [60, 61, 62, 63] * 9 + [5, 6]]  # the last two share a prefix


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    # vocab 97: the last rank's half of the embedding and head is padded
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=97)


def run(model: str, tp: int, prompts, params, kv_cache_dtype: str = "auto") -> list:
    # few blocks and a small token budget: chunked prefill, prefix hits and preemption all happen
    llm = LLM(model, block_size=8, num_blocks=20, max_num_batched_tokens=16, tensor_parallel_size=tp,
              kv_cache_dtype=kv_cache_dtype)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.num_free_blocks == 20 and llm.engine.scheduler.num_preemptions > 0
        return outputs
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])  # fp8: the ranks' pools shared as float8
def test_tp2_tokens_and_logprobs_equal_tp1(tiny_llama: str, kv_cache_dtype: str) -> None:
    params = [SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True)] * len(PROMPTS)
    params.append(SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=2, ignore_eos=True))  # forked samples
    prompts = [*PROMPTS, PROMPTS[1]]
    one, two = (run(tiny_llama, tp, prompts, params, kv_cache_dtype) for tp in (1, 2))
    for a, b in zip(one, two):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            for lp_x, lp_y in zip(x.logprobs, y.logprobs):
                assert lp_x.keys() == lp_y.keys()
                assert all(abs(lp_x[t] - lp_y[t]) < 1e-4 for t in lp_x)


@pytest.mark.slow
def test_tp2_with_a_draft_model_equals_tp1_without_speculation(tiny_llama: str) -> None:
    """The draft (here the target itself, whole) runs on rank 0 beside its shard; its drafts
    are verified by both ranks: greedy tokens as without speculation, nearly every draft kept,
    every block back."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    answers, spec_stats = {}, None
    for tp, spec in ((1, None), (2, {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3})):
        llm = LLM(tiny_llama, block_size=8, num_blocks=40, max_num_batched_tokens=16, tensor_parallel_size=tp,
                  speculative_config=spec)
        try:  # one prompt at a time: on the CPU speculation stops above two running sequences
            answers[tp] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
            spec_stats = llm.engine.stats().spec_decoding
            assert llm.engine.num_free_blocks == 40
        finally:
            llm.engine.shutdown()
    assert answers[2] == answers[1]
    assert spec_stats.num_draft_tokens > 0, spec_stats
    assert spec_stats.num_accepted_tokens / spec_stats.num_draft_tokens > 0.9, spec_stats


def test_size_that_does_not_divide_the_heads_is_refused(tiny_llama: str) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide .*num_attention_heads=4"):
        EngineCore(tiny_llama, EngineConfig(num_blocks=8, tensor_parallel_size=3))


@pytest.mark.slow
def test_a_dead_rank_fails_the_next_step_and_never_hangs(tiny_llama: str) -> None:
    engine = EngineCore(tiny_llama, EngineConfig(block_size=8, num_blocks=16, tensor_parallel_size=2))
    try:
        engine.add_request("r", list(range(1, 30)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        engine.step()
        follower = engine.ranks._procs[0]
        os.kill(follower.pid, 9)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1"):
            while time.monotonic() - start < 30:
                engine.step()
        assert time.monotonic() - start < 10  # the dead rank is noticed at once, not after a timeout
        with pytest.raises(RankFailedError):
            engine.step()
    finally:
        started = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - started < 5
    assert follower.poll() is not None


@pytest.mark.slow
def test_tp3_on_the_default_model_equals_tp1() -> None:
    """SmolLM2-135M (dequantized) has 9 query and 3 KV heads: three ranks (TP=1 itself matches transformers:
    tests/engine/test_parity.py)."""
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write a haiku about autumn leaves."}]]
    params = SamplingParams(max_tokens=16, temperature=0)
    outputs = []
    for tp in (1, 3):
        llm = LLM(None, num_blocks=64, tensor_parallel_size=tp, quantization="none")
        try:
            outputs.append([o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_llama3_8b_bf16_greedy_agrees_with_tp1() -> None:
    """Random-weight Llama-3-8B in bfloat16, 64 prompts x 64 greedy tokens (bench/tensor_parallel.py):
    TP=2 (NCCL all-reduces, captured in the decode CUDA graphs) against
    TP=1, judged against TP=1 against itself run one prompt at a time (the bfloat16 noise of a
    different batching). Random weights' logits are near-flat, so a rounding difference soon
    flips a near-tie and the sequences part: every first disagreement must be a near-tie (each
    side's token in the other's top 5: a mis-sharded weight gives unrelated tokens), the
    log-probabilities before it as close as the control's, and agreement of the control's order."""
    from bench.agreement import agreement
    from bench.tensor_parallel import run_setting

    one, two = run_setting(1, agreement_only=True), run_setting(2, agreement_only=True)
    assert two["cuda_graphs"] > 0 and not two["shutdown_hung"] and not one["shutdown_hung"]
    tp2, control = agreement(one["greedy"], two["greedy"]), agreement(one["greedy"], one["greedy_single"])
    assert tp2["disagreements_in_top5"] == 1.0, (tp2, control)
    assert tp2["mean_logprob_diff"] <= 2 * control["mean_logprob_diff"] + 0.01, (tp2, control)
    assert tp2["agreement"] >= 0.5 * control["agreement"], (tp2, control)