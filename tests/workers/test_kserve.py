"""KServe v2 through a real gateway in front of a real worker pair (all on loopback, no Redis),
called by Triton's own client, ``tritonclient``, unchanged: whole and streamed inference (sync,
sync stream, asyncio stream) give the native API's greedy text; metadata, readiness, config,
statistics and the repository index describe the one served model; bad input is
INVALID_ARGUMENT naming the input or parameter; a closed stream frees its blocks."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

from tests.helpers.workers import gateway_over

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
GREEDY = {"temperature": "0", "max_tokens": "12", "ignore_eos": "true"}  # string values, as Triton clients send


def inputs(module, prompt: str = PROMPT, params: dict | None = None, stream: bool | None = None,
           **flags: bool) -> list:
    """The Triton vLLM-convention input tensors (``module``: tritonclient.grpc or its aio twin)."""
    def tensor(name: str, datatype: str, value) -> object:
        t = module.InferInput(name, [1], datatype)
        t.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        return t

    tensors = [tensor("text_input", "BYTES", prompt.encode()),
               tensor("sampling_parameters", "BYTES", json.dumps(params or GREEDY).encode())]
    if stream is not None:
        tensors.append(tensor("stream", "BOOL", stream))
    tensors += [tensor(name, "BOOL", value) for name, value in flags.items()]
    return tensors


async def native_greedy(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=gateway_pb2.SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True))
        return "".join([m.text async for m in stub.Generate(request)])


def sync_calls(address: str, model: str) -> dict:
    """Every call a sync tritonclient user makes, with the results the test checks."""
    client = triton.InferenceServerClient(address)
    out = {"live": client.is_server_live(), "ready": client.is_server_ready(), "model_ready": client.is_model_ready(model),
           "metadata": client.get_model_metadata(model, as_json=True), "config": client.get_model_config(model, as_json=True),
           "index": client.get_model_repository_index(as_json=True), "server": client.get_server_metadata(as_json=True)}
    whole = client.infer(model, inputs(triton, exclude_input_in_output=True, return_finish_reason=True,
                                       return_num_input_tokens=True, return_num_output_tokens=True), request_id="r-1")
    out["whole"] = (whole.as_numpy("text_output")[0].decode(), whole.as_numpy("finish_reason")[0].decode(),
                    int(whole.as_numpy("num_input_tokens")[0]), int(whole.as_numpy("num_output_tokens")[0]),
                    whole.get_response().id)
    out["with_prompt"] = client.infer(model, inputs(triton)).as_numpy("text_output")[0].decode()
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, inputs(triton, stream=True), request_id="s-1")
    pieces, finals = [], []
    while True:
        result, error = results.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        pieces.append(result.as_numpy("text_output")[0].decode())
        finals.append(response.parameters["triton_final_response"].bool_param)
        if finals[-1]:
            break
    out["stream"] = ("".join(pieces), finals, response.id)
    client.async_stream_infer(model, inputs(triton, stream=True), enable_empty_final_response=True)
    pieces = []
    while True:
        result, error = results.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param:
            out["empty_final"] = ("".join(pieces), list(response.outputs))
            break
        pieces.append(result.as_numpy("text_output")[0].decode())
    client.stop_stream()
    out["statistics"] = client.get_inference_statistics(model, as_json=True)
    client.close()
    return out


def test_tritonclient_unchanged_streams_the_native_greedy_text(engines):
    async def main():
        async with gateway_over(engines) as (_, gateway, address):
            model = gateway.model.model_id
            expected = await native_greedy(address)
            out = await asyncio.to_thread(sync_calls, address, model)
            assert (out["live"], out["ready"], out["model_ready"]) == (True, True, True)
            assert out["whole"] == (expected, "length", len(gateway.model.tokenizer.encode(PROMPT)), 12, "r-1")
            assert out["with_prompt"] == PROMPT + expected  # the prompt first unless exclude_input_in_output
            text, finals, request_id = out["stream"]
            assert text == expected and finals[-1] and not any(finals[:-1]) and len(finals) > 1
            assert request_id == "s-1"
            assert {t["name"] for t in out["metadata"]["inputs"]} == {
                "text_input", "stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
                "return_num_input_tokens", "return_num_output_tokens"}
            assert {t["name"] for t in out["metadata"]["outputs"]} == {
                "text_output", "finish_reason", "num_input_tokens", "num_output_tokens"}
            assert out["config"]["config"]["model_transaction_policy"]["decoupled"] is True
            assert out["index"]["models"] == [{"name": model, "version": "1", "state": "READY"}]
            assert out["server"]["name"] == "tandem"
            [stats] = out["statistics"]["model_stats"]
            assert int(stats["inference_stats"]["success"]["count"]) >= 3  # the last stream's record may land after the read

            assert out["empty_final"] == (expected, [])  # asked for: an empty final response after the text

            client = triton_aio.InferenceServerClient(address)  # tritonclient's asyncio client

            async def requests():
                yield {"model_name": model, "inputs": inputs(triton_aio, stream=True), "request_id": "a-1"}

            pieces = []
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                pieces.append(result.as_numpy("text_output")[0].decode())
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            await client.close()
            assert "".join(pieces) == expected

    asyncio.run(main())


BAD = [
    ({"params": {"temperature": "-1"}}, "sampling_parameters.temperature"),
    ({"params": {"temperature": "warm"}}, "sampling_parameters.temperature"),
    ({"params": {"max_tokens": 1.5}}, "sampling_parameters.max_tokens"),
    ({"params": {"best_of": 2}}, "sampling_parameters.best_of"),
    ({"prompt": ""}, "text_input"),
    ({"stream": True}, "stream"),
    ({"params": {"presence_penalty": "3"}}, "sampling_parameters.presence_penalty"),
    ({"params": {"logit_bias": {"x": 1}}}, "sampling_parameters.logit_bias"),
    ({"params": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "sampling_parameters.structured_outputs"),
    ({"params": {"structured_outputs": '{"json": "{not json"}'}}, "sampling_parameters.structured_outputs.json"),
    # refused by the decode worker's grammar compiler at Admit
    ({"params": {"structured_outputs": {"regex": "(?<=a)b"}}}, "sampling_parameters.structured_outputs.regex"),
]


def test_vllm_sampling_parameters_reach_the_engine(engines):
    """Penalties, logit_bias, bad_words and structured_outputs as Triton's vLLM backend takes
    them (JSON values or their JSON text) give what the native API gives."""
    def calls(address: str, model: str, token: int) -> list[str]:
        client = triton.InferenceServerClient(address)
        texts = []
        for params in ({**GREEDY, "structured_outputs": {"choice": ["Paris", "Lyon"]}},
                       {**GREEDY, "structured_outputs": json.dumps({"regex": "[0-9]{3}"})},
                       {**GREEDY, "bad_words": json.dumps(["Paris"]), "frequency_penalty": "1.5"},
                       {**GREEDY, "max_tokens": "3", "logit_bias": {str(token): 100}}):
            result = client.infer(model, inputs(triton, params=params, exclude_input_in_output=True))
            texts.append(result.as_numpy("text_output")[0].decode())
        client.close()
        return texts

    async def main():
        async with gateway_over(engines) as (_, gateway, address):
            [token] = gateway.model.tokenizer.encode(" blue", add_special_tokens=False)
            choice, digits, banned, forced = await asyncio.to_thread(calls, address, gateway.model.model_id, token)
            assert choice in ("Paris", "Lyon") and re.fullmatch("[0-9]{3}", digits) and forced == " blue" * 3
            async with grpc.aio.insecure_channel(address) as channel:
                request = gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=gateway_pb2.SamplingParams(
                    max_tokens=12, temperature=0, ignore_eos=True, bad_words=["Paris"], frequency_penalty=1.5))
                expected = "".join([m.text async for m in gateway_pb2_grpc.GatewayStub(channel).Generate(request)])
            assert banned == expected != await native_greedy(address)

    asyncio.run(main())


def test_bad_input_is_invalid_argument_naming_the_input_or_parameter(engines):
    def calls(address: str, model: str) -> list:
        client = triton.InferenceServerClient(address)
        errors = []
        for kwargs, _ in BAD:
            with pytest.raises(InferenceServerException) as info:
                client.infer(model, inputs(triton, **kwargs))
            errors.append((info.value.status(), info.value.message()))
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, inputs(triton)[1:])  # no text_input
        errors.append((info.value.status(), info.value.message()))
        with pytest.raises(InferenceServerException) as info:
            client.infer("no-such-model", inputs(triton))
        unknown = (info.value.status(), info.value.message())
        # in a stream, an error is a message of the stream, and the stream goes on
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs(triton, params={"top_p": "2"}, stream=True))
        client.async_stream_infer(model, inputs(triton, stream=True, params={**GREEDY, "max_tokens": "2"}))
        streamed = [results.get(timeout=120) for _ in range(3)]  # the error, then two steps
        client.stop_stream()
        client.close()
        return errors, unknown, streamed

    async def main():
        async with gateway_over(engines) as (_, gateway, address):
            errors, unknown, streamed = await asyncio.to_thread(calls, address, gateway.model.model_id)
            for (status, message), name in zip(errors, [name for _, name in BAD] + ["text_input"]):
                assert status == "StatusCode.INVALID_ARGUMENT" and message.startswith(f"{name}:"), (status, message)
            assert unknown[0] == "StatusCode.NOT_FOUND" and "no-such-model" in unknown[1]
            error = streamed[0][1]
            assert error is not None and "INVALID_ARGUMENT: sampling_parameters.top_p" in str(error)
            assert [e for _, e in streamed[1:]] == [None, None]

    asyncio.run(main())


def test_closing_a_stream_frees_its_blocks(engines):
    async def main():
        async with gateway_over(engines) as (_, gateway, address):
            start = (engines[0].num_free_blocks, engines[1].num_free_blocks)
            client = triton_aio.InferenceServerClient(address)

            async def requests():
                yield {"model_name": gateway.model.model_id, "request_id": "long",
                       "inputs": inputs(triton_aio, stream=True, params={**GREEDY, "max_tokens": "400"})}
                await asyncio.sleep(3600)  # the client keeps the stream open until it closes it

            responses = client.stream_infer(requests())
            received = 0
            async for result, error in responses:
                assert error is None, error
                received += 1
                if received == 3:
                    break
            assert engines[1].num_free_blocks < start[1]  # the request holds decode blocks
            responses.cancel()  # tritonclient's way to close a stream
            await client.close()
            deadline = time.monotonic() + 10
            while (engines[0].num_free_blocks, engines[1].num_free_blocks) != start:
                assert time.monotonic() < deadline, "blocks not freed"
                await asyncio.sleep(0.05)

    asyncio.run(main())
