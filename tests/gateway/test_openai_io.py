"""The one mapping of an OpenAI request onto the native request, and the renaming of native
field names in refusals: every field the engine serves lands on its native field (vLLM's extras
and structured outputs too), unknown fields are ignored, malformed values are refused naming
the OpenAI field."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.frontend import renamed
from gateway.openai_io import CHAT_NAMES, COMPLETION_NAMES, generate_request
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from protos.status import StatusError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def native(request):
    """The native request alone (``generate_request`` also returns its renames)."""
    return generate_request(request, "r")[0]


def test_served_fields_land_on_the_native_request():
    request, _ = generate_request(chat(max_completion_tokens=7, n=2, stop="x", seed=3, temperature=0.5, top_p=0.9,
                                   top_k=4, min_p=0.1, ignore_eos=True, stop_token_ids=[5], logprobs=True,
                                   top_logprobs=2, unknown_field={"ignored": True}), "r-1")
    s = request.sampling
    assert (request.request_id, s.max_tokens, s.n, list(s.stop), s.seed, s.top_k, list(s.stop_token_ids)) == \
        ("r-1", 7, 2, ["x"], 3, 4, [5])
    assert (s.temperature, s.top_p, s.min_p, s.ignore_eos, s.logprobs) == pytest.approx((0.5, 0.9, 0.1, True, 2))
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "hi")]
    assert not native(chat()).sampling.HasField("temperature")  # unset: the engine's default
    assert native(chat()).sampling.max_tokens == 0  # a chat: until a stop or max_model_len
    assert native(completion()).sampling.max_tokens == 16  # OpenAI's completions default
    assert native(completion(logprobs=3)).sampling.logprobs == 3
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert native(parts).chat.messages[0].content == "a\nb"


@pytest.mark.parametrize("prompt,field,value", [("hi", "prompt", "hi"), (["hi"], "prompt", "hi"),
                                                ([1, 2], "token_ids", [1, 2]), ([[1, 2]], "token_ids", [1, 2])])
def test_a_completion_prompt_is_text_or_token_ids(prompt, field, value):
    request = native(completion(prompt=prompt))
    assert request.WhichOneof("input") == field
    assert (request.prompt if field == "prompt" else list(request.token_ids.ids)) == value


def test_penalties_bias_and_vllm_extras_land_on_the_native_request():
    s = native(chat(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.1,
                    logit_bias={"1": 2.0, "40": -100}, min_tokens=2, bad_words=["x", " y"])).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == pytest.approx((0.5, -1.0, 1.1))
    assert dict(s.logit_bias) == {1: 2.0, 40: -100.0} and s.min_tokens == 2 and list(s.bad_words) == ["x", " y"]
    plain = native(chat(presence_penalty=0, frequency_penalty=0, repetition_penalty=None, logit_bias={}))
    assert not plain.sampling.HasField("repetition_penalty") and not plain.sampling.logit_bias


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("fields, kind, value, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     "json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}}, "json_object", True, "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", json.dumps(SCHEMA),
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "a+", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ["a", "b"], "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"', "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object", True, "structured_outputs.json_object"),
    ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA), "guided_json"),
    ({"guided_regex": "a+"}, "regex", "a+", "guided_regex"),
    ({"guided_choice": ["a"]}, "choice", ["a"], "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"', "guided_grammar"),
])
def test_a_structured_output_lands_on_the_oneof_and_renames_its_errors(fields, kind, value, field):
    request, renames = generate_request(chat(**fields), "r")
    s = request.sampling
    assert s.WhichOneof("structured_output") == kind
    assert (list(s.choice.choices) if kind == "choice" else getattr(s, kind)) == value
    error = renamed(StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{kind}: is not valid"),
                    {**renames, **CHAT_NAMES})
    assert error.message == f"{field}: is not valid"


def test_text_format_is_no_structured_output():
    request, renames = generate_request(chat(response_format={"type": "text"}), "r")
    assert request.sampling.WhichOneof("structured_output") is None and renames == {}


@pytest.mark.parametrize("request_,field", [
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0].type"),
    (completion(prompt=["a", "b"]), "prompt"), (completion(echo=True), "echo"), (completion(suffix="x"), "suffix"),
    (completion(best_of=2), "best_of"), (completion(temperature=float("nan")), "temperature"),
    (chat(presence_penalty=float("inf")), "presence_penalty"), (chat(logit_bias={"a": 1.0}), "logit_bias"),
    (chat(logit_bias={"-1": 1.0}), "logit_bias"), (chat(response_format={"type": "xml"}), "response_format.type"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema.schema"),
    (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
    (chat(structured_outputs={"regex": "a", "grammar": "b"}), "structured_outputs.grammar")])
def test_what_the_mapping_refuses_names_the_openai_field(request_, field):
    with pytest.raises(StatusError) as info:
        generate_request(request_, "r")
    assert info.value.message.startswith(f"{field}:"), info.value.message


@pytest.mark.parametrize("native,names,expected", [
    ("sampling.temperature: must be >= 0", CHAT_NAMES, "temperature: must be >= 0"),
    ("sampling.logprobs: must be <= 20", CHAT_NAMES, "top_logprobs: must be <= 20"),
    ("sampling.logprobs: must be <= 20", COMPLETION_NAMES, "logprobs: must be <= 20"),
    ("sampling.stop[1]: is 300 characters", CHAT_NAMES, "stop[1]: is 300 characters"),
    ("chat.messages[0].role: must not be empty", CHAT_NAMES, "messages[0].role: must not be empty"),
    ("chat: the chat template refused it", CHAT_NAMES, "messages: the chat template refused it"),
    ("token_ids.ids: must not be empty", COMPLETION_NAMES, "prompt: must not be empty"),
    ("prompt: is 9 bytes of text", COMPLETION_NAMES, "prompt: is 9 bytes of text"),
    ("prompts: other", {"prompt": "text_input"}, "prompts: other"),  # a whole field, not a prefix of a name
    ("prompt: too long", {"prompt": "text_input"}, "text_input: too long")])
def test_renamed_names_the_api_field(native, names, expected):
    error = renamed(StatusError(grpc.StatusCode.INVALID_ARGUMENT, native), names)
    assert (error.code, error.message) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
