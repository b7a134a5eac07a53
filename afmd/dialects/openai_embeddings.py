"""OpenAI Embeddings on the wire: ``POST /v1/embeddings`` in, its list object out.

The body is checked field by field as OpenAI documents it (``input`` a string, an array of
strings, an array of token ids or an array of such arrays, at most 2048 entries, none
empty), each error naming the exact value (``input[3]``, ``input[1][7]``). Vectors go out
as JSON numbers or, for ``encoding_format: "base64"``, as the base64 of their
little-endian float32 bytes, which is what OpenAI sends and its SDKs decode.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from afmd.core.embeddings import EmbeddingRequest, Embeddings, Input
from afmd.errors import APIError, InvalidRequestError
from afmd.protocol.request import parse_json_body

KNOWN_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
ENCODING_FORMATS = ("float", "base64")
#: OpenAI's limit on the entries of ``input``.
MAX_INPUTS = 2048
_MAX_ECHO = 100


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"),
                       (str, "string"), (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_ECHO else f"{text[:_MAX_ECHO]}… ({len(text)} characters)"


def _wrong_type(param: str, expected: str, value: Any) -> InvalidRequestError:
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {expected}, but got {_type_name(value)}.",
        code="invalid_type",
        param=param,
    )


def _invalid(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_value", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[Any], param: str) -> tuple[int, ...]:
    """A token array: non-empty, non-negative integers (the vocabulary bound is the
    model's, checked once it is known)."""
    if not values:
        raise _invalid(param, f"'{param}' must not be an empty array of token ids.")
    for j, token in enumerate(values):
        if not _is_int(token):
            raise _wrong_type(f"{param}[{j}]", "an integer (a token id)", token)
        if token < 0:
            raise _invalid(f"{param}[{j}]", f"Token ids are >= 0; '{param}[{j}]' is {token}.")
    return tuple(values)


def _text(value: str, param: str) -> str:
    if not value:
        raise _invalid(param, f"'{param}' must not be an empty string.")
    return value


def parse_inputs(value: Any) -> tuple[tuple[Input, ...], tuple[str, ...]]:
    """``input`` as a tuple of inputs and the param naming each."""
    if value is None:
        raise InvalidRequestError(
            "Missing required parameter: 'input'.",
            code="missing_required_parameter", param="input",
        )
    if isinstance(value, str):
        return (_text(value, "input"),), ("input",)
    if not isinstance(value, list):
        raise _wrong_type("input", "a string or an array", value)
    if not value:
        raise _invalid("input", "'input' must not be an empty array.")
    if len(value) > MAX_INPUTS:
        raise _invalid(
            "input", f"'input' has {len(value)} entries; at most {MAX_INPUTS} are allowed."
        )
    first = value[0]
    if _is_int(first):  # one input given as token ids
        return (_token_ids(value, "input"),), ("input",)
    inputs: list[Input] = []
    params = tuple(f"input[{i}]" for i in range(len(value)))
    if isinstance(first, str):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise _wrong_type(params[i], "a string, as the entries before it", item)
            inputs.append(_text(item, params[i]))
    elif isinstance(first, list):
        for i, item in enumerate(value):
            if not isinstance(item, list):
                raise _wrong_type(params[i], "an array of token ids, as the entries before it",
                                  item)
            inputs.append(_token_ids(item, params[i]))
    else:
        raise _wrong_type("input[0]", "a string, a token id or an array of token ids", first)
    return tuple(inputs), params


def parse_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    for key in body:
        if key not in KNOWN_FIELDS:
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {_clip(key)}",
                code="unknown_parameter", param=key,
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _wrong_type("user", "a string", user)  # accepted and ignored, as in chat
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    elif not isinstance(encoding, str):
        raise _wrong_type("encoding_format", "a string", encoding)
    elif encoding not in ENCODING_FORMATS:
        raise _invalid(
            "encoding_format",
            f"Invalid value for 'encoding_format': '{_clip(encoding)}'. Supported values "
            "are: 'float', 'base64'.",
        )
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not _is_int(dimensions):
            raise _wrong_type("dimensions", "an integer", dimensions)
        if dimensions < 1:
            raise _invalid("dimensions", f"'dimensions' must be >= 1, got {dimensions}.")
    inputs, params = parse_inputs(body.get("input"))
    return EmbeddingRequest(
        inputs=inputs, params=params, model=model, encoding_format=encoding,
        dimensions=dimensions,
    )


def encode_response(result: Embeddings, request: EmbeddingRequest) -> bytes:
    """The ``list`` object, vectors encoded as the request asked."""
    vectors = result.vectors
    data: list[dict[str, Any]] = []
    if request.encoding_format == "base64":
        raw = vectors.astype("<f4", copy=False)
        for i in range(len(raw)):
            text = base64.b64encode(raw[i].tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": text})
    else:
        for i in range(len(vectors)):
            data.append({"object": "embedding", "index": i, "embedding": vectors[i]})
    return orjson.dumps(
        {
            "object": "list",
            "data": data,
            "model": result.model,
            "usage": {"prompt_tokens": result.prompt_tokens,
                      "total_tokens": result.prompt_tokens},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


class OpenAIEmbeddings:
    """The ``/v1/embeddings`` adapter: its body in, its list object out, its errors."""

    name = "openai_embeddings"

    def parse(self, raw: bytes) -> EmbeddingRequest:
        return parse_embedding_request(parse_json_body(raw))

    def body(self, result: Embeddings, request: EmbeddingRequest) -> bytes:
        return encode_response(result, request)

    def error_envelope(self, error: APIError) -> dict[str, Any]:
        return error.envelope()


OPENAI_EMBEDDINGS = OpenAIEmbeddings()
