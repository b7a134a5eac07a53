"""OpenAI's sampling fields beyond temperature and nucleus: biases, penalties, choices.

``logit_bias`` maps token ids (JSON object keys, so strings of digits) to a bias from -100
to 100 added to the token's logit before sampling: -100 bans a token, 100 all but forces
it. ``presence_penalty`` and ``frequency_penalty`` (-2 to 2) lower the logit of every token
the answer already holds, once for being there and once per occurrence. ``n`` asks for
several choices of the same prompt (1 to :data:`MAX_CHOICES`), decoded together. Whether a
biased id exists depends on the model: :func:`afmd.engine.batch.penalties.check_logit_bias`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from afmd.dialects.fields.checks import Scalar, as_number, invalid, wrong_type

__all__ = [
    "FREQUENCY_PENALTY",
    "MAX_CHOICES",
    "PRESENCE_PENALTY",
    "choices_scalar",
    "logit_bias_of",
]

#: Choices one request may ask for: each is a sequence of the same batch.
MAX_CHOICES = 8
#: OpenAI's bound on a bias.
MAX_BIAS = 100.0

PRESENCE_PENALTY = Scalar("presence_penalty", "number", default=0.0, minimum=-2.0,
                          maximum=2.0)
FREQUENCY_PENALTY = Scalar("frequency_penalty", "number", default=0.0, minimum=-2.0,
                           maximum=2.0)

_TOKEN_ID = re.compile(r"[0-9]{1,10}", re.ASCII)


def choices_scalar(what: str) -> Scalar:
    """``n``: 1 to :data:`MAX_CHOICES` choices of ``what``."""

    def bounded(value: int, param: str) -> None:
        if value > MAX_CHOICES:
            raise invalid(param, f"Invalid '{param}': {value}. afmd decodes at most "
                                 f"{MAX_CHOICES} {what} per request together; ask for fewer.")

    return Scalar("n", "integer", default=1, minimum=1, rule=bounded)


def logit_bias_of(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """The body's ``logit_bias`` as (token id, bias) pairs in the body's order (() when
    absent, null or empty)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise wrong_type("logit_bias", "an object mapping token ids to biases", value)
    pairs: list[tuple[int, float]] = []
    for key, bias in value.items():
        param = f"logit_bias.{key}"
        if not _TOKEN_ID.fullmatch(key):
            raise invalid(param, f"Invalid key in 'logit_bias': '{key[:40]}' is not a token "
                                 "id (a non-negative integer written as a string).")
        pairs.append((int(key), as_number(bias, param, -MAX_BIAS, MAX_BIAS)))
    return tuple(pairs)

