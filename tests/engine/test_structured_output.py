"""Structured output through the engine (a tiny random model with a character tokenizer): every
kind's output follows its spec; a bad spec is refused before anything is queued; the output is
the same under async scheduling, preemption, across a prefill/decode split and when resumed after
the tokens already sent; the matchers are freed with their sequences."""

import dataclasses
import json
import re

import jsonschema
import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from engine.sampling_params import StructuredOutput
from tests.helpers.engine import prefill_then_decode, run_all, run_until_finished
from tests.helpers.models import save_tiny_llama_with_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
          "required": ["name", "age"]}
SPECS = {
    "json_schema": StructuredOutput(json_schema=json.dumps(SCHEMA)),
    "json_object": StructuredOutput(json_object=True),
    "regex": StructuredOutput(regex=r"[a-c]{2,4}-\d{3}"),
    "choice": StructuredOutput(choice=["yes", "no", "maybe \"so\""]),
    "grammar": StructuredOutput(grammar='root ::= "(" item ("," item)? ")"\nitem ::= [a-z] | [0-9] [0-9]?'),
}
# The specs whose outputs have a bounded length (a random model's samples wander up to it).
BOUNDED = ("json_schema", "regex", "choice", "grammar")
PROMPTS = ["hello there", "what is it?", "Describe: a cat"]


def follows(kind: str, spec: StructuredOutput, text: str) -> bool:
    """Whether ``text`` (EOS dropped) is an output ``spec`` allows."""
    if kind in ("json_schema", "json_object"):
        value = json.loads(text)
        jsonschema.validate(value, json.loads(spec.json_schema) if spec.json_schema else {"type": "object"})
        return True
    if kind == "regex":
        return re.fullmatch(spec.regex, text) is not None
    if kind == "choice":
        return text in spec.choice
    return re.fullmatch(r"\((?:[a-z]|[0-9]{1,2})(?:,(?:[a-z]|[0-9]{1,2}))?\)", text) is not None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny"))


def _engine(model_dir, **config) -> EngineCore:
    return EngineCore(model_dir, EngineConfig(block_size=8, **{"num_blocks": 128, **config}))


def _text(engine: EngineCore, token_ids: list[int]) -> str:
    return engine.tokenizer.decode([t for t in token_ids if t not in engine.eos_token_ids])


def _requests(temperature: float = 0.0, n: int = 1, kinds=tuple(SPECS), **extra) -> dict:
    return {f"{kind}-{i}": (prompt, SamplingParams(max_tokens=96, temperature=temperature, seed=7, n=n,
                                                   structured_output=SPECS[kind], **extra))
            for kind in kinds for i, prompt in enumerate(PROMPTS)}


def _outputs(done: dict) -> dict:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in done.items()}


@pytest.fixture(scope="module")
def reference(model_dir):
    """Every spec's outputs on a synchronous engine, greedy and sampled (n=2)."""
    engine = _engine(model_dir)
    return _outputs(run_all(engine, _requests())), _outputs(run_all(engine, _requests(1.0, n=2, kinds=BOUNDED)))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_kind_follows_its_spec(model_dir, reference, sampled):
    engine = _engine(model_dir)
    for request_id, samples in reference[sampled].items():
        kind = request_id.rsplit("-", 1)[0]
        for tokens in samples:
            text = _text(engine, tokens)
            assert tokens[-1] in engine.eos_token_ids, (request_id, text)  # ended where the structure is complete
            assert follows(kind, SPECS[kind], text), (request_id, text)


def test_async_scheduling_gives_the_same_outputs_and_frees_everything(model_dir, reference):
    engine = _engine(model_dir, async_scheduling=True)
    assert engine.async_scheduling
    free = engine.num_free_blocks
    requests = {**_requests(), "plain": ("plain text", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))}
    done = _outputs(run_all(engine, requests))
    assert {k: v for k, v in done.items() if k != "plain"} == reference[0]
    sampled = _outputs(run_all(engine, _requests(1.0, n=2, kinds=BOUNDED)))
    assert sampled == reference[1]
    assert engine.runner.logits.num_sequences == 0 and engine.runner.logits.num_structured == 0
    assert engine.num_free_blocks == free


def test_a_structured_request_leaves_its_batch_mates_alone(model_dir):
    engine = _engine(model_dir, async_scheduling=True)
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = _outputs(run_all(engine, {"p": ("plain text", plain)}))["p"]
    together = _outputs(run_all(engine, {"p": ("plain text", plain), **_requests()}))
    assert together["p"] == alone


def test_preempted_sequences_rebuild_their_matchers_exactly(model_dir, reference):
    engine = _engine(model_dir, num_blocks=24)
    done = run_all(engine, _requests())
    assert engine.stats().num_preemptions > 0
    assert _outputs(done) == reference[0]
    assert engine.runner.logits.num_sequences == 0


def test_prefill_then_decode_continues_the_grammar(model_dir, reference):
    prefill, decode = _engine(model_dir), _engine(model_dir)
    for i, (request_id, (prompt, params)) in enumerate(_requests().items()):
        split = prefill_then_decode(prefill, decode, f"d{i}", prompt, params)
        assert [c.token_ids for c in split.outputs] == reference[0][request_id]
    assert decode.runner.logits.num_sequences == 0 and prefill.runner.logits.num_sequences == 0


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_a_resumed_stream_continues_where_it_stopped(model_dir, kind):
    """The prompt followed by the tokens already sent, counted as output, goes on exactly."""
    engine = _engine(model_dir)
    prompt, params = _requests(frequency_penalty=0.5)[f"{kind}-0"]
    full = _outputs(run_all(engine, {"full": (prompt, params)}))["full"][0]
    assert len(full) > 6
    sent = full[:len(full) // 2]
    ids = engine.tokenize(prompt) + sent
    resumed = dataclasses.replace(params, max_tokens=params.max_tokens - len(sent), num_resumed_tokens=len(sent))
    rest = _outputs(run_all(engine, {"rest": (ids, resumed)}))["rest"][0]
    assert sent + rest == full


@pytest.mark.parametrize("spec, field", [
    (StructuredOutput(json_schema='{"type": "integer", "minimum": 5, "maximum": 1}'), "json_schema"),
    (StructuredOutput(json_schema='{"type": "nope"}'), "json_schema"),
    (StructuredOutput(regex="(?<=a)b"), "regex"),
    (StructuredOutput(grammar='root ::= undefined_rule'), "grammar"),
    (StructuredOutput(grammar='start ::= "a"'), "grammar"),
])
def test_a_spec_xgrammar_refuses_is_refused_before_anything_is_queued(model_dir, spec, field):
    engine = _engine(model_dir)
    free = engine.num_free_blocks
    params = SamplingParams(structured_output=spec)
    with pytest.raises(ValueError, match=f"^{field} is not valid: "):
        engine.reserve_blocks(engine.tokenize("hi there"), params=params)
    with pytest.raises(ValueError, match=f"^{field} is not valid: "):
        engine.add_request("bad", "hi there", params)
    assert not engine.has_unfinished_requests and engine.num_free_blocks == free


@pytest.mark.parametrize("kwargs, field", [
    ({}, "structured_output"), ({"regex": "a", "grammar": 'root ::= "a"'}, "structured_output"),
    ({"json_schema": "{not json"}, "json_schema"), ({"json_schema": "[1]"}, "json_schema"),
    ({"choice": ["a", ""]}, "choice"),
])
def test_a_malformed_spec_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        StructuredOutput(**kwargs)


def test_a_first_token_outside_the_grammar_is_refused(model_dir):
    engine = _engine(model_dir)
    ids = engine.tokenize("hi")
    blocks, _ = engine.reserve_blocks(ids)
    params = SamplingParams(structured_output=SPECS["choice"])
    with pytest.raises(ValueError, match="^first_token_ids "):
        engine.add_prefilled_request("r", ids, engine.tokenize("x"), params, blocks)
    engine.free_blocks(blocks)
    resumed = dataclasses.replace(params, num_resumed_tokens=2)
    with pytest.raises(ValueError, match="^prompt_token_ids "):
        engine.add_request("r", ids + engine.tokenize("zz"), resumed)


def test_the_structure_wins_over_min_tokens_and_ignore_eos(model_dir):
    """min_tokens would ban EOS where the choice is complete, and ignore_eos goes on past it:
    the output is still the choice, EOS after it."""
    engine = _engine(model_dir)
    params = SamplingParams(max_tokens=12, temperature=0, min_tokens=8, ignore_eos=True,
                            structured_output=SPECS["choice"])
    out = run_until_finished(engine, (engine.add_request("r", "hi", params), "r")[1])
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 12 and out.outputs[0].finish_reason == "length"
    assert _text(engine, tokens) in SPECS["choice"].choice
    text_end = next(i for i, t in enumerate(tokens) if t in engine.eos_token_ids)
    assert all(t in engine.eos_token_ids for t in tokens[text_end:])
    assert engine.runner.logits.num_sequences == 0


def test_aborted_and_stopped_samples_free_their_matchers(model_dir):
    engine = _engine(model_dir, async_scheduling=True)
    for request_id, (prompt, params) in _requests(1.0, n=2, kinds=BOUNDED).items():
        engine.add_request(request_id, prompt, params)
    for _ in range(4):
        engine.step()
    assert engine.runner.logits.num_structured > 0
    engine.stop_sample("regex-0", 1, "stop string")
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_steps_in_flight:
        engine.step()
    assert engine.runner.logits.num_sequences == 0 and engine.runner.logits.num_structured == 0


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_with_async_scheduling_and_cuda_graphs(model_dir):
    """The default CUDA engine (async scheduling, decode CUDA graphs): every kind follows its
    spec, sampled and greedy, beside penalized and plain requests, and nothing is left held."""
    engine = _engine(model_dir, device="cuda")
    assert engine.async_scheduling and engine.runner.graphs is not None
    free = engine.num_free_blocks
    requests = {**_requests(), **{f"s{k}": v for k, v in _requests(1.0, n=2, kinds=BOUNDED).items()},
                "plain": ("plain text", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
                "forced": ("plain text", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                        logit_bias={7: 100.0}, frequency_penalty=1.0))}
    done = _outputs(run_all(engine, requests))
    for request_id, samples in done.items():
        if request_id in ("plain", "forced"):
            continue
        kind = request_id.removeprefix("s").rsplit("-", 1)[0]
        for tokens in samples:
            assert tokens[-1] in engine.eos_token_ids and follows(kind, SPECS[kind], _text(engine, tokens)), request_id
    assert done["forced"][0] == [7] * 20
    assert engine.runner.logits.num_sequences == 0 and engine.num_free_blocks == free
