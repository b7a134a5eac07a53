"""JSON arguments written as they are: where the value ends, fed in pieces.

Families that write a call's arguments as one JSON object (Kimi K2, Mistral, harmony)
forward them as the model writes them; the reader only has to know where the object
ends, which :class:`JsonValueEnd` finds without parsing (strings and escapes respected).
"""

from __future__ import annotations

from afmd.output.formats.base import MarkupReader


class JsonValueEnd:
    """Finds where a JSON object/array ends, fed incrementally."""

    __slots__ = ("depth", "done", "escape", "in_string")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` belong to the value (all, until it closes)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class JsonArguments:
    """Streams one JSON object from a reader's buffer into its open call."""

    __slots__ = ("_scan", "started")

    def __init__(self) -> None:
        self._scan = JsonValueEnd()
        self.started = False

    def step(self, reader: MarkupReader, final: bool) -> bool | None:
        """True: the object is complete; False: more text needed; None: the text is not a
        JSON object (nothing consumed)."""
        if not self.started:
            reader.skip_ws()
            if not reader.buf:
                return False if not final else None
            if reader.buf[0] not in "{[":
                return None
            self.started = True
        if not reader.buf:
            return False
        n = self._scan.feed(reader.buf)
        reader.write(reader.cut(n))
        return self._scan.done
