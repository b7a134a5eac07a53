"""What a dialect adapter is: the seam every wire format plugs into.

The HTTP layer drives any :class:`Dialect` the same way: ``parse`` the body, prepare and
run the turn, then either ``body`` (all events at once) or ``stream_start``, ``stream``
per batch of events and ``stream_end``; an error is ``error_envelope`` before a stream's
head went out and ``stream_error`` after it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

from afmd.core.events import Event
from afmd.core.request import ChatRequest
from afmd.errors import APIError


class Reply(Protocol):
    """One response, encoded from one run's events."""

    def body(self, events: Sequence[Event]) -> bytes:
        """The whole (non-streamed) response body from every event of the run."""
        ...

    def stream_start(self) -> bytes:
        """What a stream sends before its first event (may be empty)."""
        ...

    def stream(self, events: Sequence[Event]) -> bytes:
        """One batch of events as the dialect's SSE; b"" when none of them shows."""
        ...

    def stream_end(self) -> bytes:
        """What follows the run's last event."""
        ...

    def stream_error(self, error: APIError) -> bytes:
        """An error that ends a stream already under way, and the stream's end."""
        ...


class Dialect(Protocol):
    name: str

    def parse(self, raw: bytes, *, server_tools: Collection[str] = ()) -> ChatRequest:
        """The body checked field by field into the internal request (400s name the field)."""
        ...

    def reply(self, request: ChatRequest, *, model: str, fingerprint: str) -> Reply:
        """A response to ``request``; ``model`` is the name the client asked for."""
        ...

    def error_envelope(self, error: APIError) -> dict[str, Any]:
        """The JSON body of an error response in this dialect."""
        ...
