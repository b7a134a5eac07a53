"""Structured logging: one structlog pipeline for afmd's own events and the access log.

Anything a client controls (path, headers, model name) ends up in log lines, so every
string value is passed through :func:`sanitize` first: control, line-separator and bidi
characters are percent-encoded, which makes it impossible for a request to start a new
log line or visually reorder one, whichever renderer is used.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import unicodedata
from collections.abc import MutableMapping
from typing import Any, TextIO

import orjson
import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}

# Characters that can end or reorder a line in some viewer, beyond the C0/C1 controls.
_UNSAFE_EXTRA = frozenset("\u2028\u2029\u0085\u061c\u200e\u200f\u202a\u202b\u202c\u202d"
                          "\u202e\u2066\u2067\u2068\u2069\ufeff%")


def _unsafe(ch: str) -> bool:
    return ch in _UNSAFE_EXTRA or unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs")


def sanitize(text: str) -> str:
    """Percent-encode (UTF-8) every character that could forge or disguise a log line."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text
    out: list[str] = []
    for ch in text:
        if _unsafe(ch):
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass")))
        else:
            out.append(ch)
    return "".join(out)


def _sanitize_values(value: Any) -> Any:
    if isinstance(value, str):
        return sanitize(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, dict):
        return {sanitize(str(k)): _sanitize_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_sanitize_values(v) for v in value]
    # Anything else (an exception, a path, a dataclass) would be rendered through its
    # str()/repr() or natively by orjson, past this processor: render it here instead.
    return sanitize(str(value))


def sanitize_event(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: sanitize every string in the event, keys included."""
    return {sanitize(str(k)): _sanitize_values(v) for k, v in event_dict.items()}


def _single_line(renderer: Any) -> Any:
    """The console renderer puts tracebacks and stacks on lines of their own; values are
    sanitized by then, so every newline left is the renderer's and can be joined."""

    def render(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> str:
        return str(renderer(logger, method, event_dict)).replace("\n", " ")

    return render


#: Held for every line written to the log stream, by structlog's printer and by the stdlib
#: handler alike: both write from several threads (the event loop, model loads, the
#: engine's), and structlog's own lock is its alone, so a stdlib line could land between
#: a structlog line and its newline (two JSON objects on one line, then an empty one).
_LINE_LOCK = threading.RLock()


class _SafePrintLogger:
    """structlog's printer: each line written whole (see ``_LINE_LOCK``), and never an
    exception: a closed or broken log stream (the reader of a pipe went away) must not
    turn ``log.info`` into an exception in whatever called it, such as the SIGTERM
    handler, which would then never stop the server. Like stdlib logging, which swallows
    write errors in ``Handler.handleError``."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def msg(self, message: str) -> None:
        with contextlib.suppress(OSError, ValueError), _LINE_LOCK:
            self.stream.write(message + "\n")
            self.stream.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _LineHandler(logging.StreamHandler):
    """The stdlib handler, its lines written under ``_LINE_LOCK`` as structlog's are."""

    def createLock(self) -> None:
        # The stdlib's own: it also has logging make the handler's lock new in a forked
        # child (a lock held by another thread at the fork would be held there for good),
        # which, the lock being _LINE_LOCK, keeps the printer's usable there too.
        super().createLock()
        self.lock = _LINE_LOCK


def _orjson_dumps(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=str).decode()


def configure(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Set up structlog and route stdlib logging (mlx-lm, sanic) through the same output."""
    numeric = _LEVELS.get(level, logging.INFO)
    renderer: Any
    if fmt == "console":
        renderer = _single_line(structlog.dev.ConsoleRenderer(colors=False))
    else:
        renderer = structlog.processors.JSONRenderer(serializer=_orjson_dumps)
    pre_chain: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    printer = _SafePrintLogger(stream or sys.stderr)
    structlog.configure(
        processors=[
            *pre_chain,
            structlog.processors.format_exc_info,
            sanitize_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_: printer,
        cache_logger_on_first_use=False,
    )
    handler = _LineHandler(stream or sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                sanitize_event,
                renderer,
            ],
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                *pre_chain,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    for noisy in ("sanic.access", "sanic.root", "sanic.server", "sanic.error"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


def get_logger(name: str = "afmd") -> Any:
    return structlog.get_logger(name)
