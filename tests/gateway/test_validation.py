"""Bad input → INVALID_ARGUMENT naming the field, from a real gateway server on loopback.

The gateway's pool is two worker entries in the real Redis at addresses where nothing
listens (validation comes before routing), so a request that passes every check gets
UNAVAILABLE instead of tokens.
"""

from __future__ import annotations

import uuid

import grpc
import pytest

from cluster.registry import WorkerConfig
from engine.block_hash import hash_seed
from gateway.server import Gateway, load_served_model
from gateway.settings import GatewaySettings
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

from tests.helpers.gateway import ServerThread, register_workers
from tests.helpers.shared_redis import delete_keys

SP = gateway_pb2.SamplingParams
MAX_MODEL_LEN = 64
CAPS = dict(max_n=4, max_logprobs=5, max_stop=2, max_stop_len=8, max_stop_token_ids=3, max_request_bytes=16 << 10,
            max_prompt_bytes=4096, max_logit_bias=2, max_bad_words=3, max_structured_output_bytes=64)


@pytest.fixture(scope="module")
def stub(redis_url):
    """A gateway whose pool (registered in Redis, nobody listening) has max_model_len 64."""
    prefix = f"test-validation-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(listen="127.0.0.1:0", metrics_port=0, insecure=True, redis_url=redis_url,
                               redis_key_prefix=prefix,
                               registry_ttl_s=3600, **CAPS)
    model = load_served_model(settings)
    config = WorkerConfig(model.model_id, 16, MAX_MODEL_LEN, "float32", hash_seed(model.model_id, 16, "float32"),
                          49152)
    register_workers(redis_url, prefix, config)
    try:
        with ServerThread(Gateway(settings, model)) as server:
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                yield gateway_pb2_grpc.GatewayStub(channel), model
    finally:
        delete_keys(redis_url, prefix)


def _generate_error(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=10))
    return info.value


BAD_REQUESTS = [
    ("no input", gateway_pb2.GenerateRequest(), "input"),
    ("empty prompt", gateway_pb2.GenerateRequest(prompt=""), "prompt"),
    ("empty token ids", gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds()), "token_ids.ids"),
    ("empty chat", gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages()), "chat.messages"),
    ("chat without role", gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(content="hi")])), "chat.messages[0].role"),
    ("prompt too long", gateway_pb2.GenerateRequest(prompt="hello " * 200), "prompt"),
    ("token ids too long", gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1] * MAX_MODEL_LEN)),
     "token_ids.ids"),
    ("token id >= vocab", gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 49152])),
     "token_ids.ids"),
    ("seed overflows for n", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(n=2, seed=2**64 - 1)),
     "sampling.seed"),
    ("temperature < 0", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(temperature=-0.5)),
     "sampling.temperature"),
    ("temperature nan", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(temperature=float("nan"))),
     "sampling.temperature"),
    ("top_p 0", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(top_p=0.0)), "sampling.top_p"),
    ("top_p > 1", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(top_p=1.5)), "sampling.top_p"),
    ("top_k < -1", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(top_k=-2)), "sampling.top_k"),
    ("min_p > 1", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(min_p=1.5)), "sampling.min_p"),
    ("n > cap", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(n=5)), "sampling.n"),
    ("logprobs > cap", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(logprobs=6)), "sampling.logprobs"),
    ("too many stops", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(stop=["a", "b", "c"])), "sampling.stop"),
    ("stop too long", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(stop=["x" * 9])), "sampling.stop[0]"),
    ("too many stop ids", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(stop_token_ids=[1, 2, 3, 4])),
     "sampling.stop_token_ids"),
    ("stop id >= vocab", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(stop_token_ids=[70000])),
     "sampling.stop_token_ids[0]"),
    ("repetition_penalty 0", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(repetition_penalty=0)),
     "sampling.repetition_penalty"),
    ("presence_penalty > 2", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(presence_penalty=3)),
     "sampling.presence_penalty"),
    ("frequency_penalty nan", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(frequency_penalty=float("nan"))),
     "sampling.frequency_penalty"),
    ("too many biases", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(logit_bias={1: 1, 2: 1, 3: 1})),
     "sampling.logit_bias"),
    ("bias id >= vocab", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(logit_bias={70000: 1})),
     "sampling.logit_bias[70000]"),
    ("bias > 100", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(logit_bias={5: 200})), "sampling.logit_bias"),
    ("min_tokens > max_tokens", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(max_tokens=4, min_tokens=5)),
     "sampling.min_tokens"),
    ("too many bad words", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(bad_words=["a", "b", "c", "d"])),
     "sampling.bad_words"),
    ("bad words' sequences over the cap", gateway_pb2.GenerateRequest(
        prompt="hi", sampling=SP(bad_words=["hello", "world"])), "sampling.bad_words"),  # 2 sequences each
    ("empty bad word", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(bad_words=[" "])), "sampling.bad_words[0]"),
    ("bad word id >= vocab", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(
        bad_words_token_ids=[gateway_pb2.TokenIds(ids=[1, 70000])])), "sampling.bad_words_token_ids[0][1]"),
    ("bad word too long", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(
        bad_words_token_ids=[gateway_pb2.TokenIds(ids=[1] * 33)])), "sampling.bad_words_token_ids[0]"),
    ("empty bad word ids", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(
        bad_words_token_ids=[gateway_pb2.TokenIds()])), "sampling.bad_words_token_ids"),
    ("schema not JSON", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(json_schema="{not json")),
     "sampling.json_schema"),
    ("schema an array", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(json_schema="[1, 2]")),
     "sampling.json_schema"),
    ("schema over the bytes cap", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(
        json_schema='{"description": "' + "x" * 60 + '"}')), "sampling.json_schema"),
    ("regex over the bytes cap", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(regex="a" * 65)),
     "sampling.regex"),
    ("no choice", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(choice=gateway_pb2.Choices())),
     "sampling.choice"),
    ("empty choice", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(choice=gateway_pb2.Choices(
        choices=["a", ""]))), "sampling.choice"),
    ("choices over the bytes cap", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(choice=gateway_pb2.Choices(
        choices=["x" * 40, "y" * 40]))), "sampling.choice"),
    ("oversized message", gateway_pb2.GenerateRequest(prompt="x" * (20 << 10)), "request"),
    ("prompt over max_prompt_bytes", gateway_pb2.GenerateRequest(prompt="é" * 2100), "prompt"),  # 4200 bytes
    ("chat over max_prompt_bytes", gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=[
        gateway_pb2.ChatMessage(role="user", content="x" * 2100)] * 2)), "chat.messages"),
]


@pytest.mark.parametrize("name,request_,field", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_naming_the_field(stub, name, request_, field):
    error = _generate_error(stub[0], request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert error.details().startswith(f"{field}:"), error.details()


def test_message_over_grpc_limit_is_refused_without_crashing(stub):
    error = _generate_error(stub[0], gateway_pb2.GenerateRequest(prompt="x" * (40 << 10)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the server still answers afterwards
    assert stub[0].GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=30).max_model_len == MAX_MODEL_LEN


@pytest.mark.parametrize("sampling", [SP(max_tokens=0), SP(n=0), SP(top_k=0), SP(top_k=-1), SP(max_tokens=10**6),
                                      SP(n=2, seed=2**64 - 2), SP(stop=[""]), SP(stop=["a", "", "b", ""]),
                                      SP(min_tokens=10**6), SP(json_object=False), SP(json_object=True),
                                      SP(bad_words=["hello"]), SP(logit_bias={1: -100, 2: 100}),
                                      SP(repetition_penalty=1.2, presence_penalty=-2, frequency_penalty=2),
                                      SP(regex="a+"), SP(choice=gateway_pb2.Choices(choices=["yes", "no"]))])
def test_defaults_and_caps_pass_validation(stub, sampling):
    """0 means the documented default (max_tokens: until max_model_len, n: 1), a max_tokens
    beyond max_model_len is clamped to it (min_tokens with it), and empty stop strings (grpcurl's
    ``describe -msg-template`` body has one) are dropped, not counted: accepted."""
    error = _generate_error(stub[0], gateway_pb2.GenerateRequest(prompt="hi", sampling=sampling))
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # passed validation; nobody listens behind this gateway


def test_tokenize_matches_model_tokenizer_and_chat_template(stub):
    gateway, model = stub
    assert list(gateway.Tokenize(gateway_pb2.TokenizeRequest(prompt="Hello world"), timeout=30).token_ids) == \
        model.tokenizer.encode("Hello world")
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="Hi there")])

    assert list(gateway.Tokenize(gateway_pb2.TokenizeRequest(chat=chat), timeout=30).token_ids) == \
        model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    with pytest.raises(grpc.RpcError) as info:
        gateway.Tokenize(gateway_pb2.TokenizeRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("input")
    with pytest.raises(grpc.RpcError) as info:  # the same byte cap as Generate, before tokenization
        gateway.Tokenize(gateway_pb2.TokenizeRequest(prompt="é" * 2100), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("prompt:")


def test_model_info(stub):
    info = stub[0].GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=30)
    assert (info.model_id, info.max_model_len, info.block_size, info.vocab_size) == \
        (stub[1].model_id, MAX_MODEL_LEN, 16, 49152)


def test_api_keys_are_parsed_by_hash_and_refused_naming_the_setting(tmp_path):
    from gateway.auth import ApiKeys, Tenant, hash_key
    from gateway.settings import GatewaySettings
    from pydantic import ValidationError

    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# tenants\n{hash_key('k1')}:alice:3\n\n{hash_key('k2').upper()}:bob  # no limit\n")
    keys = GatewaySettings(api_keys_file=str(keys_file), api_keys=[f"{hash_key('k3')}:carol"]).load_api_keys()
    assert (len(keys), keys.tenant("k1"), keys.tenant("k2"), keys.tenant("k3")) == \
        (3, Tenant("alice", 3), Tenant("bob", 0), Tenant("carol", 0))
    assert keys.tenant(hash_key("k1")) is None  # the hash itself is not a key
    for bad in ("k1:alice", f"{hash_key('k1')}:al ice", f"{hash_key('k1')}:alice:many"):
        with pytest.raises(ValidationError, match="api_keys: entry 1"):
            GatewaySettings(api_keys=[bad])
    with pytest.raises(ValidationError, match="api_keys_file"):
        GatewaySettings(api_keys_file=str(tmp_path / "missing"))
    assert len(ApiKeys.parse([], "api_keys")) == 0
