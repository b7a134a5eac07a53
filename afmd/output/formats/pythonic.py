"""Pythonic calls (LFM2 and others): ``<|tool_call_start|>[f(a=1, b="x"), g()]<|tool_call_end|>``.

The list holds one or more calls with keyword arguments written as Python (or JSON)
literals. Each call starts when its name is complete; each argument is written into the
call's JSON once its literal ends (the next top-level comma or the closing parenthesis):
a literal is only known to be one when it is whole. Text the reader cannot follow is
read whole by mlx-lm's parser at the end marker.
"""

from __future__ import annotations

from afmd.output.formats.base import CallContext, MarkupReader, is_name
from afmd.output.formats.values import ArgumentsObject, Trim, ValueStream

START, END = "<|tool_call_start|>", "<|tool_call_end|>"
#: Every marker the reader reads (see kimi.MARKERS).
MARKERS = (START, END)

_OUT, _LIST, _NAME, _ARGS, _KEY, _VALUE, _SEP, _TAIL, _JUNK = range(9)


class LiteralEnd:
    """Where a Python/JSON literal ends: at a top-level ``,`` or ``)`` (not included)."""

    __slots__ = ("depth", "escape", "quote")

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""
        self.escape = False

    def feed(self, text: str) -> int:
        """Characters of ``text`` in the literal; ``len(text)`` while it goes on."""
        for i, ch in enumerate(text):
            if self.quote:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "\"'":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                if self.depth == 0:
                    return i
                self.depth -= 1
            elif ch == "," and self.depth == 0:
                return i
        return len(text)


class PythonicReader(MarkupReader):
    def __init__(self, ctx: CallContext, start: str = START, end: str = END) -> None:
        super().__init__(ctx)
        self.markers = (start, end)
        self.state = _OUT
        self._raw = ""
        self._first = 0  # calls before this block
        self._args = ArgumentsObject()
        self._scan = LiteralEnd()

    def _consume(self, n: int) -> str:
        text = self.cut(n)
        self._raw += text
        return text

    def step(self, final: bool) -> bool:
        state = self.state
        if state == _OUT:
            if self.outside((self.markers[0],), final) is None:
                return False
            self._raw = ""
            self._first = len(self.log.calls)
            self.state = _LIST
            return True
        if state == _LIST:
            self._consume(len(self.buf) - len(self.buf.lstrip()))
            if not self.buf:
                return self._cut_off(final)
            if self.buf[0] != "[":
                self.state = _JUNK
                return True
            self._consume(1)
            self.state = _NAME
            return True
        if state == _NAME:
            i = self.buf.find("(")
            if i == -1:
                if final or len(self.buf) > 256:
                    self.state = _JUNK
                    return True
                return False
            name = self.buf[:i].strip()
            if not is_name(name):
                self.state = _JUNK
                return True
            self._consume(i + 1)
            if self.ctx.calls_on:
                self.open_call(name)
            self._args.keys = 0
            self.state = _ARGS
            return True
        if state == _ARGS:
            self._consume(len(self.buf) - len(self.buf.lstrip()))
            if not self.buf:
                return self._cut_off(final)
            if self.buf[0] == ")":
                self._consume(1)
                self._close()
                self.state = _SEP
                return True
            if self.buf[0] == "," and self._args.keys:
                self._consume(1)
                return True
            self.state = _KEY
            return True
        if state == _KEY:
            i = self.buf.find("=")
            if i == -1:
                if final or len(self.buf) > 256:
                    self._close()
                    self.state = _JUNK
                    return True
                return False
            key = self.buf[:i].strip()
            if not key.isidentifier():
                self._close()
                self.state = _JUNK
                return True
            self._consume(i + 1)
            value = ValueStream(string=False, verbatim=self.ctx.enforced, trim=Trim.SPACE)
            self.write(self._args.key(key, value))
            self._scan = LiteralEnd()
            self.state = _VALUE
            return True
        if state == _VALUE:
            value = self._args.stream()
            n = self._scan.feed(self.buf)
            ended = n < len(self.buf)  # the literal ends inside the buffer
            text = self._consume(n)
            if not ended and not final:
                self.write(value.feed(text))
                return False
            self.write(value.feed(text) + value.end())
            self._args.value = None
            if ended:
                self.state = _ARGS
                return True
            self._close()
            self.state = _OUT
            return True
        if state == _SEP:
            self._consume(len(self.buf) - len(self.buf.lstrip()))
            if not self.buf:
                return self._cut_off(final)
            if self.buf[0] == ",":
                self._consume(1)
                self.state = _NAME
            elif self.buf[0] == "]":
                self._consume(1)
                self.state = _TAIL
            else:
                self.state = _JUNK
            return True
        if state == _TAIL:
            if self.until(self.markers[1]) is None and not final:
                return False
            self.state = _OUT
            return True
        # _JUNK: the block's rest, parsed whole at its end marker.
        got = self.rest_of_block(self.markers[1], final)
        if got is None:
            return False
        rest, closed = got
        if self.log.streaming:
            self._close()
        if self.ctx.calls_on and len(self.log.calls) == self._first:
            # Nothing of the block was read as a call: mlx-lm's parser reads it whole
            # (after a streamed call, the rest is dropped rather than read twice).
            raw = self._raw + rest
            self.whole(raw, self.markers[0] + raw + self.markers[1] if closed else "")
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
        self.write(self._args.end_value())
        self.write(self._args.close())
        self.close_call()

    def end(self) -> None:
        self._close()
