"""The one mapping of an OpenAI request onto the native request, and the renaming of native
field names in refusals: every field the engine serves lands on its native field, every field it
does not serve yet is accepted at its neutral value only (400 naming it otherwise), unknown
fields are ignored."""

from __future__ import annotations

import grpc
import pytest

from gateway.frontend import renamed
from gateway.openai_io import CHAT_NAMES, COMPLETION_NAMES, NOT_YET, generate_request
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from protos.status import StatusError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def test_served_fields_land_on_the_native_request():
    native = generate_request(chat(max_completion_tokens=7, n=2, stop="x", seed=3, temperature=0.5, top_p=0.9,
                                   top_k=4, min_p=0.1, ignore_eos=True, stop_token_ids=[5], logprobs=True,
                                   top_logprobs=2, unknown_field={"ignored": True}), "r-1")
    s = native.sampling
    assert (native.request_id, s.max_tokens, s.n, list(s.stop), s.seed, s.top_k, list(s.stop_token_ids)) == \
        ("r-1", 7, 2, ["x"], 3, 4, [5])
    assert (s.temperature, s.top_p, s.min_p, s.ignore_eos, s.logprobs) == pytest.approx((0.5, 0.9, 0.1, True, 2))
    assert [(m.role, m.content) for m in native.chat.messages] == [("user", "hi")]
    assert not generate_request(chat(), "r").sampling.HasField("temperature")  # unset: the engine's default
    assert generate_request(chat(), "r").sampling.max_tokens == 0  # a chat: until a stop or max_model_len
    assert generate_request(completion(), "r").sampling.max_tokens == 16  # OpenAI's completions default
    assert generate_request(completion(logprobs=3), "r").sampling.logprobs == 3
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert generate_request(parts, "r").chat.messages[0].content == "a\nb"


@pytest.mark.parametrize("prompt,field,value", [("hi", "prompt", "hi"), (["hi"], "prompt", "hi"),
                                                ([1, 2], "token_ids", [1, 2]), ([[1, 2]], "token_ids", [1, 2])])
def test_a_completion_prompt_is_text_or_token_ids(prompt, field, value):
    native = generate_request(completion(prompt=prompt), "r")
    assert native.WhichOneof("input") == field
    assert (native.prompt if field == "prompt" else list(native.token_ids.ids)) == value


NON_NEUTRAL = {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.1,
               "logit_bias": {"1": 2.0}, "min_tokens": 2, "bad_words": ["x"],
               "response_format": {"type": "json_object"}, "regex": "a+", "choice": ["a", "b"], "grammar": "root ::= x"}


@pytest.mark.parametrize("field", sorted(NOT_YET))
def test_a_field_the_engine_lacks_is_refused_unless_neutral(field):
    with pytest.raises(StatusError) as info:
        generate_request(chat(**{field: NON_NEUTRAL[field]}), "r")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(f"{field}: not supported yet")
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {},
               "min_tokens": 0, "bad_words": [], "response_format": {"type": "text"}, "regex": None, "choice": None,
               "grammar": None}
    generate_request(chat(**{field: neutral[field]}), "r")  # accepted


@pytest.mark.parametrize("request_,field", [
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0].type"),
    (completion(prompt=["a", "b"]), "prompt"), (completion(echo=True), "echo"), (completion(suffix="x"), "suffix"),
    (completion(best_of=2), "best_of"), (completion(temperature=float("nan")), "temperature")])
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
