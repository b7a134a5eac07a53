"""gpt-oss's harmony format: the whole turn is messages on channels.

    <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

After the prompt's ``<|start|>assistant``, the model writes messages: a header (channel,
recipient, content type) up to ``<|message|>``, a body up to ``<|end|>`` (or ``<|call|>``
/ ``<|return|>``, which end generation and so never reach the text). ``analysis`` is
reasoning, ``final`` the answer, ``commentary`` addressed ``to=functions.NAME`` a call
whose body is its JSON arguments (streamed as written), ``commentary`` without a recipient
a preamble the user may read (content). Nothing of the markup reaches content. A model
that writes no header at all is read as plain content.
"""

from __future__ import annotations

import re

from afmd.output.formats.base import CallContext, MarkupReader, is_name
from afmd.output.formats.jsonargs import JsonArguments
from afmd.output.formats.values import dumps, parse_value
from afmd.output.markers import earliest, partial_suffix

START, END, MESSAGE, CHANNEL, CONSTRAIN = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
CALL, RETURN = "<|call|>", "<|return|>"
#: Every marker the reader reads (see kimi.MARKERS): ``<|call|>`` and ``<|return|>`` end
#: generation on gpt-oss, and still end a body where a model's end ids lack them.
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
#: An analysis message read as a reasoning block: where it opens, where it closes.
ANALYSIS = (f"{CHANNEL}analysis{MESSAGE}", END)
_BODY_ENDS = (END, CALL, RETURN)
_HEADER_STARTS = (START, CHANNEL, CONSTRAIN, " to=", "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")

_HEADER, _TEXT, _CALL_ARGS, _CALL_REST, _DROP = range(5)


class HarmonyReader(MarkupReader):
    def __init__(self, ctx: CallContext) -> None:
        super().__init__(ctx)
        self.state = _HEADER
        self._reasoning = False  # the body being read is analysis
        self._args = JsonArguments()
        self._plain = False  # the model wrote no header: all of it is content

    def step(self, final: bool) -> bool:
        if self.state == _HEADER:
            return self._header(final)
        if self.state == _TEXT:
            return self._text(final)
        if self.state == _CALL_ARGS:
            done = self._args.step(self, final)
            if done is None:  # a body that is not a JSON object: held, read whole
                self.state = _CALL_REST
                return True
            if done:
                self.close_call()
                self.state = _DROP  # whatever is left of the body is not arguments
                return True
            return False
        if self.state == _CALL_REST:
            i, marker = earliest(self.buf, _BODY_ENDS)
            if i == -1 and not final:
                return False
            body = self.cut(i if i != -1 else len(self.buf)).strip()
            self.cut(len(marker))
            value = parse_value(body)
            self.write(dumps(value if isinstance(value, dict) else {}) if body else "{}")
            self.close_call()
            self.state = _HEADER
            return True
        # _DROP: the rest of a body nobody reads.
        i, marker = earliest(self.buf, _BODY_ENDS)
        if i == -1:
            self.buf = self.buf[len(self.buf) - partial_suffix(self.buf, _BODY_ENDS):]
            return False
        self.cut(i + len(marker))
        self.state = _HEADER
        return True

    def _header(self, final: bool) -> bool:
        stripped = self.buf.lstrip()
        if not stripped:
            return False
        if not any(stripped.startswith(m) or m.startswith(stripped) for m in _HEADER_STARTS):
            # No harmony here: the model answers in plain text.
            self._plain = True
            self._reasoning = False
            self.state = _TEXT
            return True
        header = self.until(MESSAGE)
        if header is None:
            if final:
                self.buf = ""  # cut off inside a header: nothing to show
            return False
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        name = (channel.group(1) if channel else "").lower()
        if recipient is not None and not recipient.group(1).startswith("assistant"):
            target = recipient.group(1)
            target = target.removeprefix("functions.")
            if self.ctx.calls_on and is_name(target):
                self.open_call(target)
                self._args = JsonArguments()
                self.state = _CALL_ARGS
            else:
                self.state = _DROP
            return True
        self._reasoning = name == "analysis"
        self.state = _TEXT
        return True

    def _text(self, final: bool) -> bool:
        ends = () if self._plain else _BODY_ENDS
        i, marker = earliest(self.buf, ends) if ends else (-1, "")
        at = self.at  # a stop sequence is matched in the answer's text where it lies
        if i == -1:
            keep = 0 if final or not ends else partial_suffix(self.buf, ends)
            text = self.cut(len(self.buf) - keep)
            (self.reasoning if self._reasoning else self.content)(text, at)
            return False
        text = self.cut(i)
        self.cut(len(marker))
        (self.reasoning if self._reasoning else self.content)(text, at)
        self.state = _HEADER
        return True

    def end(self) -> None:
        if self.log.streaming:
            if self.state == _CALL_ARGS and not self._args.started:
                self.write("{}")
            self.close_call()


def reader(ctx: CallContext) -> HarmonyReader:
    return HarmonyReader(ctx)
