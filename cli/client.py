"""A small synchronous client of the public Gateway API (used by ``tandem generate/chat/demo``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass
class Completion:
    """One streamed answer (sample 0), assembled."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: gateway_pb2.Usage | None = None


def sampling(max_tokens: int, temperature: float) -> gateway_pb2.SamplingParams:
    return gateway_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)


def chat_request(messages: list[dict[str, str]], params: gateway_pb2.SamplingParams) -> gateway_pb2.GenerateRequest:
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in messages])
    return gateway_pb2.GenerateRequest(chat=chat, sampling=params)


def auth_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``api_key`` to the gateway (none for an empty key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def tls_hint(ca_file: str) -> str:
    """What to tell a user whose call did not reach the gateway: without a CA, that the gateway
    serves TLS by default and how to trust it; with one, to check it is the gateway's."""
    if not ca_file and not os.environ.get("TANDEM_TLS_CA"):
        return ("if the gateway serves TLS (the default), set its CA: --tls-ca PATH or "
                "TANDEM_TLS_CA=PATH (the ca.pem of its certificate directory)")
    return "check that the CA file (--tls-ca / TANDEM_TLS_CA) is the one that signed the gateway's certificate"


def channel(address: str, ca_file: str = "") -> grpc.Channel:
    """A channel to the gateway: TLS verified against the CA file ``ca_file`` (default
    ``TANDEM_TLS_CA``) when there is one, else plaintext.

    Raises:
        OSError: the CA file cannot be read.
    """
    ca_file = ca_file or os.environ.get("TANDEM_TLS_CA", "")
    if not ca_file:
        return grpc.insecure_channel(address)
    with open(ca_file, "rb") as f:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()))


def stream(address: str, request: gateway_pb2.GenerateRequest, on_text: Callable[[str], None],
           timeout_s: float | None = None, api_key: str = "", ca_file: str = "") -> Completion:
    """Run one Generate call, calling ``on_text`` with each new piece of sample 0's text;
    ``api_key`` is sent as ``authorization: Bearer`` when set; ``ca_file``: see :func:`channel`.

    Raises:
        grpc.RpcError: the call failed (its ``code()`` and ``details()`` say why).
    """
    out = Completion()
    with channel(address, ca_file) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=timeout_s,
                                                              metadata=auth_metadata(api_key))
        try:
            for message in call:
                if message.index != 0:
                    continue
                out.token_ids += message.token_ids
                if message.text:
                    out.text += message.text
                    on_text(message.text)
                if message.finish_reason:
                    out.finish_reason = gateway_pb2.FinishReason.Name(message.finish_reason)
                if message.HasField("usage"):
                    out.usage = message.usage
        except BaseException:
            call.cancel()
            raise
    return out


def responses(address: str, request: gateway_pb2.GenerateRequest,
              timeout_s: float | None = None) -> Iterator[gateway_pb2.GenerateResponse]:
    """All messages of one Generate call."""
    with channel(address) as ch:
        yield from gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=timeout_s)
