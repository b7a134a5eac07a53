"""An OpenAI (legacy) Completions body checked into a :class:`CompletionRequest`.

The prompt comes in four shapes (a string, strings, token ids, arrays of token ids), each
prompt one choice; whether token ids exist in the model's vocabulary and whether a prompt
fits its context is for the pipeline to say, which knows the model. Every other problem is
a 400 here, naming the exact param (``prompt[1][3]``).
"""

from __future__ import annotations

from typing import Any

from afmd.core.request import CompletionRequest
from afmd.dialects.fields.checks import (
    Scalar,
    invalid,
    missing,
    names,
    read_scalars,
    string_list,
    unknown_keys,
    wrong_type,
)
from afmd.dialects.fields.extensions import (
    REPEAT_PENALTY,
    REPETITION_PENALTY,
    repetition_penalty_of,
)
from afmd.dialects.fields.keep_alive import keep_alive_of
from afmd.dialects.fields.prediction import parse_prediction
from afmd.dialects.fields.sampling import (
    FREQUENCY_PENALTY,
    PRESENCE_PENALTY,
    choices_scalar,
    logit_bias_of,
)
from afmd.dialects.openai.chat_body import parse_stream_options, stop_limit

__all__ = ["COMPLETION_SCALARS", "IGNORED_FIELDS", "KNOWN_FIELDS", "MAX_PROMPTS",
           "parse_completion_request"]

#: Prompts one request may carry: each is a sequence decoded in the same batch.
MAX_PROMPTS = 64
#: OpenAI's bound on ``logprobs`` for completions.
MAX_LOGPROBS = 5

# Fields OpenAI defines that change nothing a local model could honour (as for chat).
IGNORED_FIELDS = frozenset({"user"})


def _best_of_one(value: int, param: str) -> None:
    if value != 1:
        raise invalid(
            param,
            f"Invalid '{param}': {value}. afmd returns every completion it generates; use "
            "'n' for several completions of a prompt.",
        )


COMPLETION_SCALARS = (
    Scalar("model", "string"),
    Scalar("suffix", "string"),
    Scalar("max_tokens", "integer", default=16, minimum=0),
    Scalar("temperature", "number", default=1.0, minimum=0.0, maximum=2.0),
    Scalar("top_p", "number", default=1.0, minimum=0.0, maximum=1.0),
    Scalar("top_k", "integer", default=0, minimum=0),
    Scalar("min_p", "number", default=0.0, minimum=0.0, maximum=1.0),
    REPETITION_PENALTY,
    REPEAT_PENALTY,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    Scalar("seed", "integer"),
    choices_scalar("completions of a prompt"),
    Scalar("best_of", "integer", default=1, minimum=1, rule=_best_of_one),
    Scalar("echo", "boolean", default=False),
    Scalar("logprobs", "integer", minimum=0, maximum=MAX_LOGPROBS),
    Scalar("stream", "boolean", default=False),
    # Ignored, but still typed: OpenAI refuses a non-string ``user``, and a client that
    # sends one should learn of it here rather than from OpenAI later (as in embeddings).
    Scalar("user", "string"),
)

# ``chat_template_kwargs`` is not among them: a completion has no chat template, so a client
# sending it (one extra body for every endpoint) learns from the header that it was ignored.
KNOWN_FIELDS = IGNORED_FIELDS | names(COMPLETION_SCALARS) | {
    "prompt", "stop", "stream_options", "keep_alive", "prediction", "logit_bias"}


def parse_completion_request(body: dict[str, Any], *, strict: bool = False) -> CompletionRequest:
    """Check every field of a Completions body; raise on the first problem. An unknown
    top-level field is ignored and listed (``strict``: a 400, as in chat)."""
    ignored = unknown_keys(body, KNOWN_FIELDS, strict=strict)
    prompts = parse_prompt(body.get("prompt"))
    values = read_scalars(body, COMPLETION_SCALARS)
    if len(prompts) * values["n"] > MAX_PROMPTS:
        raise invalid("n", f"{len(prompts)} prompts with 'n' {values['n']} make "
                           f"{len(prompts) * values['n']} completions; afmd decodes at most "
                           f"{MAX_PROMPTS} per request.")
    if body.get("best_of") is not None and values["best_of"] < values["n"]:
        # OpenAI's rule: best_of counts the candidates n is chosen from, so fewer
        # candidates than answers is a contradiction, not a request for n answers.
        raise invalid("best_of", f"Invalid 'best_of': {values['best_of']} is less than 'n' "
                                 f"({values['n']}); 'best_of' must be at least 'n'.")
    if values["suffix"] is not None and values["echo"]:
        raise invalid("echo", "'echo' cannot be combined with 'suffix': a fill-in-the-middle "
                              "completion has no prompt of its own to echo.")
    return CompletionRequest(
        prompts=prompts,
        model=values["model"],
        suffix=values["suffix"],
        stream=values["stream"],
        include_usage=parse_stream_options(body.get("stream_options"), values["stream"]),
        max_tokens=values["max_tokens"],
        temperature=values["temperature"],
        top_p=values["top_p"],
        top_k=values["top_k"],
        min_p=values["min_p"],
        repetition_penalty=repetition_penalty_of(body),
        presence_penalty=values["presence_penalty"],
        frequency_penalty=values["frequency_penalty"],
        logit_bias=logit_bias_of(body),
        seed=values["seed"],
        n=values["n"],
        stop=string_list(body.get("stop"), "stop", stop_limit(strict)),
        echo=values["echo"],
        logprobs=values["logprobs"],
        prediction=parse_prediction(body.get("prediction")),
        keep_alive=keep_alive_of(body),
        ignored_fields=ignored,
    )


def parse_prompt(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """The prompts: a string, an array of strings, an array of token ids, or an array of
    arrays of token ids (the shape is the first element's; a mix is refused)."""
    if value is None:
        raise missing("prompt")
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise wrong_type("prompt", "a string, an array of strings, an array of token ids or "
                                   "an array of arrays of token ids", value)
    if not value:
        raise invalid("prompt", "'prompt' must not be an empty array.")
    first = value[0]
    if _is_token(first):
        return (_token_ids(value, "prompt"),)
    if len(value) > MAX_PROMPTS:
        raise invalid("prompt", f"'prompt' holds {len(value)} prompts; afmd accepts at most "
                                f"{MAX_PROMPTS} per request.")
    prompts: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        param = f"prompt[{i}]"
        if isinstance(first, str):
            if not isinstance(item, str):
                raise wrong_type(param, "a string (like every prompt of the array)", item)
            prompts.append(item)
        elif isinstance(first, list):
            if not isinstance(item, list):
                raise wrong_type(param, "an array of token ids (like every prompt of the "
                                        "array)", item)
            if not item:
                raise invalid(param, f"'{param}' must hold at least one token id.")
            prompts.append(_token_ids(item, param))
        else:
            raise wrong_type(param, "a string, a token id or an array of token ids", item)
    return tuple(prompts)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[Any], param: str) -> tuple[int, ...]:
    for j, token in enumerate(values):
        if not _is_token(token):
            raise wrong_type(f"{param}[{j}]", "a token id (an integer)", token)
        if token < 0:
            raise invalid(f"{param}[{j}]", f"Invalid token id {token}: ids are not negative.")
    return tuple(values)
