"""Formats that tag each parameter: Qwen3-Coder, GLM 4.5-4.7 (and Laguna), LongCat,
MiniMax M2, Muse Spark, MiniCPM5 and Kimi K3.

They differ in their tags, not in their shape: a section opens, each call has a header
naming the function, then parameters each with a key header and a raw value, then the
call and the section close. One state machine reads them all from a :class:`Syntax`; the
call's ``arguments`` are built as JSON while the model writes the parameters (the key as
soon as it is complete, a string value character by character), so the fragments
concatenate to the final ``arguments``. Text inside a section that does not follow the
syntax is handed whole to mlx-lm's parser for the family (some models write JSON there).
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass

from afmd.output.formats.base import CallContext, MarkupReader, is_name
from afmd.output.formats.values import Trim, ValueStream, dumps, parameter_is_string
from afmd.output.markers import earliest, partial_suffix

_ATTR = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


def _plain(header: str) -> tuple[str, str | None]:
    return header.strip(), None


def _quoted(header: str) -> tuple[str, str | None]:
    """``"name"`` / ``name="name"`` / ``name`` as MiniMax, Muse and MiniCPM5 write them."""
    attrs = dict(_ATTR.findall(header))
    if "name" in attrs:
        return html.unescape(attrs["name"]), None
    text = header.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    return text, None


def _attributes(name: str) -> Callable[[str], tuple[str, str | None]]:
    """Kimi K3's ``tool="x" index="1"`` / ``key="k" type="string"`` headers."""

    def read(header: str) -> tuple[str, str | None]:
        attrs = {k: html.unescape(v) for k, v in _ATTR.findall(header)}
        return attrs.get(name, ""), attrs.get("type")

    return read


@dataclass(frozen=True, slots=True)
class Syntax:
    """One family's tags (see the module docstring)."""

    section: tuple[str, str]
    call_open: str | None  # None: the call's header starts at the section's opener
    head_ends: tuple[str, ...]  # what ends a call's header
    head_kept: tuple[str, ...]  # those of them that belong to what follows
    call_close: str | None  # None: the section's close ends its one call
    key: tuple[str, str]
    value: tuple[str, str]  # the value's opening tag ("" when the key's close opens it)
    trim: str
    name: Callable[[str], tuple[str, str | None]] = _plain
    key_name: Callable[[str], tuple[str, str | None]] = _plain
    json_block: tuple[str, str, str] | None = None  # Kimi K3: open, header end, close
    strings_by_type: bool = False  # the key header says whether the value is a string
    drop: tuple[str, ...] = ()  # structural markup outside calls that is not content


QWEN3_CODER = Syntax(
    section=("<tool_call>", "</tool_call>"), call_open="<function=", head_ends=(">",),
    head_kept=(), call_close="</function>", key=("<parameter=", ">"),
    value=("", "</parameter>"), trim=Trim.NEWLINE,
)
GLM47 = Syntax(
    section=("<tool_call>", "</tool_call>"), call_open=None,
    head_ends=("\n", "<arg_key>", "</tool_call>"), head_kept=("<arg_key>", "</tool_call>"),
    call_close=None, key=("<arg_key>", "</arg_key>"), value=("<arg_value>", "</arg_value>"),
    trim=Trim.SPACE,
)
LONGCAT = Syntax(
    section=("<longcat_tool_call>", "</longcat_tool_call>"), call_open=None,
    head_ends=("\n", "<longcat_arg_key>", "</longcat_tool_call>"),
    head_kept=("<longcat_arg_key>", "</longcat_tool_call>"), call_close=None,
    key=("<longcat_arg_key>", "</longcat_arg_key>"),
    value=("<longcat_arg_value>", "</longcat_arg_value>"), trim=Trim.SPACE,
)
MINIMAX_M2 = Syntax(
    section=("<minimax:tool_call>", "</minimax:tool_call>"), call_open="<invoke name=",
    head_ends=(">",), head_kept=(), call_close="</invoke>", key=("<parameter name=", ">"),
    value=("", "</parameter>"), trim=Trim.SPACE, name=_quoted, key_name=_quoted,
)
MUSE_SPARK = Syntax(
    section=("<atem:function_calls>", "</atem:function_calls>"), call_open="<atem:invoke",
    head_ends=(">",), head_kept=(), call_close="</atem:invoke>",
    key=("<atem:parameter", ">"), value=("", "</atem:parameter>"), trim=Trim.SPACE,
    name=_quoted, key_name=_quoted,
)
MINICPM5 = Syntax(
    section=("<function name=", "</function>"), call_open=None, head_ends=(">",),
    head_kept=(), call_close=None, key=("<param name=", ">"), value=("", "</param>"),
    trim=Trim.CDATA, name=_quoted, key_name=_quoted,
)
KIMI_K3 = Syntax(
    section=("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"), call_open="<|open|>call",
    head_ends=("<|sep|>",), head_kept=(), call_close="<|close|>call<|sep|>",
    key=("<|open|>argument", "<|sep|>"), value=("", "<|close|>argument<|sep|>"),
    trim=Trim.NONE, name=_attributes("tool"), key_name=_attributes("key"),
    json_block=("<|open|>json", "<|sep|>", "<|close|>json<|sep|>"), strings_by_type=True,
    # XTML frames the answer; mlx-lm drops these markers from the text, so does afmd.
    drop=("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>"),
)

_OUT, _SECTION, _HEAD, _PARAMS, _KEY, _VALUE_OPEN, _VALUE, _BLOCK_HEAD, _BLOCK, _JUNK = \
    range(10)


class TaggedReader(MarkupReader):
    def __init__(self, ctx: CallContext, syntax: Syntax) -> None:
        super().__init__(ctx)
        self.s = syntax
        self.state = _OUT
        self._name = ""
        self._keys = 0  # parameters written in the open call
        self._value: ValueStream | None = None
        self._junk = ""  # the section's text so far, for the whole-parse fallback

    # -- the states

    def step(self, final: bool) -> bool:
        s = self.s
        state = self.state
        if state == _OUT:
            marker = self.outside((s.section[0], *s.drop), final)
            if marker is None:
                return False
            if marker != s.section[0]:
                return True  # structural markup: dropped
            self._junk = ""
            self.state = _HEAD if s.call_open is None else _SECTION
            return True
        if state == _SECTION:
            before = self.buf
            marker, maybe = self.starts(tuple(m for m in (s.call_open, s.section[1]) if m))
            self._junk += before[: len(before) - len(self.buf)]
            if marker == s.section[1]:
                self.state = _OUT
            elif marker is not None:
                self.state = _HEAD
            elif maybe and not final:
                return False
            elif final and not self.buf:
                self.state = _OUT  # cut off between calls: nothing more to read
            else:
                self.state = _JUNK
            return True
        if state == _HEAD:
            i, marker = earliest(self.buf, s.head_ends)
            if i == -1:
                if final:
                    self.state = _JUNK
                    return True
                return False
            name, _ = s.name(self.buf[:i])
            if not is_name(name):
                self.state = _JUNK
                return True
            self._junk += self.cut(i + (0 if marker in s.head_kept else len(marker)))
            self._name = name
            self._keys = 0
            if self.ctx.calls_on:
                self.open_call(name)
            self.state = _PARAMS
            return True
        if state == _PARAMS:
            return self._params(final)
        if state == _KEY:
            header = self.until(s.key[1])
            if header is None:
                if final:
                    self._close_call()
                    self.state = _OUT
                    return True
                return False
            key, kind = s.key_name(header)
            string = kind == "string" if s.strings_by_type else parameter_is_string(
                self.ctx.tools.parameters(self._name), key)
            self.write(("{" if not self._keys else ", ") + dumps(key) + ": ")
            self._keys += 1
            self._value = ValueStream(string=string, verbatim=self.ctx.enforced, trim=s.trim)
            self.state = _VALUE_OPEN
            return True
        if state == _VALUE_OPEN:
            if s.value[0]:
                marker, maybe = self.starts((s.value[0],))
                if marker is None and maybe and not final:
                    return False
            self.write(self._stream().start())
            self.state = _VALUE
            return True
        if state == _VALUE:
            return self._value_text(final)
        if state == _BLOCK_HEAD:
            assert s.json_block is not None
            if self.until(s.json_block[1]) is None:
                if final:
                    self._close_call()
                    self.state = _OUT
                    return True
                return False
            self.state = _BLOCK
            return True
        if state == _BLOCK:
            return self._block(final)
        return self._junk_text(final)

    def _params(self, final: bool) -> bool:
        s = self.s
        closers = [s.call_close or s.section[1], s.key[0]]
        if s.json_block is not None and not self._keys:
            closers.append(s.json_block[0])
        marker, maybe = self.starts(closers)
        if marker == s.key[0]:
            self.state = _KEY
        elif s.json_block is not None and marker == s.json_block[0]:
            self.state = _BLOCK_HEAD
        elif marker is not None:
            self._close_call()
            self.state = _SECTION if s.call_close else _OUT
        elif maybe and not final:
            return False
        elif final:
            self._close_call()
            self.state = _OUT
        else:
            # Stray text between parameters (mlx-lm's parsers skip it too).
            i, _ = earliest(self.buf, closers)
            keep = partial_suffix(self.buf, closers) if i == -1 else 0
            self.cut(i if i != -1 else max(1, len(self.buf) - keep))
        return True

    def _value_text(self, final: bool) -> bool:
        close = self.s.value[1]
        stream = self._stream()
        i = self.buf.find(close)
        if i == -1 and not final:
            keep = partial_suffix(self.buf, (close,))
            text = self.cut(len(self.buf) - keep)
            self.write(stream.feed(text))
            return False
        if i == -1:  # cut off: a partial closing tag is not part of the value
            text = self.cut(len(self.buf) - partial_suffix(self.buf, (close,)))
        else:
            text = self.cut(i)
            self.cut(len(close))
        self.write(stream.feed(text) + stream.end())
        self._value = None
        if i == -1:  # cut off: the call ends as it stands
            self._close_call()
            self.state = _OUT
        else:
            self.state = _PARAMS
        return True

    def _block(self, final: bool) -> bool:
        """Kimi K3's raw JSON arguments: forwarded as written."""
        assert self.s.json_block is not None
        close = self.s.json_block[2]
        i = self.buf.find(close)
        if i == -1 and not final:
            keep = partial_suffix(self.buf, (close,))
            self.write(self.cut(len(self.buf) - keep).lstrip() if not self.log.written
                       else self.cut(len(self.buf) - keep))
            return False
        text = self.cut(i if i != -1 else len(self.buf))
        self.write(text.lstrip() if not self.log.written else text)
        if i != -1:
            self.cut(len(close))
        self._keys = -1  # the arguments are written: nothing to close
        self.state = _PARAMS if i != -1 else _OUT
        if i == -1:
            self._close_call()
        return True

    def _junk_text(self, final: bool) -> bool:
        """A section that is not in the syntax: parsed whole at its end (or the turn's)."""
        close = self.s.section[1]
        i = self.buf.find(close)
        if i == -1 and not final:
            return False
        raw = self._junk + self.cut(i if i != -1 else len(self.buf))
        if i != -1:
            self.cut(len(close))
        if self.log.streaming:
            self.log.close()
        if self.ctx.calls_on:
            if i != -1:
                self.whole(raw, self.s.section[0] + raw + close)
            else:
                # Cut off: whatever parses counts, the rest is dropped (its markup must
                # never reach content; finish_reason tells the turn was cut).
                self.whole(raw, "")
        self.state = _OUT
        return True

    # -- helpers

    def _stream(self) -> ValueStream:
        assert self._value is not None
        return self._value

    def _close_call(self) -> None:
        if not self.log.streaming:
            return
        if self._value is not None:
            self.write(self._value.end())
            self._value = None
        if self._keys == 0:
            self.write("{}")
        elif self._keys > 0:
            self.write("}")
        self.close_call()
        self._junk = ""

    def end(self) -> None:
        if self.log.streaming:
            self._close_call()


def reader(syntax: Syntax) -> Callable[[CallContext], TaggedReader]:
    return lambda ctx: TaggedReader(ctx, syntax)
