"""Llama 3.1-3.3 JSON calls: the turn *is* the call, ``{"name": …, "parameters": {…}}``.

Llama's template asks for a bare JSON object (several joined by ``; ``), optionally after
``<|python_tag|>``, and the turn ends with ``<|eom_id|>``. A call is only recognised at
the very start of the turn, by its header (``"name"`` then ``"parameters"`` — or
``"arguments"``, which some fine-tunes write): any other text, a JSON answer included, is
content. The parameters stream as written. mlx-lm 0.32.2 has no parser for this format;
afmd recognises it from the vocabulary (``<|python_tag|>``, ``<|eom_id|>``).
"""

from __future__ import annotations

import json

from afmd.output.formats.base import CallContext, MarkupReader
from afmd.output.formats.jsonargs import JsonArguments, JsonValueEnd
from afmd.output.toolcalls import match_header

PYTHON_TAG = "<|python_tag|>"
#: Every marker the reader reads (see kimi.MARKERS); ``<|eom_id|>`` ends the turn, an end
#: id, not something read.
MARKERS = (PYTHON_TAG,)
_KEYS = ("parameters", "arguments")

_START, _HEAD, _ARGS, _REST, _AFTER, _TEXT = range(6)


def _header(text: str) -> tuple[str, int, int, int]:
    verdicts = [match_header(text, key) for key in _KEYS]
    for verdict in verdicts:
        if verdict[0] == "match":
            return verdict
    return next((v for v in verdicts if v[0] == "partial"), verdicts[0])


class LlamaReader(MarkupReader):
    def __init__(self, ctx: CallContext) -> None:
        super().__init__(ctx)
        self.state = _START
        self._args = JsonArguments()
        self._rest = JsonValueEnd()

    def step(self, final: bool) -> bool:
        state = self.state
        if state == _START:
            stripped = self.buf.lstrip()
            if not stripped:
                return False
            if stripped.startswith(PYTHON_TAG):
                self.skip_ws()
                self.cut(len(PYTHON_TAG))
                self.state = _HEAD
            elif PYTHON_TAG.startswith(stripped) and not final:
                return False
            else:
                self.state = _HEAD if stripped[0] == "{" and self.ctx.calls_on else _TEXT
            return True
        if state == _HEAD:
            verdict, name_start, name_end, value_start = _header(self.buf)
            if verdict == "partial" and not final:
                return False
            if verdict != "match" or self.buf[value_start] not in "{[" \
                    or not self.ctx.calls_on:
                self.state = _TEXT  # not a call: the rest of the turn is text
                return True
            name = json.loads(self.buf[name_start:name_end])
            self.cut(value_start)
            self.open_call(name)
            self._args = JsonArguments()
            self.state = _ARGS
            return True
        if state == _ARGS:
            done = self._args.step(self, final)
            if done is None:
                self.state = _TEXT
                return True
            if done:
                self.close_call()
                self._rest = JsonValueEnd()
                self._rest.depth = 1  # inside the call's object
                self.state = _REST
                return True
            return False
        if state == _REST:
            if not self.buf:
                return False
            self.cut(self._rest.feed(self.buf))
            if self._rest.done:
                self.state = _AFTER
                return True
            return False
        if state == _AFTER:
            self.skip_ws()
            if self.buf.startswith(";"):
                self.cut(1)
                self.skip_ws()
                self.state = _HEAD
                return True
            if not self.buf:
                return False
            self.state = _TEXT
            return True
        self.content(self.buf, self.at)  # _TEXT: the rest of the turn
        self.buf = ""
        return False


def reader(ctx: CallContext) -> LlamaReader:
    return LlamaReader(ctx)
