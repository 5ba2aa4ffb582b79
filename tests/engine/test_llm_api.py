"""Offline API behaviour on the real model: sampling, n, stop conditions, validation, no leaks."""

import pytest

from engine import LLM, SamplingParams
from tests.helpers.prompts import CHATS

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown fox", "Once upon a time, in a small village,", "import numpy as np\n"]


@pytest.fixture(scope="module")
def llm():
    return LLM(block_size=16, num_blocks=256)


@pytest.fixture(autouse=True)
def no_leaks(llm):
    free = llm.engine.num_free_blocks
    yield
    assert llm.engine.num_free_blocks == free, "blocks leaked"
    assert not llm.engine.requests and not llm.engine.pinned
    llm.engine.block_pool.check_invariants()


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seeded_sampling_is_reproducible_regardless_of_batch_mates(llm):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    mates = [SamplingParams(max_tokens=30, temperature=1.2), SamplingParams(max_tokens=10, temperature=0.7)]
    batched = llm.generate(PROMPTS, [params, *mates], use_tqdm=False)
    assert _tokens(alone)[0] == _tokens(batched)[0]
    other_seed = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99), use_tqdm=False)
    assert _tokens(other_seed) != _tokens(alone)


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=1.5, top_k=1), use_tqdm=False)
    assert _tokens(greedy) == _tokens(top1)


def test_n_samples_share_prompt_blocks(llm):
    prompt = "Write a short poem about the ocean. " * 6  # several full blocks
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=4)
    free = engine.num_free_blocks
    engine.add_request("shared", prompt, params)
    while engine.requests["shared"].seqs[1].block_table == []:
        engine.step()
    used_by_n = free - engine.num_free_blocks
    engine.abort_request("shared")

    independent = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    engine.kv_manager.enable_prefix_caching = False
    try:
        for i in range(4):
            engine.add_request(f"solo-{i}", prompt, independent)
        engine.step()
        used_by_four = free - engine.num_free_blocks
    finally:
        for i in range(4):
            engine.abort_request(f"solo-{i}")
        engine.kv_manager.enable_prefix_caching = True
    prompt_blocks = len(engine.tokenize(prompt)) // 16
    assert used_by_four - used_by_n >= 3 * prompt_blocks, (used_by_n, used_by_four)


def test_n_samples_are_distinct_and_complete(llm):
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3), use_tqdm=False)
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_string_cuts_text(llm):
    greedy = llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0]
    text = greedy.outputs[0].text
    stop = text[10:14]
    assert stop.strip(), text
    out = llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=40, temperature=0, stop=[stop]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]


def test_stop_token_ids_and_eos(llm):
    chat = llm.chat(CHATS[0], SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)[0]
    completion = chat.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] in llm.engine.eos_token_ids
    assert "Paris" in completion.text
    second = completion.token_ids[1]
    out = llm.chat(CHATS[0], SamplingParams(max_tokens=64, temperature=0, stop_token_ids=[second]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == completion.token_ids[:2]
    assert out.outputs[0].stop_reason == second


def test_logprobs_returns_top_n(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, temperature=0, logprobs=3), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and len(entry) == 3
        assert entry[token] == max(entry.values()) <= 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_nothing(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([PROMPTS[0], ""], SamplingParams(max_tokens=4), use_tqdm=False)
    too_long = [1] * llm.engine.max_model_len
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([too_long], SamplingParams(max_tokens=4), use_tqdm=False)


def test_unknown_model_names_the_field():
    with pytest.raises(ValueError, match="model"):
        LLM(model="no-such-preset-or-path")
