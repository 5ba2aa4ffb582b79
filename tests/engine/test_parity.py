"""Greedy output equals Hugging Face transformers token for token on the real model (fp32, CPU)."""

import pytest

from engine import LLM, SamplingParams
from tests.helpers.models import hf_greedy
from tests.helpers.prompts import CHATS, MAX_NEW_TOKENS, PLAIN_PROMPTS, SHARED_PREFIX_CHATS

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(hf_model):
    """Token ids of 10 prompts (plain, chat, chat with a shared long system prompt)."""
    _, tokenizer = hf_model
    plain = [tokenizer.encode(p, add_special_tokens=False) for p in PLAIN_PROMPTS]
    chats = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False) for c in CHATS + SHARED_PREFIX_CHATS]
    ids = plain + chats
    assert len({len(p) for p in ids}) >= 6, "prompts should have different lengths"
    return ids


@pytest.fixture(scope="module")
def expected(hf_model, prompts):
    model, _ = hf_model
    return [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts]


def _generate(llm: LLM, prompts, params=GREEDY):
    free_before = llm.engine.num_free_blocks
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_free_blocks == free_before, "blocks leaked"
    llm.engine.block_pool.check_invariants()
    return outs


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_batched_greedy_matches_hf(block_size, prompts, expected):
    llm = LLM(quantization="none", block_size=block_size, num_blocks=4096 // block_size * 4)
    outs = _generate(llm, prompts)
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == ref
        assert len(ref) == MAX_NEW_TOKENS
        assert out.outputs[0].finish_reason == "length"


def test_chunked_prefill_matches_hf(prompts, expected):
    llm = LLM(quantization="none", block_size=16, max_num_batched_tokens=24)
    outs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_preemption_matches_hf(prompts, expected):
    # 10 sequences of up to ~140 tokens need ~80 blocks of 16; 30 force preemption.
    llm = LLM(quantization="none", block_size=16, num_blocks=30)
    outs = _generate(llm, prompts)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_prefix_cache_hits_keep_outputs(prompts, expected):
    llm = LLM(quantization="none", block_size=16)
    first, second = prompts[6:8], prompts[8:10]
    outs = _generate(llm, first)
    assert all(o.num_cached_tokens == 0 for o in outs)
    outs += _generate(llm, second)
    assert all(o.num_cached_tokens >= 48 for o in outs[2:]), [o.num_cached_tokens for o in outs]
    assert llm.engine.stats().prefix_cache_hit_rate > 0
    assert [o.outputs[0].token_ids for o in outs] == expected[6:10]
