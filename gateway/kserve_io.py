"""KServe v2 tensors ↔ Tandem's request and responses, by Triton's LLM conventions (those of
its vLLM backend), so that existing Triton clients work unchanged.

Inputs (each of shape ``[1]``): ``text_input`` (BYTES, required), ``stream`` (BOOL),
``sampling_parameters`` (BYTES: a JSON object of vLLM's sampling parameters that Tandem has:
``temperature`` ... ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``n`` (1), the
penalties, ``min_tokens``, ``logit_bias``, ``bad_words``, ``structured_outputs``; a value may be
a string, ``"0.7"``, a list or an object its JSON text),
``exclude_input_in_output``, ``return_finish_reason``, ``return_num_input_tokens``,
``return_num_output_tokens`` (BOOL). Outputs: ``text_output`` (BYTES) always; ``finish_reason``
(BYTES), ``num_input_tokens`` and ``num_output_tokens`` (UINT32) when asked for. A streamed
response carries the new text and the new tokens' count; a whole one the whole text (the
prompt first unless ``exclude_input_in_output``) and all tokens.

Every refusal is :class:`protos.status.StatusError` ``INVALID_ARGUMENT`` whose message starts
with the input's name (``sampling_parameters.temperature`` for a parameter).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from gateway.vllm_params import set_logit_bias, set_structured_outputs
from protos.inference import grpc_service_pb2 as kserve
from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2

# name → (datatype, required)
INPUTS = {"text_input": ("BYTES", True), "stream": ("BOOL", False), "sampling_parameters": ("BYTES", False),
          "exclude_input_in_output": ("BOOL", False), "return_finish_reason": ("BOOL", False),
          "return_num_input_tokens": ("BOOL", False), "return_num_output_tokens": ("BOOL", False)}
# name → (datatype, shape)
OUTPUTS = {"text_output": ("BYTES", [-1]), "finish_reason": ("BYTES", [-1]), "num_input_tokens": ("UINT32", [1]),
           "num_output_tokens": ("UINT32", [1])}
# Triton's vLLM backend takes vLLM's SamplingParams; these are the ones Tandem has, by type.
_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_PARAMS = ("top_k", "max_tokens", "seed", "min_tokens")
# vLLM's default max_tokens, which a Triton vLLM client gets when it sets none.
DEFAULT_MAX_TOKENS = 16
_FINISH_NAMES = {gateway_pb2.FINISH_REASON_STOP: "stop", gateway_pb2.FINISH_REASON_LENGTH: "length",
                 gateway_pb2.FINISH_REASON_ABORT: "abort"}


@dataclass(frozen=True)
class InferRequest:
    """One ``ModelInferRequest`` as Tandem serves it.

    Attributes:
        native_request: the equivalent native request (prompt, sampling, request id).
        stream: one response per step (else one response with everything).
        exclude_input: a whole response's text leaves out the prompt.
        outputs: the output tensors to return, in order.
    """

    native_request: gateway_pb2.GenerateRequest
    stream: bool
    exclude_input: bool
    outputs: tuple[str, ...]


def _bytes_elements(tensor: kserve.ModelInferRequest.InferInputTensor, raw: bytes | None) -> list[bytes]:
    if raw is None:
        return list(tensor.contents.bytes_contents)
    elements, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise StatusError.invalid_argument(tensor.name, "raw BYTES content is truncated")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise StatusError.invalid_argument(tensor.name, "raw BYTES content is truncated")
        elements.append(raw[offset:offset + size])
        offset += size
    return elements


def _bool_elements(tensor: kserve.ModelInferRequest.InferInputTensor, raw: bytes | None) -> list[bool]:
    return [b != 0 for b in raw] if raw is not None else list(tensor.contents.bool_contents)


def _scalar(tensor, raw: bytes | None):
    """The one element of a ``[1]`` (or ``[1, 1]``: a batch of one) input tensor."""
    datatype, _ = INPUTS[tensor.name]
    if tensor.datatype != datatype:
        raise StatusError.invalid_argument(tensor.name, f"must be {datatype}, got {tensor.datatype or 'none'}")
    if math.prod(tensor.shape) != 1 or not tensor.shape:
        raise StatusError.invalid_argument(tensor.name, f"must have shape [1], got {list(tensor.shape)}")
    elements = _bytes_elements(tensor, raw) if datatype == "BYTES" else _bool_elements(tensor, raw)
    if len(elements) != 1:
        raise StatusError.invalid_argument(tensor.name, f"shape [1] holds one element, got {len(elements)}")
    return elements[0]


def _utf8(name: str, data: bytes) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise StatusError.invalid_argument(name, "is not UTF-8 text") from None


def _number(name: str, value, kind: type):
    """A sampling parameter as ``kind`` (int or float), from a JSON number or a string."""
    field = f"sampling_parameters.{name}"
    wanted = "an integer" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise StatusError.invalid_argument(field, f"must be {wanted}, got {json.dumps(value)}")
    if kind is int and isinstance(value, int):
        return value
    try:
        if kind is int and isinstance(value, str):
            return int(value)
        number = float(value)
    except ValueError:
        raise StatusError.invalid_argument(field, f"must be {wanted}, got {json.dumps(value)}") from None
    if kind is int:
        if not number.is_integer():
            raise StatusError.invalid_argument(field, f"must be {wanted}, got {json.dumps(value)}")
        return int(number)
    return number


def _strings(name: str, value) -> list[str]:
    """``stop`` or ``bad_words``: one string, a list of them, or that list as JSON text."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)  # a list sent as a JSON string, as string-typed clients do
        except ValueError:
            return [value]
        value = decoded if isinstance(decoded, list) else [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise StatusError.invalid_argument(f"sampling_parameters.{name}", "must be a string or a list of strings")
    return value


def _object(name: str, value):
    """``logit_bias`` or ``structured_outputs``: a JSON object, or its JSON text (what a
    string-typed client sends)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise StatusError.invalid_argument(f"sampling_parameters.{name}", "is not JSON") from None
    return value


def _flag(value) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1"))


def sampling_from_json(data: bytes) -> gateway_pb2.SamplingParams:
    """``sampling_parameters`` (a JSON object) as ``tandem.v1.SamplingParams``; ``max_tokens``
    defaults to :data:`DEFAULT_MAX_TOKENS`. Ranges are checked later, by the native path.

    Raises:
        StatusError: not a JSON object, an unknown parameter, or a value of the wrong type,
            naming ``sampling_parameters[.NAME]``.
    """
    try:
        params = json.loads(_utf8("sampling_parameters", data) or "{}")
    except ValueError as exc:
        raise StatusError.invalid_argument("sampling_parameters", f"is not JSON: {exc}") from None
    if not isinstance(params, dict):
        raise StatusError.invalid_argument("sampling_parameters", "must be a JSON object")
    sampling = gateway_pb2.SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    for name, value in params.items():
        if name in _FLOAT_PARAMS:
            setattr(sampling, name, _number(name, value, float))
        elif name in _INT_PARAMS:
            number = _number(name, value, int)
            if number < 0 and name != "top_k":
                raise StatusError.invalid_argument(f"sampling_parameters.{name}", f"must be >= 0, got {number}")
            setattr(sampling, name, number)
        elif name in ("stop", "bad_words"):
            getattr(sampling, name).extend(_strings(name, value))
        elif name == "logit_bias":
            set_logit_bias(sampling, _object(name, value), "sampling_parameters.logit_bias")
        elif name == "structured_outputs":
            set_structured_outputs(sampling, _object(name, value), "sampling_parameters.structured_outputs")
        elif name == "stop_token_ids":
            ids = json.loads(value) if isinstance(value, str) else value
            if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise StatusError.invalid_argument("sampling_parameters.stop_token_ids",
                                                   "must be a list of token ids")
            sampling.stop_token_ids.extend(ids)
        elif name == "ignore_eos":
            sampling.ignore_eos = _flag(value)
        elif name == "n":
            if _number(name, value, int) != 1:
                raise StatusError.invalid_argument("sampling_parameters.n", "must be 1 (one text_output per request)")
        else:
            raise StatusError.invalid_argument(f"sampling_parameters.{name}", "is not a parameter Tandem knows")
    return sampling


def infer_request(request: kserve.ModelInferRequest) -> InferRequest:
    """Translate one ``ModelInferRequest`` (inputs as ``contents`` or ``raw_input_contents``).

    Raises:
        StatusError: an unknown, missing, repeated or malformed input or requested output,
            naming it.
    """
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise StatusError.invalid_argument("raw_input_contents", f"has {len(raw)} entries for "
                                                                 f"{len(request.inputs)} inputs")
    values = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name not in INPUTS:
            raise StatusError.invalid_argument(tensor.name or "inputs", f"is not an input of this model "
                                                                        f"(inputs: {', '.join(INPUTS)})")
        if tensor.name in values:
            raise StatusError.invalid_argument(tensor.name, "is given twice")
        values[tensor.name] = _scalar(tensor, raw[i] if raw else None)
    if "text_input" not in values:
        raise StatusError.invalid_argument("text_input", "is required")
    prompt = _utf8("text_input", values["text_input"])
    if not prompt:
        raise StatusError.invalid_argument("text_input", "must not be empty")
    sampling = sampling_from_json(values.get("sampling_parameters", b""))
    outputs = ["text_output"] + [name for name in ("finish_reason", "num_input_tokens", "num_output_tokens")
                                 if values.get(f"return_{name}", False)]
    if request.outputs:
        asked = [o.name for o in request.outputs]
        for name in asked:
            if name not in OUTPUTS:
                raise StatusError.invalid_argument(name, f"is not an output of this model (outputs: {', '.join(OUTPUTS)})")
        outputs = asked
    native = gateway_pb2.GenerateRequest(prompt=prompt, sampling=sampling, request_id=request.id)
    return InferRequest(native, bool(values.get("stream", False)), bool(values.get("exclude_input_in_output")),
                        tuple(outputs))


def _tensor_bytes(name: str, value) -> bytes:
    datatype, _ = OUTPUTS[name]
    if datatype == "UINT32":
        return struct.pack("<I", value)
    data = value.encode()
    return struct.pack("<I", len(data)) + data


def infer_response(request: kserve.ModelInferRequest, infer: InferRequest, model_name: str, text: str,
                   finish_reason: int, prompt_tokens: int, output_tokens: int,
                   final: bool | None = None) -> kserve.ModelInferResponse:
    """One ``ModelInferResponse``: the outputs ``infer`` asks for, as ``raw_output_contents``
    (as Triton sends them), ``id`` echoed; ``final`` sets the ``triton_final_response``
    parameter of a streamed response (``None``: not streamed, no parameter)."""
    values = {"text_output": text, "finish_reason": _FINISH_NAMES.get(finish_reason, ""),
              "num_input_tokens": prompt_tokens, "num_output_tokens": output_tokens}
    response = kserve.ModelInferResponse(model_name=model_name, model_version="1", id=request.id)
    for name in infer.outputs:
        datatype, _ = OUTPUTS[name]
        response.outputs.add(name=name, datatype=datatype, shape=[1])
        response.raw_output_contents.append(_tensor_bytes(name, values[name]))
    if final is not None:
        response.parameters["triton_final_response"].bool_param = final
    return response


def empty_final_response(request: kserve.ModelInferRequest, model_name: str) -> kserve.ModelInferResponse:
    """The output-less last response a request with ``triton_enable_empty_final_response`` gets."""
    response = kserve.ModelInferResponse(model_name=model_name, model_version="1", id=request.id)
    response.parameters["triton_final_response"].bool_param = True
    return response


def wants_empty_final_response(request: kserve.ModelInferRequest) -> bool:
    """Whether the request sets Triton's ``triton_enable_empty_final_response`` parameter."""
    param = request.parameters.get("triton_enable_empty_final_response")
    return param is not None and param.bool_param

