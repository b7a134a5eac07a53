"""The logits processors a request's sampling settings add: biases and penalties.

They are mlx-lm's own (``make_logits_processors``' logit bias and repetition penalty,
``make_presence_penalty`` and ``make_frequency_penalty``), in mlx-lm's order, so a request
gets what mlx-lm computes. One thing differs: the token context mlx-lm hands a processor
is the whole sequence, the prompt included, where OpenAI's presence and frequency
penalties count the tokens *generated so far*. Those two are therefore given the tokens
after the prompt only: the context's length at the first call, when it holds exactly the
prompt, marks where the output begins (in the batch and in mlx-vlm's loop alike, whatever
prefix the cache supplied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from afmd.engine.generation import SamplingParams
from afmd.errors import InvalidRequestError

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class OverOutput:
    """A processor applied to the generated tokens alone (see the module's docstring)."""

    __slots__ = ("_inner", "_start")

    def __init__(self, inner: LogitsProcessor) -> None:
        self._inner = inner
        self._start: int | None = None

    def __call__(self, tokens: Any, logits: mx.array) -> mx.array:
        if self._start is None:
            self._start = len(tokens)
        if len(tokens) <= self._start:
            return logits
        return self._inner(tokens[self._start:], logits)


#: A repetition window longer than any sequence: the whole of it (as Ollama reads a huge
#: ``repeat_last_n``).
_LONGEST_WINDOW = 1 << 30


def sampling_processors(params: SamplingParams, max_tokens: int) -> list[LogitsProcessor]:
    """The processors ``params`` ask for, fresh for one sequence (they keep state)."""
    # mlx-lm imports transformers: not before a model is loaded (tests/test_import_footprint).
    from mlx_lm.sample_utils import (
        make_frequency_penalty,
        make_logits_processors,
        make_presence_penalty,
    )

    kwargs: dict[str, Any] = {}
    if params.repetition_context is not None:
        # mlx slices the tokens by it, and a slice index must fit 32 bits: a larger one
        # failed the step of every sequence in the batch, not only this one's.
        kwargs["repetition_context_size"] = min(max(1, params.repetition_context),
                                                _LONGEST_WINDOW)
    processors: list[LogitsProcessor] = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty or None,
        **kwargs,
    )
    # The whole output counts (OpenAI's); a window as long as the output is all of it.
    window = max(1, max_tokens)
    if params.presence_penalty:
        processors.append(OverOutput(make_presence_penalty(params.presence_penalty, window)))
    if params.frequency_penalty:
        processors.append(OverOutput(make_frequency_penalty(params.frequency_penalty, window)))
    return processors


def check_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int, model: str) -> None:
    """Every biased id within the model's vocabulary: a bias past its logits would be
    written outside them."""
    for token, _ in bias:
        if token >= vocab_size:
            raise InvalidRequestError(
                f"Invalid token id {token} in 'logit_bias': the model '{model}' has ids "
                f"0-{vocab_size - 1}.", code="invalid_value", param=f"logit_bias.{token}")


__all__ = ["OverOutput", "check_logit_bias", "sampling_processors"]
