"""Conversations: what ``/v1/conversations`` and a response's ``conversation`` read and grow.

A conversation is an ordered list of items (the Responses API's own, as it returns them)
with metadata. It lives as long as it is used, not as long as one response: ``[responses]
ttl`` counts from its last change, and when ``max_conversations`` or
``max_conversations_bytes`` is exceeded the least recently changed leaves first. A
conversation is counted as its stored JSON; one that alone would exceed the byte bound
is not grown (the request adding to it is refused, a turn's items are left out and
logged), since dropping it whole would lose more than the items that did not fit.

With ``persist`` each conversation is also one JSON file under the cache folder, written
again whole at every change by one writer thread, in the order of the changes. Ids come
only from afmd (``conv_`` and hex digits), and a client's id is only ever looked up in
memory, never used as a path.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from afmd.dialects.fields.unused import metadata_of
from afmd.dialects.responses.entry_files import EntryFiles, read_entry_file
from afmd.dialects.responses.items import Item, item_id
from afmd.dialects.responses.store import checked_items
from afmd.errors import APIError, InvalidRequestError
from afmd.logs import get_logger

log = get_logger("afmd.conversations")


@dataclass(slots=True)
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[Item]
    updated: float  # time.time() of its last change: ttl and eviction count from it
    #: The items' share of its JSON, each counted once, as it joins: a change then costs
    #: what it adds, where serializing the whole conversation again held the event loop
    #: for as long as the conversation was large.
    items_bytes: int = 0

    def object(self) -> dict[str, Any]:
        """As the API returns it (``Conversation``)."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}

    def find(self, item_id: str) -> int | None:
        """The index of the item with this id (the first, should a client have given two
        items one id)."""
        return next((i for i, item in enumerate(self.items) if item.get("id") == item_id),
                    None)

    def extend(self, items: Sequence[Item]) -> None:
        self.items.extend(items)
        self.items_bytes += items_size(items)

    def pop(self, index: int) -> None:
        self.items_bytes -= items_size([self.items.pop(index)])

    def size(self) -> int:
        """The length of :meth:`to_json`, its items counted as they joined."""
        head = len(orjson.dumps(self.snapshot(items=())))
        return head + self.items_bytes - (1 if self.items else 0)  # n items, n - 1 commas

    def snapshot(self, items: Sequence[Item] | None = None) -> dict[str, Any]:
        """What its file holds, as it is now: the item list copied (pointers only), so the
        writer thread serializes it while the conversation changes on."""
        return {"id": self.id, "created_at": self.created_at, "metadata": dict(self.metadata),
                "items": list(self.items if items is None else items),
                "updated": self.updated}

    def to_json(self) -> bytes:
        return orjson.dumps(self.snapshot())

    @classmethod
    def from_json(cls, data: bytes) -> Conversation:
        """A stored file read back; ValueError for any other shape (a file edited or written
        by another version must not stop the server from starting)."""
        raw = orjson.loads(data)
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
            raise ValueError("not a stored conversation")
        created, updated = raw.get("created_at"), raw.get("updated")
        if type(created) is not int:
            raise ValueError("its creation time is not an integer")
        if isinstance(updated, bool) or not isinstance(updated, int | float) \
                or not math.isfinite(updated):
            raise ValueError("its time of change is not a number")
        items = raw.get("items")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ValueError("its items are not a list of objects")
        try:
            metadata = metadata_of(raw.get("metadata"))
        except APIError as exc:
            raise ValueError(exc.message) from None
        conversation = cls(raw["id"], created, metadata, [], float(updated))
        conversation.extend(checked_items(items))
        return conversation


def items_size(items: Sequence[Item]) -> int:
    """The items' share of a conversation's JSON: each with the comma after it."""
    return sum(len(orjson.dumps(item)) + 1 for item in items)


class ConversationTooLarge(InvalidRequestError):
    """Adding the items would make the one conversation larger than the whole store."""


class ConversationStore:
    """The bounded store; ``folder`` None keeps it in memory only."""

    def __init__(self, max_count: int, ttl: float, folder: Path | None = None, *,
                 max_bytes: int = 0) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes  # 0: no bound in bytes
        self.ttl = ttl
        self.folder = folder
        self._entries: OrderedDict[str, Conversation] = OrderedDict()  # least recent first
        self._sizes: dict[str, int] = {}
        self.bytes = 0
        #: Every kept item by its id, for a response's ``item_reference``: each item object
        #: with it (a client may give its own id to items of several conversations), the
        #: last added last.
        self._by_item: dict[str, dict[int, Item]] = {}
        #: The conversations a response is running on: a second one at the same time would
        #: read the history without the first's turn and append its own after it.
        self._busy: set[str] = set()
        self._files = EntryFiles(folder, "conversation") if folder is not None else None
        if self._files is not None:
            self._load(self._files)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, conversation_id: str) -> Conversation | None:
        self._expire()
        return self._entries.get(conversation_id)

    def item(self, item_id: str) -> Item | None:
        """The kept item with this id (an ``item_reference``'s), the last added if several."""
        self._expire()
        held = self._by_item.get(item_id)
        return next(reversed(held.values())) if held else None

    def items(self, conversation_id: str) -> Sequence[Item] | None:
        """Its items as they are now (a turn's history: later changes do not reach it)."""
        found = self.get(conversation_id)
        return None if found is None else tuple(found.items)

    def create(self, metadata: dict[str, str], items: Sequence[Item]) -> Conversation:
        conversation = Conversation(item_id("conv"), int(time.time()), metadata, [],
                                    time.time())
        self._fit(conversation, items)
        self._extend(conversation, items)
        self._changed(conversation)
        return conversation

    def set_metadata(self, conversation: Conversation, metadata: dict[str, str]) -> None:
        """Replace its metadata; :class:`ConversationTooLarge` (at ``metadata``) where the
        conversation would no longer fit."""
        self._fit(conversation, (), metadata)
        conversation.metadata = metadata
        self._changed(conversation)

    def add(self, conversation: Conversation, items: Sequence[Item]) -> None:
        """Append a client's items; :class:`ConversationTooLarge` where they do not fit."""
        self._fit(conversation, items)
        self._extend(conversation, items)
        self._changed(conversation)

    def append_turn(self, conversation_id: str, items: Sequence[Item]) -> None:
        """Append a finished response's input and output items. The client has its answer
        already, so a conversation gone meanwhile (deleted, expired) or one these items
        would make too large is logged, not an error."""
        conversation = self.get(conversation_id)
        if conversation is None:
            log.warning("turn not added: the conversation is gone", id=conversation_id)
            return
        try:
            self._fit(conversation, items)
        except ConversationTooLarge:
            log.warning("turn not added: larger than max_conversations_bytes",
                        id=conversation_id, max_conversations_bytes=self.max_bytes)
            return
        self._extend(conversation, items)
        self._changed(conversation)

    def delete_item(self, conversation: Conversation, index: int) -> None:
        self._unindex(conversation.items[index:index + 1])
        conversation.pop(index)
        self._changed(conversation)

    def delete(self, conversation_id: str) -> bool:
        if self.get(conversation_id) is None:
            return False
        self._remove(conversation_id)
        return True

    def hold(self, conversation_id: str | None) -> None:
        """A response begins on the conversation (None: none); while one runs, another is
        refused with OpenAI's 400 ``conversation_locked``. Called in the same step of the
        event loop as the request's parse, which read its history."""
        if conversation_id is None:
            return
        if conversation_id in self._busy:
            raise InvalidRequestError(
                "Another process is currently operating on this conversation. Please retry "
                "in a few seconds.", code="conversation_locked", param="conversation")
        self._busy.add(conversation_id)

    def release(self, conversation_id: str | None) -> None:
        """The response that :meth:`hold` let in has ended (its turn appended, or not)."""
        if conversation_id is not None:
            self._busy.discard(conversation_id)

    @contextlib.contextmanager
    def holding(self, conversation_id: str | None) -> Iterator[None]:
        self.hold(conversation_id)
        try:
            yield
        finally:
            self.release(conversation_id)

    def close(self) -> None:
        """Finish the pending writes (at shutdown)."""
        if self._files is not None:
            self._files.close()

    def _fit(self, conversation: Conversation, items: Sequence[Item],
             metadata: dict[str, str] | None = None) -> None:
        """Refuse a change (``items`` added, or ``metadata`` in place of its own) after
        which the conversation alone would exceed the byte bound: kept, it would push out
        every other conversation and then itself."""
        if not self.max_bytes:
            return
        size = conversation.size() + items_size(items)
        if metadata is not None:
            size += len(orjson.dumps(metadata)) - len(orjson.dumps(conversation.metadata))
        if size > self.max_bytes:
            what = "these items" if metadata is None else "this metadata"
            raise ConversationTooLarge(
                f"The conversation would hold {size} bytes with {what}, more than the "
                f"server keeps for all conversations together ({self.max_bytes}, [responses] "
                "max_conversations_bytes); start a new conversation.",
                code="conversation_too_large",
                param="items" if metadata is None else "metadata")

    def _changed(self, conversation: Conversation) -> None:
        conversation.updated = time.time()
        key = conversation.id
        self.bytes -= self._sizes.pop(key, 0)
        self._entries[key] = conversation
        self._entries.move_to_end(key)
        size = conversation.size()
        self._sizes[key] = size
        self.bytes += size
        if self._files is not None:
            snapshot = conversation.snapshot()
            self._files.write(key, lambda: orjson.dumps(snapshot))
        self._expire()
        self._bound(spare=key)

    def _expire(self) -> None:
        if self.ttl <= 0:
            return
        horizon = time.time() - self.ttl
        while self._entries:
            oldest, conversation = next(iter(self._entries.items()))
            if conversation.updated >= horizon:
                break
            self._remove(oldest)

    def _bound(self, spare: str | None = None) -> None:
        """The least recently changed out until both the count and the bytes are within
        bounds, never ``spare``: the conversation just changed, which the request that
        changed it was told is there. :meth:`_fit` let it in alone, but counts its time of
        change at its old length (a float's shortest form varies by a few digits)."""
        while self._entries and (
            len(self._entries) > self.max_count
            or (self.max_bytes and self.bytes > self.max_bytes)
        ):
            oldest = next(iter(self._entries))
            if oldest == spare:
                break
            self._remove(oldest)

    def _extend(self, conversation: Conversation, items: Sequence[Item]) -> None:
        conversation.extend(items)
        self._index(items)

    def _index(self, items: Sequence[Item]) -> None:
        for item in items:
            if isinstance(item.get("id"), str):
                self._by_item.setdefault(item["id"], {})[id(item)] = item

    def _unindex(self, items: Sequence[Item]) -> None:
        for item in items:
            key = item.get("id")
            held = self._by_item.get(key) if isinstance(key, str) else None
            if held is not None:
                held.pop(id(item), None)
                if not held:
                    del self._by_item[item["id"]]

    def _remove(self, conversation_id: str) -> None:
        self._unindex(self._entries.pop(conversation_id).items)
        self.bytes -= self._sizes.pop(conversation_id)
        if self._files is not None:
            self._files.remove(conversation_id)

    def _load(self, files: EntryFiles) -> None:
        """The conversations a previous run persisted, least recently changed first,
        bounds applied."""
        found: list[tuple[Conversation, int]] = []
        for path in files.stored("conv_"):
            try:
                data = read_entry_file(path, self.max_bytes, "max_conversations_bytes")
                conversation = Conversation.from_json(data)
                if conversation.id != path.stem:
                    raise ValueError("the conversation in it has another id than its name")
                found.append((conversation, len(data)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("stored conversation unreadable", path=str(path), error=str(exc))
        # A time still to come (a clock set back since, an edited file) is taken as now:
        # the store expires from its front, so one such would hold every later
        # conversation behind it past its ttl.
        now = time.time()
        for conversation, _ in found:
            conversation.updated = min(conversation.updated, now)
        found.sort(key=lambda entry: entry[0].updated)
        for conversation, size in found:
            self._entries[conversation.id] = conversation
            self._index(conversation.items)
            self._sizes[conversation.id] = size
            self.bytes += size
        self._expire()
        self._bound()
