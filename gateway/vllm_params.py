"""vLLM's sampling extras onto the native ``tandem.v1.SamplingParams``, for the adapters whose
clients send them (OpenAI's API as vLLM serves it, KServe as Triton's vLLM backend takes it):
``structured_outputs`` (vLLM's ``StructuredOutputsParams``: ``json``, ``json_object``, ``regex``,
``choice``, ``grammar``) and ``logit_bias`` with token ids as JSON keys. Values are checked by
the native path (:mod:`cluster.translate`); here only their JSON shapes, each refusal naming the
adapter's field.
"""

from __future__ import annotations

import json

from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2

# vLLM's name of each structured-output kind → the native oneof field.
STRUCTURED_OUTPUTS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                      "grammar": "grammar"}


def set_structured_output(sampling: gateway_pb2.SamplingParams, kind: str, value, field: str) -> None:
    """Set ``sampling``'s structured output of vLLM's ``kind`` to ``value``, given as ``field``.

    Args:
        sampling: the native parameters (their oneof must be unset).
        kind: a key of :data:`STRUCTURED_OUTPUTS`.
        value: ``json``: a schema as JSON text or as the decoded object (or a boolean);
            ``json_object``: a boolean; ``regex``, ``grammar``: text; ``choice``: a list of text.
        field: the adapter's name of the field, for errors.

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``field``: a value of the wrong shape, or a
            second structured output (the first one's field is named in the message).
    """
    if sampling.WhichOneof("structured_output") is not None:
        raise StatusError.invalid_argument(field, "one structured output per request (another field already "
                                                  "set one)")
    if kind == "json":
        if isinstance(value, (dict, bool)):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise StatusError.invalid_argument(field, "must be a JSON schema (an object, or its JSON text)")
        sampling.json_schema = value
    elif kind == "json_object":
        if not isinstance(value, bool):
            raise StatusError.invalid_argument(field, "must be a boolean")
        sampling.json_object = value
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise StatusError.invalid_argument(field, "must be a list of strings")
        sampling.choice.choices.extend(value)
        sampling.choice.SetInParent()  # an empty list is still a choice (refused, naming it)
    else:
        if not isinstance(value, str):
            raise StatusError.invalid_argument(field, "must be a string")
        setattr(sampling, STRUCTURED_OUTPUTS[kind], value)


def set_structured_outputs(sampling: gateway_pb2.SamplingParams, params: dict, field: str) -> None:
    """vLLM's ``structured_outputs`` object onto ``sampling``: exactly one of its kinds set
    (``None`` values are unset, as vLLM's ``StructuredOutputsParams`` has them).

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``field`` or ``field.<kind>``: not an object, a
            key vLLM's object does not have, none or several kinds set, a value of the wrong shape.
    """
    if not isinstance(params, dict):
        raise StatusError.invalid_argument(field, "must be an object")
    unknown = sorted(set(params) - set(STRUCTURED_OUTPUTS))
    if unknown:
        raise StatusError.invalid_argument(f"{field}.{unknown[0]}", "is not a structured output Tandem knows "
                                                                    f"({', '.join(STRUCTURED_OUTPUTS)})")
    kinds = [kind for kind, value in params.items() if value is not None]
    if len(kinds) != 1:
        raise StatusError.invalid_argument(field, f"must set exactly one of {', '.join(STRUCTURED_OUTPUTS)}")
    set_structured_output(sampling, kinds[0], params[kinds[0]], f"{field}.{kinds[0]}")


def set_logit_bias(sampling: gateway_pb2.SamplingParams, bias: dict, field: str) -> None:
    """OpenAI's ``logit_bias`` (token ids as the JSON object's keys) onto ``sampling``.

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``field``: not an object, a key that is not a
            token id, a value that is not a number.
    """
    if not isinstance(bias, dict):
        raise StatusError.invalid_argument(field, "must be an object of token ids to biases")
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()) or len(key) > 10 or int(key) >= 2**32:
            raise StatusError.invalid_argument(field, f"keys must be token ids, got {json.dumps(key)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StatusError.invalid_argument(f"{field}[{key}]", f"must be a number, got {json.dumps(value)}")
        sampling.logit_bias[int(key)] = value
