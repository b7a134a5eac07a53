"""Stored responses: what ``GET /v1/responses/{id}`` and ``previous_response_id`` read.

Bounded three ways (``[responses] max_stored`` entries and ``max_stored_bytes`` bytes, the
oldest leaving first, and ``ttl`` seconds after creation), kept in memory, and with
``persist`` also written under the cache folder, one JSON file per response, so that a
restart keeps them. Each entry holds its whole conversation (the items before it, its
input, its output) so that continuing it never depends on an older entry still being
there; in memory the items are shared between the entries of one conversation, on disk
each file repeats them.

An entry's bytes are its stored JSON: everything it keeps, the request fields its response
echoes (a client's ``user`` or ``metadata`` as sent) included. On disk that is exactly what
its file holds. In memory an item shared by the entries of one conversation is counted
once, whichever entries hold it: counted in every entry, the bytes of a conversation
continued N times grew as N squared where the memory grew as N, and one long conversation
pushed every other one out of the store while it held a small part of the bound.

Ids come only from afmd (``resp_`` and hex digits), and a client's id is only ever looked
up in memory, never used as a path.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from afmd.dialects.responses.entry_files import EntryFiles, read_entry_file
from afmd.dialects.responses.items import Item, canonical_items
from afmd.dialects.responses.output_items import UNDER_WAY
from afmd.errors import APIError
from afmd.logs import get_logger

log = get_logger("afmd.responses")


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    input_items: tuple[Item, ...]
    conversation: tuple[Item, ...]  # the items before, the input, the output
    created: float  # time.time()

    def to_json(self) -> bytes:
        return orjson.dumps({"response": self.response, "input_items": self.input_items,
                             "conversation": self.conversation, "created": self.created})

    @classmethod
    def from_json(cls, data: bytes) -> Stored:
        """A stored file read back; ValueError for any other shape (a file edited or written
        by another version must not stop the server from starting)."""
        raw = orjson.loads(data)
        if not isinstance(raw, dict) or not isinstance(raw.get("response"), dict):
            raise ValueError("not a stored response")
        inputs, conversation = raw.get("input_items"), raw.get("conversation")
        if not isinstance(inputs, list) or not isinstance(conversation, list) \
                or not all(isinstance(i, dict) for i in (*inputs, *conversation)):
            raise ValueError("its items are not a list of objects")
        created = raw.get("created")
        if isinstance(created, bool) or not isinstance(created, int | float) \
                or not math.isfinite(created):
            raise ValueError("its creation time is not a number")
        return cls(raw["response"], checked_items(inputs), checked_items(conversation),
                   float(created))


_STATUSES = frozenset({"in_progress", "completed", "incomplete"})


def checked_items(items: list[Item]) -> tuple[Item, ...]:
    """Items read back from a file, in the shape a request's items have: continuing a
    conversation renders them as they are, and an item edited out of shape (a message
    without content, a part that is not an object) would fail that render as a 500. An
    item the Responses API would refuse as input makes the file unreadable. What the
    check does not write (an output item's ``status``, ``encrypted_content``) is kept as
    stored, since the render never reads it."""
    try:
        checked = canonical_items(items)
    except APIError as exc:
        raise ValueError(exc.message) from None
    kept: list[Item] = []
    for raw, item in zip(items, checked, strict=True):
        merged = {**raw, **item}
        if raw.get("status") in _STATUSES:
            merged["status"] = raw["status"]
        kept.append(merged)
    return tuple(kept)


class ResponseStore:
    """The bounded store; ``folder`` None keeps it in memory only."""

    def __init__(self, max_stored: int, ttl: float, folder: Path | None = None, *,
                 max_bytes: int = 0) -> None:
        self.max_stored = max_stored
        self.max_bytes = max_bytes  # 0: no bound in bytes
        self.ttl = ttl
        self.folder = folder
        self._entries: OrderedDict[str, Stored] = OrderedDict()  # oldest first
        # Each entry's stored JSON in bytes; in memory, without its conversation's items
        # but a pointer each, as _held counts every item object once (its size less that
        # pointer, and how many entries hold it).
        self._sizes: dict[str, int] = {}
        self._held: dict[int, list[int]] = {}
        self.bytes = 0  # what the entries and the items they hold come to
        # Every stored item by its id, for item_reference (the AI SDK refers to the items
        # of earlier steps by id): each item object with it, the last stored last, and how
        # many entries hold that object. A client may send its own item id again with
        # other content, so removing one entry falls back to another object; the entries
        # of one conversation hold the same objects, so a conversation continued N times
        # is N objects here, where an entry each per item was N squared.
        self._items: dict[str, dict[int, list[Any]]] = {}
        self._files = EntryFiles(folder, "response") if folder is not None else None
        #: Told the id of each response that leaves the store (deleted, expired, pushed
        #: out), not of one replaced by a newer state of itself: what is kept beside a
        #: response (a background stream's events) goes with it.
        self.on_remove: Callable[[str], None] | None = None
        if self._files is not None:
            self._load(self._files)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Stored | None:
        self._expire()
        return self._entries.get(response_id)

    def item(self, item_id: str) -> Item | None:
        """The stored item with this id (any stored response's input or output item)."""
        self._expire()
        holders = self._items.get(item_id)
        return next(reversed(holders.values()))[0] if holders else None

    def _index(self, items: Sequence[Item]) -> None:
        for item in items:
            key = item.get("id")
            if isinstance(key, str):
                holders = self._items.setdefault(key, {})
                held = holders.pop(id(item), None) or [item, 0]  # now the last stored
                held[1] += 1
                holders[id(item)] = held

    def _unindex(self, items: Sequence[Item]) -> None:
        for item in items:
            key = item.get("id")
            if not isinstance(key, str) or key not in self._items:
                continue
            holders = self._items[key]
            held = holders.get(id(item))
            if held is None:
                continue
            held[1] -= 1
            if not held[1]:
                del holders[id(item)]
                if not holders:
                    del self._items[key]

    def conversation(self, response_id: str) -> Sequence[Item] | None:
        stored = self.get(response_id)
        return None if stored is None else stored.conversation

    def put(self, response_id: str, stored: Stored) -> None:
        if self.max_stored <= 0:
            return
        data = stored.to_json()
        if self.max_bytes and len(data) > self.max_bytes:
            log.warning("response not stored: larger than max_stored_bytes", id=response_id,
                        bytes=len(data), max_stored_bytes=self.max_bytes)
            return
        if response_id in self._entries:
            self._remove(response_id, replaced=True)
        self._add(response_id, stored, len(data))
        self._write(response_id, data)
        self._expire()
        self._bound()

    def delete(self, response_id: str) -> bool:
        if self.get(response_id) is None:
            return False
        self._remove(response_id)
        return True

    def close(self) -> None:
        """Finish the pending writes (at shutdown)."""
        if self._files is not None:
            self._files.close()

    def _expire(self) -> None:
        if self.ttl <= 0:
            return
        horizon = time.time() - self.ttl
        while self._entries:
            oldest, stored = next(iter(self._entries.items()))
            if stored.created >= horizon:
                break
            self._remove(oldest)

    def _add(self, response_id: str, stored: Stored, size: int) -> None:
        self._entries[response_id] = stored
        items = _distinct(stored.conversation)
        self._index(items)
        if self.folder is None:  # on disk every file repeats its conversation
            for item in items:
                held = self._held.get(id(item))
                if held is None:  # the item once; a pointer to it in every entry
                    held = [max(len(orjson.dumps(item)) - _POINTER, 0), 0]
                    self._held[id(item)] = held
                    self.bytes += held[0]
                held[1] += 1
                size -= held[0]
        self._sizes[response_id] = size
        self.bytes += size

    def _bound(self) -> None:
        """The oldest out until both the count and the bytes are within bounds."""
        while self._entries and (
            len(self._entries) > max(self.max_stored, 0)
            or (self.max_bytes and self.bytes > self.max_bytes)
        ):
            self._remove(next(iter(self._entries)))

    def _remove(self, response_id: str, *, replaced: bool = False) -> None:
        stored = self._entries.pop(response_id)
        if not replaced and self.on_remove is not None:
            self.on_remove(response_id)
        items = _distinct(stored.conversation)
        self._unindex(items)
        self.bytes -= self._sizes.pop(response_id)
        if self.folder is None:
            for item in items:
                held = self._held[id(item)]
                held[1] -= 1
                if not held[1]:
                    del self._held[id(item)]
                    self.bytes -= held[0]
        if self._files is not None and not replaced:
            self._files.remove(response_id)

    def _write(self, response_id: str, data: bytes) -> None:
        if self._files is not None:
            self._files.write(response_id, data)

    def _load(self, files: EntryFiles) -> None:
        """The responses a previous run persisted, oldest first, bounds applied."""
        found: list[tuple[str, Stored, int]] = []
        for path in files.stored("resp_"):
            try:
                data = read_entry_file(path, self.max_bytes, "max_stored_bytes")
                stored = Stored.from_json(data)
                if stored.response.get("id") != path.stem:
                    raise ValueError("the response in it has another id than its name")
                if stored.response.get("status") in UNDER_WAY:
                    stored = _interrupted(stored)
                    data = stored.to_json()
                    self._write(path.stem, data)
                found.append((path.stem, stored, len(data)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("stored response unreadable", path=str(path), error=str(exc))
        # A time still to come (a clock set back since, an edited file) is taken as now:
        # the store expires from its front, so one such would hold every later response
        # behind it past its ttl.
        now = time.time()
        found = [(rid, stored if stored.created <= now else replace(stored, created=now), size)
                 for rid, stored, size in found]
        found.sort(key=lambda entry: entry[1].created)
        for response_id, stored, size in found:
            self._add(response_id, stored, size)
        self._expire()
        self._bound()


def _interrupted(stored: Stored) -> Stored:
    """A background response the previous run left unfinished (it stopped, or died, while
    the response ran): ``failed``, as nothing will ever run it on."""
    response = {**stored.response, "status": "failed", "error": {
        "code": "server_error",
        "message": "The server stopped before this background response ended."}}
    return Stored(response, stored.input_items, stored.conversation, stored.created)


#: What an entry's tuple spends on each item it holds, shared or not.
_POINTER = 8


def _distinct(items: Sequence[Item]) -> list[Item]:
    """The item objects, each once."""
    return list({id(item): item for item in items}.values())
