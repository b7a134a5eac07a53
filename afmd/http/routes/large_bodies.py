"""Bodies handled off the event loop when they are large: a request's read into its
dialect's request, and a whole (non-streamed) answer's built.

A body near ``max_request_body_bytes`` can hold hundreds of thousands of messages, and
building the internal request from it is seconds of Python. On the event loop those were
seconds in which no other client was answered: no token streamed to anyone, /health
silent, the cancel of a run unheard. A body of at least :data:`LARGE_BODY` bytes is
parsed on a thread instead, where the interpreter gives the loop its turns every few
milliseconds; a smaller one is parsed where it is, as the hop would cost more than the
parse. The thread is one of their own (:mod:`afmd.service.own_threads`): requests that
bring such bodies wait for each other, not every other request for asyncio's default
executor, which renders every prompt.

What a parse reads that the event loop owns (the Responses stores, whose lookups also
expire entries) is read on the loop all the same: :func:`on_loop` hands those calls over
and waits for them.

An answer's body is built from the run's events once it ended, and a large one (``n``
choices with ``top_logprobs``, an echoed prompt's logprobs, many long embeddings) is
hundreds of thousands of objects made in Python: on the loop, every stream stopped for as
long. Such a body is built on the same thread; a small one where it is. A Responses answer
is built apart (:class:`~afmd.dialects.dialect.BuiltApart`): its builder is what ``GET
/v1/responses/{id}`` reads while the turn runs, and the stores are the loop's, so the
answer is built in a builder of its own on the thread and kept on the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from sanic import Request

from afmd.core.events import Choice, Event, Logprobs
from afmd.dialects.dialect import BuiltApart, ReplyEncoder
from afmd.dialects.responses.responses_body import Through
from afmd.service.own_threads import OwnThreads

R = TypeVar("R")
T = TypeVar("T")

#: Bytes of body from which it is parsed off the loop.
LARGE_BODY = 256 * 1024

#: About how many objects an answer's body holds (events, logprobs and their top
#: alternatives; numbers of vectors) from which it is built off the loop.
LARGE_ANSWER = 10_000

#: Threads for large bodies: one. The parse holds the interpreter, so a second would not
#: be faster, and one at a time is what the loop did: a parse builds several times its
#: body's bytes in objects, and two at once would have doubled that peak.
BODY_THREADS = OwnThreads(1, "afmd-bodies")

#: How long a parsing thread waits for the loop to run a lookup for it: the loop is free
#: (its handler awaits the parse), so only a loop that stopped meanwhile takes this long.
LOOP_CALL_TIMEOUT = 30.0


async def parse_body(request: Request, parse: Callable[[bytes], R]) -> R:
    """``parse(body)``: on the large bodies' thread when the body is large, else here."""
    body = request.body or b""
    if len(body) < LARGE_BODY:
        return parse(body)
    return await BODY_THREADS.run(parse, body)


def answer_weight(events: Sequence[Event]) -> int:
    """About how many objects the body of ``events`` holds: each event, each logprob and
    each of its alternatives (every token of a run has the same number of those)."""
    weight = 0
    for event in events:
        if isinstance(event, Choice):
            weight += answer_weight(event.events)
        elif isinstance(event, Logprobs) and event.tokens:
            weight += len(event.tokens) * (1 + len(event.tokens[0].top))
        else:
            weight += 1
    return weight


async def answer_body(reply: ReplyEncoder, events: Sequence[Event]) -> bytes:
    """``reply.body(events)``: on the large bodies' thread when it is large (what the loop
    keeps of a reply built apart kept here), else here."""
    if answer_weight(events) < LARGE_ANSWER:
        return reply.body(events)
    if isinstance(reply, BuiltApart):
        return reply.built(await BODY_THREADS.run(reply.build, events))
    return await BODY_THREADS.run(reply.body, events)


async def built_off_loop(build: Callable[[], bytes], *, weight: int) -> bytes:
    """``build()``: on the large bodies' thread when ``weight`` (objects it makes) is at
    least :data:`LARGE_ANSWER`, else here."""
    if weight < LARGE_ANSWER:
        return build()
    return await BODY_THREADS.run(build)


def on_loop() -> Through:
    """A :class:`~afmd.dialects.responses.responses_body.Through` that runs each lookup on
    the running event loop, whichever thread calls it (the loop itself calls it directly)."""
    loop = asyncio.get_running_loop()
    thread = threading.get_ident()

    def through(lookup: Callable[[str], T], /) -> Callable[[str], T]:
        def call(key: str) -> T:
            if threading.get_ident() == thread:
                return lookup(key)

            async def run() -> T:
                return lookup(key)

            return asyncio.run_coroutine_threadsafe(run(), loop).result(LOOP_CALL_TIMEOUT)

        return call

    return through
