"""Mistral and Devstral: ``[TOOL_CALLS]`` and no end marker.

Two forms, as mlx-lm's parser reads them: the newer ``[TOOL_CALLS]name[ARGS]{…}`` (one
marker per call, or several ``name[ARGS]{…}`` after one marker; ``[CALL_ID]id`` may sit
before ``[ARGS]``), and the older ``[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]``.
Both stream their arguments as written. With no end marker, what follows a call's JSON
decides: another call, or the end of the calls (then it is content). Mistral's older
templates insist on call ids of nine letters and digits, so this family's calls get
such ids.
"""

from __future__ import annotations

import json
import re
import secrets
import string

from afmd.output.formats.base import CallContext, MarkupReader
from afmd.output.formats.jsonargs import JsonArguments, JsonValueEnd
from afmd.output.toolcalls import match_header

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
#: Every marker the reader reads (see kimi.MARKERS).
MARKERS = (MARKER, ARGS, CALL_ID)
# A name as mlx-lm's parser reads it (``[\w-]+``), and the dots, colons and slashes of a
# namespaced one (base.NAME: an MCP server's tool, as Ollama's clients name it): it ends
# at ``[ARGS]`` or ``[CALL_ID]`` all the same.
_HEADER = re.compile(r"([\w.:/-]+)\s*(?:\[CALL_ID\]\s*[\w-]*\s*)?\[ARGS\]")
_HEADER_SO_FAR = re.compile(r"[\w.:/-]*\s*(?:\[CALL_ID\]\s*[\w-]*\s*)?")
_ALPHABET = string.ascii_letters + string.digits

_OUT, _AFTER_MARKER, _HEAD, _ARGS, _AFTER, _LIST, _OBJ_ARGS, _OBJ_REST, _JUNK = range(9)


def call_id(name: str, index: int) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(9))


def _header(text: str) -> tuple[str, str, int]:
    """("call", name, length) / ("maybe", "", 0) / ("no", "", 0) for a call header."""
    match = _HEADER.match(text)
    if match:
        return "call", match.group(1), match.end()
    rest = text[_HEADER_SO_FAR.match(text).end():]  # type: ignore[union-attr]
    if not rest or ARGS.startswith(rest) or CALL_ID.startswith(rest):
        return "maybe", "", 0
    return "no", "", 0


class MistralReader(MarkupReader):
    def __init__(self, ctx: CallContext) -> None:
        super().__init__(ctx)
        self.state = _OUT
        self._args = JsonArguments()
        self._rest = JsonValueEnd()
        self._raw = ""  # the list form's text so far, for the whole-parse fallback

    def step(self, final: bool) -> bool:
        state = self.state
        if state == _OUT:
            if self.outside((MARKER,), final) is None:
                return False
            self.state = _AFTER_MARKER
            return True
        if state == _AFTER_MARKER:
            self.skip_ws()
            if not self.buf:
                if final:
                    self.state = _OUT
                    return True
                return False
            if self.buf[0] == "[":
                self.cut(1)
                self._raw = "["
                self.state = _LIST
            else:
                self._raw = ""
                self.state = _HEAD
            return True
        if state == _AFTER:
            self.skip_ws()
            if self.buf.startswith(MARKER):
                self.cut(len(MARKER))
                self.state = _AFTER_MARKER
                return True
            if not final and (not self.buf or MARKER.startswith(self.buf)):
                return False
        if state in (_HEAD, _AFTER):
            verdict, name, length = _header(self.buf)
            if verdict == "call":
                self._raw = self.cut(length)
                if self.ctx.calls_on:
                    self.open_call(name)
                self._args = JsonArguments()
                self.state = _ARGS
                return True
            if verdict == "maybe" and not final:
                return False
            # Not a call: after calls, the rest is content; right after the marker, the
            # text is read whole by mlx-lm's parser at the end.
            self._raw = ""
            self.state = _OUT if state == _AFTER else _JUNK
            return True
        if state == _ARGS:
            done = self._args.step(self, final)
            if done is None:
                self.state = _JUNK
                if self.log.streaming:
                    self.log.close()
                return True
            if done:
                self.close_call()
                self.state = _AFTER
                return True
            return False
        if state == _LIST:
            return self._list(final)
        if state == _OBJ_ARGS:
            done = self._args.step(self, final)
            if done:
                self.close_call()
                self._rest = JsonValueEnd()
                self._rest.depth = 1  # inside the call's object
                self.state = _OBJ_REST
                return True
            if done is None:
                self.state = _JUNK
                return True
            return False
        if state == _OBJ_REST:
            if not self.buf:
                return False
            self.cut(self._rest.feed(self.buf))  # e.g. the call's "id": skipped
            if self._rest.done:
                self._raw = "["
                self.state = _LIST
                return True
            return False
        # _JUNK: everything to the end of generation, parsed whole.
        if not final:
            return False
        raw, self.buf = self._raw + self.buf, ""
        if self.ctx.calls_on:
            self.whole(raw, "")
        self.state = _OUT
        return True

    def _list(self, final: bool) -> bool:
        """Between the list's objects: the next call's header, or the list's end."""
        self.skip_ws()
        if self.buf.startswith(","):
            self.cut(1)
            self.skip_ws()
        if self.buf.startswith("]"):
            self.cut(1)
            self.state = _OUT
            return True
        verdict, name_start, name_end, value_start = match_header(self.buf)
        if verdict == "partial" and not final:
            return False
        if verdict != "match" or self.buf[value_start] not in "{[":
            self.state = _JUNK  # the rest of the list is read whole by mlx-lm's parser
            return True
        name = json.loads(self.buf[name_start:name_end])
        self.cut(value_start)
        if self.ctx.calls_on:
            self.open_call(name)
        self._args = JsonArguments()
        self.state = _OBJ_ARGS
        return True
