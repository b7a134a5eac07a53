"""Ollama's embedding bodies: ``/api/embed`` (``input``: a text or texts, ``truncate``,
``dimensions``) and the legacy ``/api/embeddings`` (``prompt``: one text), checked into
afmd's :class:`~afmd.core.embedding_request.EmbeddingRequest`, and their answers.

``/api/embed`` answers ``{"model", "embeddings", "total_duration", "load_duration",
"prompt_eval_count"}``; ``/api/embeddings`` answers ``{"embedding"}``. The vectors are
those ``/v1/embeddings`` gives for the same texts. ``truncate`` (on by default, as in
Ollama) cuts an input longer than the model's context (or ``options.num_ctx``) instead of
refusing it.
"""

from __future__ import annotations

from typing import Any

import orjson

from afmd.core.embedding_request import EmbeddingRequest, Embeddings
from afmd.dialects.fields.checks import (
    Scalar,
    invalid,
    read_scalars,
    unknown_keys,
    wrong_type,
)
from afmd.dialects.fields.keep_alive import keep_alive_of

__all__ = ["embed_body", "embed_request", "embeddings_body", "embeddings_request"]

EMBED_FIELDS = frozenset({"model", "input", "truncate", "options", "keep_alive",
                          "dimensions"})
EMBEDDINGS_FIELDS = frozenset({"model", "prompt", "options", "keep_alive"})
_EMBED = (
    Scalar("model", "string", required=True),
    Scalar("truncate", "boolean", default=True),
    Scalar("dimensions", "integer", minimum=1),
)
_NUM_CTX = Scalar("num_ctx", "integer", minimum=1)
_EMBEDDINGS = (
    Scalar("model", "string", required=True),
    Scalar("prompt", "string", default=""),
)


def _inputs(value: Any) -> tuple[str, ...]:
    """The texts; none (a missing, null or empty ``input``) is Ollama's load form."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise wrong_type("input", "a string or an array of strings", value)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise wrong_type(f"input[{i}]", "a string", item)
    return tuple(value)


def _context_window(body: dict[str, Any]) -> int | None:
    """``options.num_ctx``, the one option an embedding takes: Ollama loads the model with
    that window, so an input is cut to it (or refused, without ``truncate``), as
    LangChain's ``OllamaEmbeddings(num_ctx=...)`` asks. The others change nothing here,
    but ``options`` of the wrong type is the client's mistake, as Ollama's decoder says."""
    options = body.get("options")
    if options is None:
        return None
    if not isinstance(options, dict):
        raise wrong_type("options", "an object", options)
    return read_scalars(options, (_NUM_CTX,), "options.")["num_ctx"]


def embed_request(body: dict[str, Any], *, strict: bool = False) -> EmbeddingRequest:
    """An ``/api/embed`` body; without texts it only loads the model, as in Ollama, and
    the answer has no vectors."""
    ignored = unknown_keys(body, EMBED_FIELDS, strict=strict)
    values = read_scalars(body, _EMBED)
    window = _context_window(body)
    inputs = _inputs(body.get("input"))
    for i, text in enumerate(inputs):
        if not text:
            raise invalid(f"input[{i}]", "An input to embed must not be empty.")
    params = (("input",) if isinstance(body.get("input"), str)
              else tuple(f"input[{i}]" for i in range(len(inputs))))
    return EmbeddingRequest(inputs=inputs, params=params, model=values["model"],
                            dimensions=values["dimensions"], keep_alive=keep_alive_of(body),
                            truncate=values["truncate"], context_window=window,
                            ignored_fields=ignored)


def embeddings_request(body: dict[str, Any], *, strict: bool = False) -> EmbeddingRequest:
    """A legacy ``/api/embeddings`` body (an empty ``prompt`` only loads the model, and
    its embedding is empty)."""
    ignored = unknown_keys(body, EMBEDDINGS_FIELDS, strict=strict)
    values = read_scalars(body, _EMBEDDINGS)
    window = _context_window(body)
    prompt = values["prompt"]
    return EmbeddingRequest(inputs=(prompt,) if prompt else (), params=("prompt",),
                            model=values["model"], keep_alive=keep_alive_of(body),
                            context_window=window, ignored_fields=ignored)


def embed_body(result: Embeddings | None, model: str, *, total: float, load: float) -> bytes:
    """Each vector is encoded by a call of its own, as in ``/v1/embeddings``' answer
    (afmd.dialects.openai.embeddings): a thread building a large one lets the loop in."""
    vectors = result.vectors if result is not None else []
    rest = orjson.dumps({
        "total_duration": max(0, round(total * 1e9)),
        "load_duration": max(0, round(load * 1e9)),
        "prompt_eval_count": result.prompt_tokens if result is not None else 0,
    })
    listed = b",".join(orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY) for v in vectors)
    return b"".join((b'{"model":', orjson.dumps(model), b',"embeddings":[', listed, b"],",
                     rest[1:]))


def embeddings_body(result: Embeddings | None) -> bytes:
    vector = result.vectors[0] if result is not None else []
    return orjson.dumps({"embedding": vector}, option=orjson.OPT_SERIALIZE_NUMPY)
