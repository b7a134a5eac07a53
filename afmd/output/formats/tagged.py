"""Formats that tag each parameter: Qwen3-Coder, GLM 4.5-4.7 (and Laguna), LongCat,
MiniMax M2, Muse Spark, MiniCPM5 and Kimi K3.

They differ in their tags, not in their shape: a section opens, each call has a header
naming the function, then parameters each with a key header and a raw value, then the
call and the section close. One state machine reads them all from a :class:`TagSyntax`; the
call's ``arguments`` are built as JSON while the model writes the parameters (the key as
soon as it is complete, a string value character by character), so the fragments
concatenate to the final ``arguments``. The reader follows the sections and the calls'
headers; its :class:`_Parameters` reads what lies between a call's header and its close.
Text inside a section that does not follow the syntax is handed whole to mlx-lm's parser
for the family (some models write JSON there).
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass

from afmd.output.formats.base import CallContext, MarkupReader, is_name
from afmd.output.formats.values import ArgumentsObject, Trim, ValueStream, parameter_is_string
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
class TagSyntax:
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

    @property
    def markers(self) -> tuple[str, ...]:
        """Every tag the reader reads (see ``kimi.MARKERS``): a chat answer must keep the
        special tokens they are made of."""
        found = (*self.section, self.call_open, *self.head_ends, self.call_close, *self.key,
                 *self.value, *(self.json_block or ()), *self.drop)
        return tuple(dict.fromkeys(m for m in found if m))


QWEN3_CODER = TagSyntax(
    section=("<tool_call>", "</tool_call>"), call_open="<function=", head_ends=(">",),
    head_kept=(), call_close="</function>", key=("<parameter=", ">"),
    value=("", "</parameter>"), trim=Trim.NEWLINE,
)
GLM47 = TagSyntax(
    section=("<tool_call>", "</tool_call>"), call_open=None,
    head_ends=("\n", "<arg_key>", "</tool_call>"), head_kept=("<arg_key>", "</tool_call>"),
    call_close=None, key=("<arg_key>", "</arg_key>"), value=("<arg_value>", "</arg_value>"),
    trim=Trim.SPACE,
)
LONGCAT = TagSyntax(
    section=("<longcat_tool_call>", "</longcat_tool_call>"), call_open=None,
    head_ends=("\n", "<longcat_arg_key>", "</longcat_tool_call>"),
    head_kept=("<longcat_arg_key>", "</longcat_tool_call>"), call_close=None,
    key=("<longcat_arg_key>", "</longcat_arg_key>"),
    value=("<longcat_arg_value>", "</longcat_arg_value>"), trim=Trim.SPACE,
)
MINIMAX_M2 = TagSyntax(
    section=("<minimax:tool_call>", "</minimax:tool_call>"), call_open="<invoke name=",
    head_ends=(">",), head_kept=(), call_close="</invoke>", key=("<parameter name=", ">"),
    value=("", "</parameter>"), trim=Trim.SPACE, name=_quoted, key_name=_quoted,
)
MUSE_SPARK = TagSyntax(
    section=("<atem:function_calls>", "</atem:function_calls>"), call_open="<atem:invoke",
    head_ends=(">",), head_kept=(), call_close="</atem:invoke>",
    key=("<atem:parameter", ">"), value=("", "</atem:parameter>"), trim=Trim.SPACE,
    name=_quoted, key_name=_quoted,
)
MINICPM5 = TagSyntax(
    section=("<function name=", "</function>"), call_open=None, head_ends=(">",),
    head_kept=(), call_close=None, key=("<param name=", ">"), value=("", "</param>"),
    trim=Trim.CDATA, name=_quoted, key_name=_quoted,
)
KIMI_K3 = TagSyntax(
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
    def __init__(self, ctx: CallContext, syntax: TagSyntax) -> None:
        super().__init__(ctx)
        self.s = syntax
        self.state = _OUT
        self._params = _Parameters(self)
        self._junk = ""  # the section's text so far, for the whole-parse fallback

    def step(self, final: bool) -> bool:
        state = self.state
        if state == _OUT:
            return self._outside(final)
        if state == _SECTION:
            return self._section(final)
        if state == _HEAD:
            return self._head(final)
        if state == _JUNK:
            return self._junk_text(final)
        return self._params.step(state, final)

    def _outside(self, final: bool) -> bool:
        s = self.s
        marker = self.outside((s.section[0], *s.drop), final)
        if marker is None:
            return False
        if marker != s.section[0]:
            return True  # structural markup: dropped
        self._junk = ""
        self.state = _HEAD if s.call_open is None else _SECTION
        return True

    def _section(self, final: bool) -> bool:
        s = self.s
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

    def _head(self, final: bool) -> bool:
        s = self.s
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
        self._params.begin(name)
        if self.ctx.calls_on:
            self.open_call(name)
        self.state = _PARAMS
        return True

    def _junk_text(self, final: bool) -> bool:
        """A section that is not in the syntax: parsed whole at its end (or the turn's)."""
        got = self.rest_of_block(self.s.section[1], final)
        if got is None:
            return False
        rest, closed = got
        raw = self._junk + rest
        if self.log.streaming:
            self.log.close()
        if self.ctx.calls_on:
            # Cut off: whatever parses counts, the rest is dropped (its markup must never
            # reach content; finish_reason tells the turn was cut).
            self.whole(raw, self.s.section[0] + raw + self.s.section[1] if closed else "")
        self.state = _OUT
        return True

    def end_call(self) -> None:
        if not self.log.streaming:
            return
        self._params.close()
        self.close_call()
        self._junk = ""

    def cut_off(self, final: bool) -> bool:
        """Generation ended inside a call: it closes as it stands."""
        if not final:
            return False
        self.end_call()
        self.state = _OUT
        return True

    def end(self) -> None:
        if self.log.streaming:
            self.end_call()


class _Parameters:
    """The open call's parameters, read into its JSON ``arguments`` as the model writes
    them: each key once its header is complete, each value as it streams, Kimi K3's raw
    JSON block as written. It scans its reader's buffer and moves its reader's state."""

    __slots__ = ("args", "name", "r", "s")

    def __init__(self, reader: TaggedReader) -> None:
        self.r = reader
        self.s = reader.s
        self.name = ""
        self.args = ArgumentsObject()

    def begin(self, name: str) -> None:
        self.name = name
        self.args.keys = 0

    def step(self, state: int, final: bool) -> bool:
        if state == _PARAMS:
            return self._params(final)
        if state == _KEY:
            return self._key(final)
        if state == _VALUE_OPEN:
            return self._value_open(final)
        if state == _VALUE:
            return self._value_text(final)
        if state == _BLOCK_HEAD:
            assert self.s.json_block is not None
            if self.r.until(self.s.json_block[1]) is None:
                return self.r.cut_off(final)
            self.r.state = _BLOCK
            return True
        return self._block(final)

    def _params(self, final: bool) -> bool:
        r, s = self.r, self.s
        closers = [s.call_close or s.section[1], s.key[0]]
        if s.json_block is not None and not self.args.keys:
            closers.append(s.json_block[0])
        marker, maybe = r.starts(closers)
        if marker == s.key[0]:
            r.state = _KEY
        elif s.json_block is not None and marker == s.json_block[0]:
            r.state = _BLOCK_HEAD
        elif marker is not None:
            r.end_call()
            r.state = _SECTION if s.call_close else _OUT
        elif maybe and not final:
            return False
        elif final:
            r.cut_off(final)
        else:
            # Stray text between parameters (mlx-lm's parsers skip it too).
            i, _ = earliest(r.buf, closers)
            keep = partial_suffix(r.buf, closers) if i == -1 else 0
            r.cut(i if i != -1 else max(1, len(r.buf) - keep))
        return True

    def _key(self, final: bool) -> bool:
        r, s = self.r, self.s
        header = r.until(s.key[1])
        if header is None:
            return r.cut_off(final)
        key, kind = s.key_name(header)
        string = kind == "string" if s.strings_by_type else parameter_is_string(
            r.ctx.tools.parameters(self.name), key)
        value = ValueStream(string=string, verbatim=r.ctx.enforced, trim=s.trim)
        r.write(self.args.key(key, value))
        r.state = _VALUE_OPEN
        return True

    def _value_open(self, final: bool) -> bool:
        r, s = self.r, self.s
        if s.value[0]:
            marker, maybe = r.starts((s.value[0],))
            if marker is None and maybe and not final:
                return False
        r.write(self.args.stream().start())
        r.state = _VALUE
        return True

    def _value_text(self, final: bool) -> bool:
        r, close = self.r, self.s.value[1]
        stream = self.args.stream()
        i = r.buf.find(close)
        if i == -1 and not final:
            keep = partial_suffix(r.buf, (close,))
            r.write(stream.feed(r.cut(len(r.buf) - keep)))
            return False
        if i == -1:  # cut off: a partial closing tag is not part of the value
            text = r.cut(len(r.buf) - partial_suffix(r.buf, (close,)))
        else:
            text = r.cut(i)
            r.cut(len(close))
        r.write(stream.feed(text) + stream.end())
        self.args.value = None
        if i == -1:  # cut off: the call ends as it stands
            return r.cut_off(True)
        r.state = _PARAMS
        return True

    def _block(self, final: bool) -> bool:
        """Kimi K3's raw JSON arguments: forwarded as written."""
        r = self.r
        assert self.s.json_block is not None
        close = self.s.json_block[2]
        i = r.buf.find(close)
        if i == -1 and not final:
            text = r.cut(len(r.buf) - partial_suffix(r.buf, (close,)))
            r.write(text.lstrip() if not r.log.written else text)
            return False
        text = r.cut(i if i != -1 else len(r.buf))
        r.write(text.lstrip() if not r.log.written else text)
        if i != -1:
            r.cut(len(close))
        self.args.keys = -1  # the arguments are written: nothing to close
        if i == -1:
            return r.cut_off(True)
        r.state = _PARAMS
        return True

    def close(self) -> None:
        """The arguments' end, however far they got: the open value's end, then the
        object's (each a fragment of its own)."""
        self.r.write(self.args.end_value())
        self.r.write(self.args.close())


def reader(syntax: TagSyntax) -> Callable[[CallContext], TaggedReader]:
    return lambda ctx: TaggedReader(ctx, syntax)
