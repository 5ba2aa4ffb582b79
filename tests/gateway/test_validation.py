"""Bad input → INVALID_ARGUMENT naming the field, from a real gateway server on loopback.

The gateway runs in-process with no cluster (validation comes before routing), so a request
that passes every check gets UNAVAILABLE ("no cluster") instead of tokens.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from gateway.server import Gateway, load_model_meta
from gateway.settings import GatewaySettings
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

SP = gateway_pb2.SamplingParams
MAX_MODEL_LEN = 64
CAPS = dict(max_tokens_cap=100, max_n=4, max_logprobs=5, max_stop=2, max_stop_len=8, max_stop_token_ids=3,
            max_request_bytes=16 << 10)


class ServerThread:
    """A Gateway on its own event loop in a background thread (tests use sync gRPC stubs)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.port: int | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.port = await self.gateway.start()
        self._ready.set()
        await self._stop.wait()
        await self.gateway.stop(grace_s=0)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(30), "gateway did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def stub():
    settings = GatewaySettings(listen="127.0.0.1:0", max_model_len=MAX_MODEL_LEN, metrics_port=0, **CAPS)
    model = load_model_meta(settings)
    with ServerThread(Gateway(settings, model, with_cluster=False)) as server:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield gateway_pb2_grpc.GatewayStub(channel), model


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
    ("max_tokens > cap", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(max_tokens=101)), "sampling.max_tokens"),
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
    ("empty stop", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(stop=["ok", ""])), "sampling.stop[1]"),
    ("too many stop ids", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(stop_token_ids=[1, 2, 3, 4])),
     "sampling.stop_token_ids"),
    ("stop id >= vocab", gateway_pb2.GenerateRequest(prompt="hi", sampling=SP(stop_token_ids=[70000])),
     "sampling.stop_token_ids[0]"),
    ("oversized message", gateway_pb2.GenerateRequest(prompt="x" * (20 << 10)), "request"),
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
    assert stub[0].GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5).max_model_len == MAX_MODEL_LEN


@pytest.mark.parametrize("sampling", [SP(max_tokens=0), SP(n=0), SP(top_k=0), SP(top_k=-1), SP(max_tokens=100)])
def test_defaults_and_caps_pass_validation(stub, sampling):
    """0 means the documented default (max_tokens: until max_model_len, n: 1): accepted."""
    error = _generate_error(stub[0], gateway_pb2.GenerateRequest(prompt="hi", sampling=sampling))
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # passed validation; no cluster behind this gateway


def test_tokenize_matches_model_tokenizer_and_chat_template(stub):
    gateway, model = stub
    assert list(gateway.Tokenize(gateway_pb2.TokenizeRequest(prompt="Hello world"), timeout=5).token_ids) == \
        model.tokenizer.encode("Hello world")
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="Hi there")])
    from engine.llm import apply_chat_template

    assert list(gateway.Tokenize(gateway_pb2.TokenizeRequest(chat=chat), timeout=5).token_ids) == \
        apply_chat_template(model.tokenizer, [{"role": "user", "content": "Hi there"}])
    with pytest.raises(grpc.RpcError) as info:
        gateway.Tokenize(gateway_pb2.TokenizeRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("input")


def test_model_info(stub):
    info = stub[0].GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)
    assert (info.model_id, info.max_model_len, info.block_size, info.vocab_size) == \
        (stub[1].meta.model_id, MAX_MODEL_LEN, 16, 49152)
