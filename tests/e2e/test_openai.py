"""OpenAI's HTTP API through real processes (a prefill and a decode worker and a gateway on
loopback, TLS from a CA made for the test, one API key), called by clients nobody here wrote:
the official ``openai`` package unchanged (sync, async, streaming, ``n``, logprobs, a JSON schema,
penalties) and plain ``curl -N`` for Server-Sent Events. Every prompt is prefilled on the prefill
worker, so a structured output's first token is sampled there under its grammar and the decode
worker continues it.

Checks: the greedy text equals the native tandem.v1 API's, usage counts (cached prompt tokens
included), answers under a JSON schema parse and validate (``jsonschema``), penalties change the
text as the native API's do, errors as OpenAI's error object with the right status (400 naming
the field, a schema only a worker's compiler refuses included, before any block is held; 401,
404, 504), neutral values and unknown fields accepted, and a client that disconnects (streaming
or not) frees every block on both workers.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import subprocess
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from gateway.auth import hash_key
from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import SP, collect, free_blocks, settled_free_blocks, shared_redis_cluster, wait_free_blocks

pytestmark = pytest.mark.slow
KEY = "openai-test-key"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url):
    env = {"TANDEM_API_KEYS": f"{hash_key(KEY)}:tenant-a"}
    with shared_redis_cluster(tmp_path_factory.mktemp("openai"), "openai", redis_url, num_prefill=1, num_decode=1,
                              kv_transport="grpc", env=env) as cluster:
        cluster.ca = str(Path(cluster.tls_dir) / "ca.pem")
        cluster.base_url = f"https://{cluster.http_addr}/v1"
        cluster.model_id = next(iter(_get(cluster, "/v1/models").json()["data"]))["id"]
        yield cluster


def _tls(cluster) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cluster.ca)


def _get(cluster, path: str, key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"https://{cluster.http_addr}{path}", headers=headers, verify=_tls(cluster), timeout=30)


def client(cluster, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0,
                         http_client=openai.DefaultHttpxClient(verify=_tls(cluster)))


def native(cluster, request: gateway_pb2.GenerateRequest) -> dict:
    """The tandem.v1 answer to ``request`` (sample 0 and usage)."""
    out = collect(_KeyedStub(cluster.stub), request)
    return {**out["samples"][0], "usage": out["usage"]}


class _KeyedStub:
    def __init__(self, stub) -> None:
        self.stub = stub

    def Generate(self, request, timeout):  # noqa: N802
        return self.stub.Generate(request, timeout=timeout, metadata=[("authorization", f"Bearer {KEY}")])


def test_the_openai_client_unchanged_gets_the_native_greedy_text_sync_async_and_streamed(cluster):
    c = client(cluster)
    greedy = SP(max_tokens=16, temperature=0)
    chat_native = native(cluster, gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=[
        gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT]), sampling=greedy))
    chat = c.chat.completions.create(model=cluster.model_id, messages=CHAT, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == chat_native["text"] and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.object == "chat.completion"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (chat_native["usage"].prompt_tokens,
                                                                        len(chat_native["token_ids"]))
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    text_native = native(cluster, gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy))
    completion = c.completions.create(model=cluster.model_id, prompt=PROMPT, max_tokens=16, temperature=0)
    assert completion.choices[0].text == text_native["text"] and completion.object == "text_completion"

    stream = c.chat.completions.create(model=cluster.model_id, messages=CHAT, max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat_native["text"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == chat.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])

    async def concurrently() -> list[str]:
        async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key=KEY, max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(verify=_tls(cluster))) as ac:
            answers = await asyncio.gather(*(ac.completions.create(model=cluster.model_id, prompt=PROMPT,
                                                                   max_tokens=16, temperature=0) for _ in range(4)))
            streamed = await ac.completions.create(model=cluster.model_id, prompt=PROMPT, max_tokens=16,
                                                   temperature=0, stream=True)
            pieces = [chunk.choices[0].text async for chunk in streamed]
        return [a.choices[0].text for a in answers] + ["".join(pieces)]

    assert asyncio.run(concurrently()) == [text_native["text"]] * 5


def test_n_samples_logprobs_and_cached_prompt_tokens(cluster):
    c = client(cluster)
    sampled = c.completions.create(model=cluster.model_id, prompt="Count: one, two, three,", max_tokens=12, n=3,
                                   temperature=0.8, seed=7)
    assert sorted(choice.index for choice in sampled.choices) == [0, 1, 2]
    again = c.completions.create(model=cluster.model_id, prompt="Count: one, two, three,", max_tokens=12, n=3,
                                 temperature=0.8, seed=7)
    assert [ch.text for ch in again.choices] == [ch.text for ch in sampled.choices]  # seeded: reproducible

    chat = c.chat.completions.create(model=cluster.model_id, messages=CHAT, max_tokens=8, temperature=0,
                                     logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0 and token.bytes == list(token.token.encode())
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: the most likely one
    tokens = [t.token for t in content]
    if chat.choices[0].finish_reason == "stop":  # the end-of-sequence token: in logprobs, not in the text
        tokens = tokens[:-1]
    assert "".join(tokens) == chat.choices[0].message.content

    completion = c.completions.create(model=cluster.model_id, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    plain = c.chat.completions.create(model=cluster.model_id, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None

    system = "You are a careful geographer. " + " ".join(f"Fact {i}: rivers flow downhill." for i in range(30))
    messages = [{"role": "system", "content": system}, *CHAT]
    first = c.chat.completions.create(model=cluster.model_id, messages=messages, max_tokens=2, temperature=0)
    time.sleep(1.2)  # the worker publishes its cached blocks with its next heartbeat
    second = c.chat.completions.create(model=cluster.model_id, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * 10


def _status_and_error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.status_code, info.value.body


def test_errors_are_openai_error_objects_with_the_http_status(cluster):
    c, model = client(cluster), cluster.model_id
    status, body = _status_and_error(lambda: client(cluster, "wrong-key").models.list())
    assert status == 401 and body["type"] == "authentication_error"
    assert _get(cluster, "/v1/models", key=None).status_code == 401
    status, body = _status_and_error(lambda: c.chat.completions.create(model="no-such-model", messages=CHAT))
    assert status == 404 and body["code"] == "model_not_found"
    before = settled_free_blocks(cluster, within_s=5)
    unsatisfiable = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}
    cases = [({"temperature": -1}, "temperature"), ({"n": 99}, "n"), ({"top_p": 0}, "top_p"),
             ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
             ({"logit_bias": {"x": 5}}, "logit_bias"), ({"logit_bias": {"99999999": 5}}, "logit_bias[99999999]"),
             ({"logit_bias": {"1": 500}}, "logit_bias"), ({"response_format": {"type": "xml"}}, "response_format.type"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
              "response_format.json_schema.schema"),
             ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
             ({"extra_body": {"min_tokens": 3}}, "min_tokens"),  # more than max_tokens
             ({"extra_body": {"bad_words": [" "]}}, "bad_words[0]"),
             ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
             # refused by the workers' grammar compiler at Admit (the gateway cannot compile)
             ({"response_format": unsatisfiable}, "response_format.json_schema.schema"),
             ({"extra_body": {"structured_outputs": {"regex": "(?<=a)b"}}}, "structured_outputs.regex"),
             ({"extra_body": {"guided_grammar": "root ::= undefined"}}, "guided_grammar"),
             ({"top_logprobs": 2}, "top_logprobs"), ({"messages": [{"content": "no role"}]}, "messages[0].role")]
    for fields, param in cases:
        kwargs = {"messages": CHAT, "max_tokens": 2, **fields}
        status, body = _status_and_error(lambda: c.chat.completions.create(model=model, **kwargs))
        assert (status, body["param"], body["type"]) == (400, param, "invalid_request_error"), (fields, body)
        assert body["message"].startswith(param), body
    assert free_blocks(cluster) == before  # nothing was held for any of them
    status, body = _status_and_error(lambda: c.completions.create(model=model, prompt=["a", "b"], max_tokens=2))
    assert (status, body["param"]) == (400, "prompt")
    status, body = _status_and_error(lambda: c.completions.create(model=model, prompt=PROMPT, logprobs=99))
    assert (status, body["param"]) == (400, "logprobs")
    # neutral values and unknown fields are accepted
    ok = c.chat.completions.create(model=model, messages=CHAT, max_tokens=2, presence_penalty=0, frequency_penalty=0,
                                   logit_bias={}, response_format={"type": "text"}, user="someone",
                                   extra_body={"repetition_penalty": 1.0, "min_tokens": 0, "no_such_field": 1,
                                               "top_k": 5, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [49151]},
                                   seed=1)
    assert ok.usage.completion_tokens == 2  # ignore_eos: max_tokens reached
    status, body = _status_and_error(lambda: c.with_options(timeout=60).completions.create(
        model=model, prompt="Write an essay.", max_tokens=1500, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Timeout": "1"}))
    assert (status, body["type"]) == (504, "timeout")


PEOPLE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "es"]}, "maxItems": 3}},
    "required": ["name", "age", "languages"]}
PERSONS = ["Describe Marie Curie as JSON.", "Give me a French teacher in JSON.", "Invent a pirate, as JSON."]


def test_answers_under_a_json_schema_parse_and_validate(cluster):
    c = client(cluster)
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PEOPLE, "strict": True}}
    for prompt in PERSONS:
        answer = c.chat.completions.create(model=cluster.model_id, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=160, temperature=0, response_format=form)
        assert answer.choices[0].finish_reason == "stop", answer
        jsonschema.validate(json.loads(answer.choices[0].message.content), PEOPLE)
    sampled = c.chat.completions.create(model=cluster.model_id, messages=[{"role": "user", "content": PERSONS[0]}],
                                        max_tokens=160, temperature=1.0, seed=5, n=2, response_format=form)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PEOPLE)
    streamed = c.chat.completions.create(model=cluster.model_id, messages=[{"role": "user", "content": PERSONS[1]}],
                                         max_tokens=160, temperature=0, response_format={"type": "json_object"},
                                         stream=True)
    assert isinstance(json.loads("".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)), dict)
    choice = c.completions.create(model=cluster.model_id, prompt="The best season is", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["summer", "winter"]}})
    assert choice.choices[0].text in ("summer", "winter")
    regex = c.completions.create(model=cluster.model_id, prompt="A phone number:", max_tokens=16, temperature=0,
                                 extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].text)


def test_penalties_change_the_text_as_the_native_api_says(cluster):
    c, model = client(cluster), cluster.model_id
    # greedy, this prompt repeats one token (" blue" 32 times), so a penalty must change the text
    # whatever rounding a machine's kernels do (a prompt whose plain answer merely contains repeats
    # gave a code answer on one CPU that no penalty here changed)
    prompt = "Repeat the word blue ten times: blue blue blue"
    plain = c.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
    assert len(set(plain.choices[0].text.split())) == 1
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    penalized = c.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, **penalties)
    expected = native(cluster, gateway_pb2.GenerateRequest(prompt=prompt, sampling=SP(
        max_tokens=32, temperature=0, **penalties)))
    assert penalized.choices[0].text == expected["text"] != plain.choices[0].text
    repeated = c.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0,
                                    extra_body={"repetition_penalty": 1.5})
    assert repeated.choices[0].text not in (plain.choices[0].text, penalized.choices[0].text)
    # logit_bias (token ids as keys) forces a token; bad_words keeps a word out
    [token] = cluster.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=" blue"), timeout=10,
                                    metadata=[("authorization", f"Bearer {KEY}")]).token_ids
    forced = c.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={str(token): 100})
    assert forced.choices[0].text == " blue" * 4
    sky = "The color of the sky on a clear day is"
    assert " blue" in c.completions.create(model=model, prompt=sky, max_tokens=32, temperature=0).choices[0].text
    banned = c.completions.create(model=model, prompt=sky, max_tokens=32, temperature=0,
                                  extra_body={"bad_words": ["blue"]})
    assert "blue" not in banned.choices[0].text
    # min_tokens holds back the end of the answer
    question = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    short = c.chat.completions.create(model=model, messages=question, max_tokens=64, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    held = c.chat.completions.create(model=model, messages=question, max_tokens=64, temperature=0,
                                     extra_body={"min_tokens": 20})
    assert held.usage.completion_tokens >= 20


def test_health_and_models(cluster):
    assert _get(cluster, "/health", key=None).status_code == 200
    [model] = client(cluster).models.list().data
    info = cluster.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10,
                                     metadata=[("authorization", f"Bearer {KEY}")])
    assert (model.id, model.owned_by, model.max_model_len) == (info.model_id, "tandem", info.max_model_len)
    assert client(cluster).models.retrieve(cluster.model_id).id == cluster.model_id


def test_curl_streams_server_sent_events(cluster):
    body = {"model": cluster.model_id, "messages": CHAT, "max_tokens": 12, "temperature": 0, "stream": True}
    out = subprocess.run(["curl", "-sS", "-N", "--cacert", cluster.ca, "-H", f"Authorization: Bearer {KEY}",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body),
                          f"{cluster.base_url}/chat/completions"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    events = [line for line in out.stdout.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {ch["object"] for ch in chunks} == {"chat.completion.chunk"}
    whole = client(cluster).chat.completions.create(model=cluster.model_id, messages=CHAT, max_tokens=12,
                                                    temperature=0)
    assert "".join(ch["choices"][0]["delta"]["content"] or "" for ch in chunks) == whole.choices[0].message.content


def test_a_client_that_disconnects_frees_every_block_on_both_workers(cluster):
    before = settled_free_blocks(cluster, within_s=5)
    long = {"model": cluster.model_id, "prompt": "Tell me a very long story about dragons. " * 8, "max_tokens": 600,
            "ignore_eos": True, "temperature": 0}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(verify=_tls(cluster), timeout=60) as http:
        with http.stream("POST", f"{cluster.base_url}/completions", json={**long, "stream": True},
                         headers=headers) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
            during = free_blocks(cluster)
            assert any(during[n] < before[n] for n in before if n.startswith("decode")), (before, during)
    closed_at = time.monotonic()
    after = wait_free_blocks(cluster, before, within_s=2.0)
    assert after == before, (before, after, time.monotonic() - closed_at)

    # not streamed: the client gives up while the gateway waits for the whole answer
    def give_up() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{cluster.base_url}/completions", json=long, headers=headers, verify=_tls(cluster), timeout=2)

    thread = threading.Thread(target=give_up)
    thread.start()
    time.sleep(1.5)
    during = free_blocks(cluster)
    assert any(during[n] < before[n] for n in before if n.startswith("decode")), (before, during)
    thread.join()
    closed_at = time.monotonic()
    after = wait_free_blocks(cluster, before, within_s=2.0)
    assert after == before, (before, after, time.monotonic() - closed_at)
