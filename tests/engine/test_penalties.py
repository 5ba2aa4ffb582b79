"""Penalties and logit processing through the engine: greedy outputs change as each setting says,
a request's processing leaves its batch mates' outputs alone, async scheduling, preemption and a
prefill/decode split give the same tokens, and no state outlives its sequence; on the real
model, greedy decoding equals transformers' ``generate`` with its own logits processors."""

import dataclasses

import pytest
import torch

from engine import EngineConfig, EngineCore, SamplingParams
from tests.helpers.engine import prefill_then_decode, run_all
from tests.helpers.models import hf_greedy, load_hf_smollm2

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7, 8, 9, 10, 11, 12, 13], [40, 41]]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _engine(**config) -> EngineCore:
    return EngineCore(TINY, EngineConfig(block_size=8, **{"num_blocks": 128, **config}), load_format="dummy")


def _run_all(engine: EngineCore, requests: dict) -> dict[str, list[list[int]]]:
    """Each request's samples' tokens, the requests run together."""
    return {rid: [c.token_ids for c in out.outputs] for rid, out in run_all(engine, requests).items()}


@pytest.fixture(scope="module")
def engine():
    return _engine()


@pytest.fixture(scope="module")
def plain(engine):
    return _run_all(engine, {f"p{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)})


def test_the_dummy_model_repeats_itself_without_penalties(plain):
    # What the penalties below have to change: greedy on random weights loops.
    assert all(len(set(out[0])) < len(out[0]) for out in plain.values())


def test_logit_bias_forces_a_token(engine):
    out = _run_all(engine, {"b": (PROMPTS[0], dataclasses.replace(GREEDY, logit_bias={77: 100.0}))})
    assert out["b"][0] == [77] * GREEDY.max_tokens


def test_bad_words_never_appear(engine, plain):
    tokens = plain["p0"][0]
    single, pair = tokens[3], tokens[5:7]
    params = dataclasses.replace(GREEDY, bad_words_token_ids=[[single], pair])
    out = _run_all(engine, {"w": (PROMPTS[0], params)})["w"][0]
    assert out != tokens and single not in out
    assert all(out[i:i + 2] != pair for i in range(len(out) - 1))


def test_min_tokens_holds_back_the_stop_tokens(engine, plain):
    tokens = plain["p1"][0]
    first = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop = tokens[first]
    params = dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=[stop])
    assert _run_all(engine, {"s": (PROMPTS[1], params)})["s"][0] == tokens[:first + 1]
    held = _run_all(engine, {"m": (PROMPTS[1], dataclasses.replace(params, min_tokens=12))})["m"][0]
    assert len(held) >= 12 and stop not in held[:12]


def test_repetition_and_frequency_penalties_break_the_loops(engine, plain):
    for params in (dataclasses.replace(GREEDY, repetition_penalty=10.0),
                   dataclasses.replace(GREEDY, frequency_penalty=2.0, presence_penalty=2.0)):
        out = _run_all(engine, {f"p{i}": (p, params) for i, p in enumerate(PROMPTS)})
        for request_id, tokens in out.items():
            assert len(set(tokens[0])) == len(tokens[0]), request_id  # no token twice


PROCESSED = {
    "rep": dataclasses.replace(GREEDY, repetition_penalty=1.8),
    "freq": dataclasses.replace(GREEDY, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={3: 2.0}),
    "words": dataclasses.replace(GREEDY, bad_words_token_ids=[[5, 6], [9]], min_tokens=4, stop_token_ids=[11],
                                 ignore_eos=False),
    "seeded": SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2, frequency_penalty=1.0, ignore_eos=True),
}


def _processed_requests() -> dict:
    return {f"{name}-{i}": (p, params) for name, params in PROCESSED.items() for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def processed(engine):
    return _run_all(engine, _processed_requests())


def test_a_processed_request_leaves_its_batch_mates_alone(engine, plain, processed):
    mixed = _run_all(engine, {**{f"p{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}, **_processed_requests()})
    assert {k: v for k, v in mixed.items() if k.startswith("p")} == plain
    assert {k: v for k, v in mixed.items() if not k.startswith("p")} == processed
    assert engine.runner.logits.num_sequences == 0


def test_async_scheduling_gives_the_same_tokens(processed):
    engine = _engine(async_scheduling=True)
    assert _run_all(engine, _processed_requests()) == processed
    assert engine.runner.logits.num_sequences == 0


def test_preemption_rebuilds_the_state_exactly(processed):
    engine = _engine(num_blocks=20)
    free = engine.num_free_blocks
    assert _run_all(engine, _processed_requests()) == processed
    assert engine.stats().num_preemptions > 0
    assert engine.runner.logits.num_sequences == 0
    assert engine.runner.logits.penalties.num_free == engine.runner.logits.penalties.capacity
    assert engine.num_free_blocks == free


def test_prefill_then_decode_continues_the_counts(processed):
    prefill, decode = _engine(), _engine()
    for request_id, (prompt, params) in _processed_requests().items():
        split = prefill_then_decode(prefill, decode, request_id, prompt, params)
        assert [c.token_ids for c in split.outputs] == processed[request_id], request_id
    assert prefill.runner.logits.num_sequences == 0 and decode.runner.logits.num_sequences == 0


def test_an_abort_frees_the_slots(engine):
    engine.add_request("a", PROMPTS[0], PROCESSED["seeded"])
    for _ in range(3):
        engine.step()
    assert engine.runner.logits.num_sequences == 2
    engine.abort_request("a")
    assert engine.runner.logits.num_sequences == 0


def test_validate_refuses_tokens_outside_the_vocabulary(engine):
    for params, field in ((SamplingParams(logit_bias={256: 1.0}), "logit_bias"),
                          (SamplingParams(bad_words_token_ids=[[1, 999]]), "bad_words_token_ids")):
        with pytest.raises(ValueError, match=f"^{field} has"):
            engine.add_request("x", PROMPTS[0], params)
    assert not engine.has_unfinished_requests


# ------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def real():
    return EngineCore(None, EngineConfig(quantization="none", num_blocks=256)), load_hf_smollm2()


REAL_PROMPT = "List the colors of the rainbow, then list them again:"


def _hf_generate(model, prompt_ids: list[int], **processors) -> list[int]:
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=32, do_sample=False, pad_token_id=0, **processors)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["repetition_penalty", "min_tokens", "bad_words", "logit_bias"])
def test_greedy_equals_transformers_generate_with_its_processors(real, name):
    engine, (hf, tokenizer) = real
    prompt = tokenizer.encode(REAL_PROMPT, add_special_tokens=False)
    plain = hf_greedy(hf, prompt, 32)
    eos = tokenizer.eos_token_id
    if name == "repetition_penalty":
        params, processors = SamplingParams(repetition_penalty=1.4), {"repetition_penalty": 1.4, "eos_token_id": None}
    elif name == "min_tokens":
        stop = plain[4]  # a token the plain output has early: held back until the 10th
        params = SamplingParams(min_tokens=10, stop_token_ids=[stop], ignore_eos=False)
        processors = {"min_new_tokens": 10, "eos_token_id": [eos, stop]}
    elif name == "bad_words":
        words = [[plain[1]], plain[5:7]]
        params, processors = SamplingParams(bad_words_token_ids=words), {"bad_words_ids": words, "eos_token_id": None}
    else:
        bias = {plain[2]: -5.0, plain[3]: 3.0}
        params = SamplingParams(logit_bias=bias)
        processors = {"sequence_bias": {(t,): b for t, b in bias.items()}, "eos_token_id": None}
    expected = _hf_generate(hf, prompt, **processors)
    assert expected != plain  # the processor changed the output
    params = dataclasses.replace(params, max_tokens=32, temperature=0,
                                 ignore_eos=params.ignore_eos or name != "min_tokens")
    out = _run_all(engine, {name: (prompt, params)})[name][0]
    if name == "min_tokens":
        out = out[:len(expected)]
    assert out == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_with_async_scheduling_and_cuda_graphs(plain):
    """The default CUDA engine (async scheduling: a step's counts are read by the step launched
    before its tokens reach the host; decode CUDA graphs, the processing eager after them)."""
    engine = _engine(device="cuda", dtype="float32")
    assert engine.async_scheduling and engine.runner.graphs is not None
    requests = {"bias": (PROMPTS[0], dataclasses.replace(GREEDY, logit_bias={77: 100.0})),
                **{f"rep{i}": (p, dataclasses.replace(GREEDY, repetition_penalty=10.0)) for i, p in enumerate(PROMPTS)},
                **{f"freq{i}": (p, dataclasses.replace(GREEDY, frequency_penalty=2.0, presence_penalty=2.0))
                   for i, p in enumerate(PROMPTS)},
                **_processed_requests()}
    out = _run_all(engine, requests)
    assert out["bias"][0] == [77] * GREEDY.max_tokens
    for request_id, tokens in out.items():
        if request_id.startswith(("rep", "freq")):
            assert len(set(tokens[0])) == len(tokens[0]), request_id
    words = out["words-1"][0]
    assert 9 not in words and all(words[i:i + 2] != [5, 6] for i in range(len(words) - 1))
    assert engine.runner.logits.num_sequences == 0
