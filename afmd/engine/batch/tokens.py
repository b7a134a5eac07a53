"""What a token looks like to a client: its bytes, its text, its log-probabilities.

Free of MLX (the run and the adapters use it while no model code is imported): a token's
bytes come from the tokenizer the way its detokenizer reads them.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

from afmd.core.events import Logprobs, TokenLogprob, TopLogprob
from afmd.engine import generation as base


class TokenTable:
    """Each token's own bytes (what it adds to the text), as the model's detokenizer sees it.

    A byte-level BPE token maps back to bytes through GPT-2's byte alphabet and an SPM
    piece through its ``▁`` and ``<0xNN>`` conventions; any other tokenizer decodes the
    token alone. A token may hold part of a UTF-8 character: its bytes are then not text.

    It holds its tokenizer weakly: the table is kept in a map keyed weakly by that same
    tokenizer, and a value that refers to its own key keeps it, so every unloaded model's
    tokenizer (and what is keyed by it elsewhere) stayed for the process's life. Whoever
    uses a table serves a request on the model, which holds the tokenizer meanwhile.
    """

    __slots__ = ("_bytes", "_kind", "_shown", "_tokenizer")

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer: weakref.ref[Any] = weakref.ref(tokenizer)
        # mlx-lm picks the detokenizer by the tokenizer's decoder; its class says how a
        # token's piece maps to bytes (named, so this module needs no mlx-lm import).
        kind = type(getattr(tokenizer, "detokenizer", None)).__name__
        self._kind = {"BPEStreamingDetokenizer": "bpe", "SPMStreamingDetokenizer": "spm"}.get(
            kind, "decode")
        self._bytes: dict[int, bytes] = {}
        # id -> (text, bytes): a request with logprobs describes each token and its
        # alternatives, every token, so neither is worked out twice.
        self._shown: dict[int, tuple[str, bytes]] = {}

    def bytes_of(self, token: int) -> bytes:
        cached = self._bytes.get(token)
        if cached is None:
            cached = self._bytes[token] = self._compute(token)
        return cached

    def text_of(self, token: int) -> str:
        return self._show(token)[0]

    def describe(self, entry: base.TokenIdLogprob, offset: int = 0) -> TokenLogprob:
        """The engine's ids and numbers as the client sees them."""
        show = self._show
        text, raw = show(entry.token)
        top = tuple(TopLogprob(*show(t), v) for t, v in entry.top)
        return TokenLogprob(text, raw, entry.logprob, top, offset)

    def _show(self, token: int) -> tuple[str, bytes]:
        shown = self._shown.get(token)
        if shown is None:
            raw = self.bytes_of(token)
            shown = self._shown[token] = (token_text(raw), raw)
        return shown

    def _compute(self, token: int) -> bytes:
        tokenizer = self._tokenizer()
        assert tokenizer is not None, "a token table outlived its model"
        if self._kind == "decode":
            return str(tokenizer.decode([token])).encode()
        piece = tokenizer.convert_ids_to_tokens(token)
        if piece is None:
            return b""
        if self._kind == "spm":
            if piece.startswith("<0x") and len(piece) == 6:
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        decoder = _byte_decoder()
        out = bytearray()
        for char in piece:
            value = decoder.get(char)
            if value is None:
                out += char.encode()
            else:
                out.append(value)
        return bytes(out)


class LogprobQueue:
    """Generated tokens' numbers held until the text they made is released.

    A stop-sequence check holds text back while it could still start a stop sequence and
    drops it when one matches; a token's log-probability goes out once all its text is
    through, and never when the stop swallowed it (as OpenAI reports). Positions count
    characters of the generated text as the engine produced it.
    """

    __slots__ = ("_held", "_read", "_table")

    def __init__(self, table: TokenTable) -> None:
        self._table = table
        self._held: deque[tuple[int, TokenLogprob]] = deque()  # (end, token)
        self._read = 0  # characters of generated text seen

    def add(self, text: str, entries: Sequence[base.TokenIdLogprob], base_offset: int = 0) -> None:
        """The tokens of one engine event and the text it carried; their ``offset`` is
        where that text starts (plus ``base_offset``)."""
        start = self._read
        self._read += len(text)
        for entry in entries:
            self._held.append((self._read, self._table.describe(entry, base_offset + start)))

    def release(self, released: int) -> Logprobs | None:
        """The tokens whose text lies within the first ``released`` characters."""
        ready: list[TokenLogprob] = []
        while self._held and self._held[0][0] <= released:
            ready.append(self._held.popleft()[1])
        return Logprobs(tuple(ready)) if ready else None

    def drop(self) -> None:
        """Generation ended: what is still held, a stop sequence swallowed."""
        self._held.clear()


_TABLES: weakref.WeakKeyDictionary[Any, TokenTable] = weakref.WeakKeyDictionary()


def token_table(tokenizer: Any) -> TokenTable:
    """The tokenizer's table, shared by every request (it fills as tokens are seen)."""
    table = _TABLES.get(tokenizer)
    if table is None:
        table = _TABLES[tokenizer] = TokenTable(tokenizer)
    return table


def token_text(raw: bytes) -> str:
    """A token as text: its bytes when they are UTF-8, else OpenAI's ``bytes:\\xNN`` form
    (a token holding part of a character)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _byte_decoder() -> dict[str, int]:
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        # GPT-2's reversible byte alphabet: printable bytes stand for themselves, the
        # others for code points from 256 up.
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                     *range(ord("®"), ord("ÿ") + 1)]
        table = {chr(b): b for b in printable}
        n = 0
        for b in range(256):
            if b not in printable:
                table[chr(256 + n)] = b
                n += 1
        _BYTE_DECODER = table
    return _BYTE_DECODER


_BYTE_DECODER: dict[str, int] | None = None
