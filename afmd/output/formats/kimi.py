"""Kimi K2: a section of calls, each a ``functions.NAME:INDEX`` header and JSON arguments.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The header names the function; the arguments are forwarded as written. Kimi's template
renders a call's id into that header when the conversation comes back, so calls get ids
in the same ``functions.NAME:INDEX`` form (numbered over the whole conversation), which
is what the model expects to read.
"""

from __future__ import annotations

import re

from afmd.output.formats.base import CallContext, MarkupReader, is_name
from afmd.output.formats.jsonargs import JsonArguments
from afmd.output.markers import partial_suffix

SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
CALL = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
#: Every marker the reader reads: a chat answer must keep their tokens (afmd.service.
#: hidden_tokens hides the other special tokens).
MARKERS = (*SECTION, *CALL)
_HEADER = re.compile(r"\s*(?:functions\.)?(.+?):\d+\s*", re.DOTALL)

_OUT, _SECTION, _HEAD, _ARGS, _AFTER, _JUNK = range(6)


def call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


class KimiReader(MarkupReader):
    def __init__(self, ctx: CallContext) -> None:
        super().__init__(ctx)
        self.state = _OUT
        self._args = JsonArguments()
        self._raw = ""

    def step(self, final: bool) -> bool:
        if self.state == _OUT:
            if self.outside((SECTION[0],), final) is None:
                return False
            self.state = _SECTION
            return True
        if self.state == _SECTION:
            marker, maybe = self.starts((CALL[0], SECTION[1]))
            if marker == CALL[0]:
                self._raw = ""
                self.state = _HEAD
            elif marker == SECTION[1] or (final and not self.buf):
                self.state = _OUT
            elif maybe and not final:
                return False
            else:
                self.state = _JUNK
            return True
        if self.state == _HEAD:
            i = self.buf.find(CALL[1])
            if i == -1:
                if final:
                    self.state = _OUT  # cut off in the header: dropped
                    self.buf = ""
                    return True
                return False
            header = self.buf[:i]
            match = _HEADER.fullmatch(header)
            if match is None or not is_name(match.group(1)):
                self.state = _JUNK
                return True
            self.cut(i + len(CALL[1]))
            self._raw = header + CALL[1]
            if self.ctx.calls_on:
                self.open_call(match.group(1))
            self._args = JsonArguments()
            self.state = _ARGS
            return True
        if self.state == _ARGS:
            done = self._args.step(self, final)
            if done is None:  # not JSON: read whole with the rest of the call
                if self.log.streaming:
                    self.log.close()
                self.state = _JUNK
                return True
            if done:
                self.close_call()
                self.state = _AFTER
                return True
            return False
        if self.state == _AFTER:
            if self.until(CALL[2]) is not None:
                self.state = _SECTION
                return True
            if final:
                self.state = _OUT
                self.buf = ""
                return True
            # Nothing but the end tag belongs here: keep only what may become it.
            self.buf = self.buf[len(self.buf) - partial_suffix(self.buf, (CALL[2],)):]
            return False
        # _JUNK: the rest of the section, parsed whole by mlx-lm's parser.
        i = self.buf.find(SECTION[1])
        if i == -1 and not final:
            return False
        raw = self._raw + self.cut(i if i != -1 else len(self.buf))
        if i != -1:
            self.cut(len(SECTION[1]))
        if self.ctx.calls_on:
            self.whole(CALL[0] + raw, SECTION[0] + CALL[0] + raw + SECTION[1]
                       if i != -1 else "")
        self.state = _OUT
        return True
