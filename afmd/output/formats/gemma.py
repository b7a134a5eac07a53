"""Gemma's calls: ``call:NAME{key:value,…}`` inside the family's call tokens.

Gemma 4 writes ``<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>``,
FunctionGemma ``<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}
<end_function_call>``: bare keys, strings between the family's quote token, other values
as JSON (Gemma 4 also nests objects with bare keys and quoted strings). Strings stream
into the call's JSON as they are written; other values once complete.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from afmd.output.formats.base import CallContext, MarkupReader, is_name
from afmd.output.formats.values import ArgumentsObject, dumps, escape, parse_value
from afmd.output.markers import partial_suffix


@dataclass(frozen=True, slots=True)
class GemmaSyntax:
    start: str
    end: str
    quote: str

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker the reader reads (see ``kimi.MARKERS``)."""
        return (self.start, self.end, self.quote)


GEMMA4 = GemmaSyntax("<|tool_call>", "<tool_call|>", '<|"|>')
FUNCTION_GEMMA = GemmaSyntax("<start_function_call>", "<end_function_call>", "<escape>")

_OUT, _PREFIX, _NAME, _ARGS, _KEY, _VALUE, _STRING, _AFTER, _JUNK = range(9)
_KEY_IN_OBJECT = re.compile(r"(?<=[{,])\s*(\w+)\s*:")


class _HeldValue:
    """A non-string value, held until it ends (a top-level ``,`` or ``}``, not included):
    it is only known to be JSON, or one of the family's looser literals, when whole. Its
    strings are the family's (between quote tokens) or JSON's (afmd's grammar writes
    non-string values as JSON): a ``,`` or bracket inside either is text."""

    __slots__ = ("depth", "escape", "in_json", "in_string", "quote", "raw")

    def __init__(self, quote: str) -> None:
        self.quote = quote
        self.depth = 0
        self.in_string = False
        self.in_json = False  # inside a JSON string
        self.escape = False  # after its backslash
        self.raw = ""

    def take(self) -> str:
        """The value as JSON; the scanner starts over for the next one."""
        text = dumps(_convert(self.raw, self.quote))
        self.depth, self.in_string, self.in_json, self.escape, self.raw = \
            0, False, False, False, ""
        return text

    def feed(self, text: str) -> tuple[int, bool]:
        """(characters consumed, whether the value ended). A partial quote is held."""
        n, ended = self._scan(text)
        self.raw += text[:n]
        return n, ended

    def _scan(self, text: str) -> tuple[int, bool]:
        i = 0
        while i < len(text):
            if self.in_json:
                if self.escape:
                    self.escape = False
                elif text[i] == "\\":
                    self.escape = True
                elif text[i] == '"':
                    self.in_json = False
                i += 1
                continue
            if text.startswith(self.quote, i):
                self.in_string = not self.in_string
                i += len(self.quote)
                continue
            if self.quote.startswith(text[i:]):
                return i, False  # maybe a quote: wait for the rest
            ch = text[i]
            if not self.in_string:
                if ch == '"':
                    self.in_json = True
                elif ch in "[{":
                    self.depth += 1
                elif ch in "]}":
                    if self.depth == 0:
                        return i, True
                    self.depth -= 1
                elif ch == "," and self.depth == 0:
                    return i, True
            i += 1
        return i, False


class GemmaReader(MarkupReader):
    def __init__(self, ctx: CallContext, syntax: GemmaSyntax) -> None:
        super().__init__(ctx)
        self.s = syntax
        self.state = _OUT
        self._args = ArgumentsObject()
        self._name = ""
        self._raw = ""  # the block so far, for the whole-parse fallback
        self._held = _HeldValue(syntax.quote)
        self._first = 0

    def step(self, final: bool) -> bool:
        s = self.s
        state = self.state
        if state == _OUT:
            if self.outside((s.start,), final) is None:
                return False
            self._raw = ""
            self._first = len(self.log.calls)
            self.state = _PREFIX
            return True
        if state == _PREFIX:
            self._raw += self.buf[: len(self.buf) - len(self.buf.lstrip())]
            marker, maybe = self.starts(("call:", s.end))
            if marker == "call:":
                self._raw += marker
                self.state = _NAME
            elif marker == s.end:
                self.state = _OUT
            elif maybe and not final:
                return False
            else:
                self.state = _JUNK
            return True
        if state == _NAME:
            i = self.buf.find("{")
            if i == -1:
                if final or len(self.buf) > 256:
                    self.state = _JUNK
                    return True
                return False
            name = self.buf[:i].strip()
            if not is_name(name):
                self.state = _JUNK
                return True
            self._raw += self.cut(i + 1)
            self._name = name
            self._args.keys = 0
            if self.ctx.calls_on:
                self.open_call(name)
            self.state = _ARGS
            return True
        if state == _ARGS:
            self.skip_ws()
            if not self.buf:
                return self._cut_off(final)
            if self.buf[0] == "}":
                self.cut(1)
                self._close()
                self.state = _AFTER
            elif self.buf[0] == ",":
                self.cut(1)
            else:
                self.state = _KEY
            return True
        if state == _KEY:
            i = self.buf.find(":")
            if i == -1:
                if final or len(self.buf) > 256:
                    return self._cut_off(True)
                return False
            key = self.buf[:i].strip().strip('"')
            self.cut(i + 1)
            self.write(self._args.key(key))
            self.skip_ws()
            self.state = _VALUE
            return True
        if state == _VALUE:
            if not self.buf or (s.quote.startswith(self.buf) and not final):
                return self._cut_off(final)
            if self.buf.startswith(s.quote):
                self.cut(len(s.quote))
                self.write('"')
                self.state = _STRING
                return True
            n, ended = self._held.feed(self.buf)
            self.cut(n)
            if not ended and not final:
                return False
            self.write(self._held.take())
            if not ended:
                return self._cut_off(True)
            self.state = _ARGS
            return True
        if state == _STRING:
            i = self.buf.find(s.quote)
            if i == -1:
                keep = 0 if final else partial_suffix(self.buf, (s.quote,))
                self.write(escape(self.cut(len(self.buf) - keep)))
                if final:
                    self.write('"')
                    return self._cut_off(True)
                return False
            self.write(escape(self.cut(i)) + '"')
            self.cut(len(s.quote))
            self.state = _ARGS
            return True
        if state == _AFTER:
            marker, maybe = self.starts(("call:", s.end))
            if marker == "call:":
                self.state = _NAME
            elif marker == s.end:
                self.state = _OUT
            elif maybe and not final:
                return False
            elif final:
                self.state = _OUT
            else:
                self.cut(1)  # stray text between calls
            return True
        # _JUNK: the block's rest, parsed whole at its end marker.
        got = self.rest_of_block(s.end, final)
        if got is None:
            return False
        rest, closed = got
        if self.ctx.calls_on and len(self.log.calls) == self._first:
            raw = self._raw + rest
            self.whole(raw, s.start + raw + s.end if closed else "")
        self.state = _OUT
        return True

    def _cut_off(self, final: bool) -> bool:
        if not final:
            return False
        self._close()
        self.state = _OUT
        return True

    def _close(self) -> None:
        if not self.log.streaming:
            return
        if self.state == _VALUE and self._held.raw:
            self.write(self._held.take())
        self.write(self._args.close())
        self.close_call()

    def end(self) -> None:
        self._close()


def _convert(text: str, quote: str) -> object:
    """A non-string value: JSON once its quote tokens are JSON quotes and its bare keys
    quoted (Gemma 4's nested objects), else as :func:`parse_value` reads it."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    strings: list[str] = []

    def hold(match: re.Match[str]) -> str:
        strings.append(match.group(1))
        return f"\x00{len(strings) - 1}\x00"

    body = re.sub(re.escape(quote) + "(.*?)" + re.escape(quote), hold, text, flags=re.DOTALL)
    body = _KEY_IN_OBJECT.sub(lambda m: f'"{m.group(1)}":', body)
    for i, value in enumerate(strings):
        body = body.replace(f"\x00{i}\x00", json.dumps(value))
    try:
        return json.loads(body)
    except ValueError:
        return parse_value(text)


def reader(syntax: GemmaSyntax) -> Callable[[CallContext], GemmaReader]:
    return lambda ctx: GemmaReader(ctx, syntax)
