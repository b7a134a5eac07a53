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

from afmd.core.embedding_request import EmbeddingRequest, Embeddings, Input
from afmd.dialects.fields.body import parse_json_body
from afmd.dialects.fields.checks import (
    Scalar,
    invalid,
    missing,
    names,
    read_scalars,
    unknown_keys,
    wrong_type,
)
from afmd.dialects.fields.keep_alive import keep_alive_of
from afmd.errors import APIError

ENCODING_FORMATS = ("float", "base64")
#: The body's scalar fields, in the order they are checked (``input`` after them).
SCALARS = (
    Scalar("model", "string"),
    Scalar("user", "string"),  # accepted and ignored, as in chat
    Scalar("encoding_format", "string", default="float", choices=ENCODING_FORMATS),
    Scalar("dimensions", "integer", minimum=1),
)
KNOWN_FIELDS = names(SCALARS) | {"input", "keep_alive"}
#: OpenAI's limit on the entries of ``input``.
MAX_INPUTS = 2048


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[Any], param: str) -> tuple[int, ...]:
    """A token array: non-empty, non-negative integers (the vocabulary bound is the
    model's, checked once it is known)."""
    if not values:
        raise invalid(param, f"'{param}' must not be an empty array of token ids.")
    for j, token in enumerate(values):
        if not _is_int(token):
            raise wrong_type(f"{param}[{j}]", "an integer (a token id)", token)
        if token < 0:
            raise invalid(f"{param}[{j}]", f"Token ids are >= 0; '{param}[{j}]' is {token}.")
    return tuple(values)


def _text(value: str, param: str) -> str:
    if not value:
        raise invalid(param, f"'{param}' must not be an empty string.")
    return value


def parse_inputs(value: Any) -> tuple[tuple[Input, ...], tuple[str, ...]]:
    """``input`` as a tuple of inputs and the param naming each."""
    if value is None:
        raise missing("input")
    if isinstance(value, str):
        return (_text(value, "input"),), ("input",)
    if not isinstance(value, list):
        raise wrong_type("input", "a string or an array", value)
    if not value:
        raise invalid("input", "'input' must not be an empty array.")
    if len(value) > MAX_INPUTS:
        raise invalid(
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
                raise wrong_type(params[i], "a string, as the entries before it", item)
            inputs.append(_text(item, params[i]))
    elif isinstance(first, list):
        for i, item in enumerate(value):
            if not isinstance(item, list):
                raise wrong_type(params[i], "an array of token ids, as the entries before it",
                                  item)
            inputs.append(_token_ids(item, params[i]))
    else:
        raise wrong_type("input[0]", "a string, a token id or an array of token ids", first)
    return tuple(inputs), params


def parse_embedding_request(body: dict[str, Any], *, strict: bool = False) -> EmbeddingRequest:
    """Check every field; an unknown top-level one is ignored and listed (``strict``: a
    400 ``unknown_parameter``, as OpenAI answers)."""
    ignored = unknown_keys(body, KNOWN_FIELDS, strict=strict)
    values = read_scalars(body, SCALARS)
    inputs, params = parse_inputs(body.get("input"))
    return EmbeddingRequest(
        inputs=inputs, params=params, model=values["model"],
        encoding_format=values["encoding_format"], dimensions=values["dimensions"],
        keep_alive=keep_alive_of(body), ignored_fields=ignored,
    )


def encode_response(result: Embeddings, request: EmbeddingRequest) -> bytes:
    """The ``list`` object, vectors encoded as the request asked. Each vector is encoded
    by a call of its own: orjson holds the interpreter for a whole call, and a body of
    many long vectors built on a thread (afmd.http.routes.large_bodies) lets the event
    loop in between them."""
    vectors = result.vectors
    items: list[bytes] = []
    if request.encoding_format == "base64":
        raw = vectors.astype("<f4", copy=False)
        for i in range(len(raw)):
            text = base64.b64encode(raw[i].tobytes()).decode("ascii")
            items.append(orjson.dumps({"object": "embedding", "index": i, "embedding": text}))
    else:
        for i in range(len(vectors)):
            items.append(orjson.dumps({"object": "embedding", "index": i,
                                       "embedding": vectors[i]},
                                      option=orjson.OPT_SERIALIZE_NUMPY))
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return b"".join((b'{"object":"list","data":[', b",".join(items), b'],"model":',
                     orjson.dumps(result.model), b',"usage":', orjson.dumps(usage), b"}"))


class OpenAIEmbeddings:
    """The ``/v1/embeddings`` adapter: its body in, its list object out, its errors."""

    name = "openai_embeddings"

    def parse(self, raw: bytes, *, strict: bool = False) -> EmbeddingRequest:
        return parse_embedding_request(parse_json_body(raw), strict=strict)

    def body(self, result: Embeddings, request: EmbeddingRequest) -> bytes:
        return encode_response(result, request)

    def error_envelope(self, error: APIError) -> dict[str, Any]:
        return error.envelope()


OPENAI_EMBEDDINGS = OpenAIEmbeddings()
