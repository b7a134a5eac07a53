"""The top-level ``keep_alive`` field: how long the request's model stays loaded once idle.

An Ollama convention that IDE plugins send in whatever API they speak, so every dialect's
body accepts it. Ollama's own forms are accepted:

- a number of seconds (``300``, ``0.5``); ``0`` unloads the model right after the request,
  and any negative number keeps it loaded for good (``-1``, as afmd's own settings write);
- a Go duration string (``"5m"``, ``"1h30m"``, ``"90s"``, ``"500ms"``, ``"-1m"``), units
  ``ns``, ``us``/``µs``, ``ms``, ``s``, ``m``, ``h``; a string of a plain number counts as
  seconds (``"300"``, ``"-1"``), as Ollama reads its ``OLLAMA_KEEP_ALIVE``;
- ``null``: as if absent (the model's own keep-alive).

Anything else is a 400 naming ``keep_alive``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from afmd.dialects.fields.checks import invalid, quoted, wrong_type

PARAM = "keep_alive"

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"[+-]?(\d+(?:\.\d*)?|\.\d+)")


def _duration(text: str) -> float | None:
    """Seconds in a Go duration (or a plain number) string; None if it is neither."""
    text = text.strip()
    if _NUMBER.fullmatch(text):
        return float(text)
    sign = -1.0 if text.startswith("-") else 1.0
    body = text[1:] if text[:1] in "+-" else text
    if not body:
        return None
    total, pos = 0.0, 0
    for match in _PART.finditer(body):
        if match.start() != pos:
            return None
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    return sign * total if pos == len(body) and pos else None


def parse_keep_alive(value: Any, param: str = PARAM) -> float | None:
    """Seconds (negative: forever), or None when absent or null."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise wrong_type(param, "a number of seconds or a duration string", value)
    try:
        seconds = float(value) if not isinstance(value, str) else _duration(value)
    except OverflowError:  # an integer too large for a float
        seconds = math.inf
    if seconds is None:
        raise invalid(
            param,
            f"Invalid value for '{param}': {quoted(value)}. Expected a number of seconds "
            "(negative keeps the model loaded, 0 unloads it after the request) or a "
            "duration such as '5m', '1h30m' or '90s'.",
        )
    if not math.isfinite(seconds):
        raise invalid(param, f"Invalid value for '{param}': the number is too large.")
    return -1.0 if seconds < 0 else seconds


def keep_alive_of(body: Mapping[str, Any]) -> float | None:
    """The body's top-level ``keep_alive``, checked."""
    return parse_keep_alive(body.get(PARAM))


__all__ = ["PARAM", "keep_alive_of", "parse_keep_alive"]
