"""An embeddings request and its result, whatever dialect carried them.

A dialect's parser builds :class:`EmbeddingRequest` after checking every field; the
embedding service (:mod:`afmd.service.embedding_pipeline`) answers it with :class:`Embeddings`,
which the
dialect encodes. Each input keeps the ``param`` that names it on the wire, so an error
found past the parser (a text too long for the model's context, a token id outside its
vocabulary) still points at the exact value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: An input: text to tokenize, or token ids to embed as they are.
Input = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    inputs: tuple[Input, ...]
    #: Per input, the param naming it: ``input`` for a lone input, else ``input[i]``.
    params: tuple[str, ...]
    model: str | None = None
    encoding_format: str = "float"  # "float" | "base64"
    dimensions: int | None = None
    keep_alive: float | None = None  # as afmd.core.request.ChatRequest's
    #: An input longer than the model's context is cut to it (Ollama's ``truncate``)
    #: instead of refused.
    truncate: bool = False
    #: A window smaller than the model's context (Ollama's ``options.num_ctx``), which
    #: each input must fit or, with ``truncate``, is cut to; a larger one is the model's.
    context_window: int | None = None
    ignored_fields: tuple[str, ...] = ()  # as afmd.core.request.ChatRequest's


@dataclass(frozen=True, slots=True)
class Embeddings:
    #: One float32 row per input, in input order (a numpy array; typed loosely here so
    #: the core stays free of third-party imports).
    vectors: Any
    prompt_tokens: int
    model: str  # what the response reports: the name the client asked for, or the default
    load_seconds: float = 0.0  # waiting for the model (its load, when it was not loaded)
