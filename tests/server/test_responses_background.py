"""Background responses (``background: true``) through the official ``openai`` client against
the real server: created and polled to their end, streamed then resumed with
``starting_after``, cancelled by their ``resp_`` id (the slot freed at once), deleted
while running, the refusals (no store, cancelling a response that is not a background
one, the queue's 429), the shutdown that fails a running one (persisted, and read back
failed), and a persisted unfinished one read back after a restart."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import openai
import pytest

from afmd.core.events import Content, Finish, Usage
from afmd.dialects.responses.background import KEEPALIVE, BackgroundRun
from afmd.dialects.responses.conversation_store import ConversationStore
from afmd.dialects.responses.responses_api import OpenAIResponses, ResponsesReply
from afmd.dialects.responses.store import ResponseStore, Stored

from conftest import ServerProcess, start_server
from helpers.openai_schemas import validate_error
from helpers.responses_schemas import validate_event, validate_response

pytestmark = pytest.mark.slow  # servers of their own, one stopped mid-run

#: Far more tokens than any test waits for: the demo model, greedy on this prompt, writes
#: until it is stopped.
LONG = {"input": "Tell me a long story.", "max_output_tokens": 8000, "temperature": 0}
SHORT = {"input": "Say hello.", "max_output_tokens": 24, "temperature": 0}  # greedy
UNDER_WAY = ("queued", "in_progress")


def _client(server: ServerProcess, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=timeout)


def _until(client: openai.OpenAI, response_id: str, statuses: tuple[str, ...],
           within: float = 30) -> Any:
    deadline = time.monotonic() + within
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in statuses:
            return response
        assert time.monotonic() < deadline, response.status
        time.sleep(0.05)


def _ended(client: openai.OpenAI, response_id: str) -> Any:
    return _until(client, response_id, ("completed", "incomplete", "failed", "cancelled"))


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One generation slot and one place in the queue: what holds the slot shows."""
    server = start_server(tmp_path_factory.mktemp("background"),
                          config="[queue]\nmax_concurrent_requests = 1\n"
                                 "max_queued_requests = 1\n")
    yield server
    server.stop()


# -- create and poll -----------------------------------------------------------------------


def test_a_background_response_runs_to_the_end_a_normal_run_reaches(one_slot) -> None:
    client = _client(one_slot)
    made = client.responses.create(model="demo", background=True, **SHORT)
    assert made.background is True and made.status in UNDER_WAY
    assert made.output == [] and made.usage is None
    validate_response(made.model_dump(mode="json", exclude_unset=True))
    done = _ended(client, made.id)
    validate_response(done.model_dump(mode="json", exclude_unset=True))
    assert done.id == made.id and done.background is True
    plain = client.responses.create(model="demo", **SHORT)
    assert plain.background is False
    assert done.status == plain.status and done.output_text == plain.output_text
    assert done.output_text  # it wrote something: the comparison compared something
    assert done.usage.output_tokens == plain.usage.output_tokens
    assert [i.id for i in client.responses.input_items.list(made.id)]  # stored with it
    # Its turn goes on from it as from any stored response.
    follow = client.responses.create(model="demo", input="More.", max_output_tokens=16,
                                     previous_response_id=made.id)
    assert follow.usage.input_tokens > done.usage.input_tokens
    # The run has its own access log line, with its usage, besides its POST's.
    deadline = time.monotonic() + 10
    while not [e for e in one_slot.events if e.get("event") == "request"
               and e.get("method") == "BACKGROUND" and e.get("path", "").endswith(made.id)]:
        assert time.monotonic() < deadline, "no access log line for the background run"
        time.sleep(0.05)
    line = next(e for e in one_slot.events if e.get("method") == "BACKGROUND"
                and e.get("path", "").endswith(made.id))
    assert line["completion_tokens"] == done.usage.output_tokens


def test_background_without_store_is_refused(one_slot) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _client(one_slot).responses.create(model="demo", input="Hi", background=True,
                                           store=False)
    validate_error(caught.value.response.json())
    assert caught.value.body["param"] == "background"
    assert "store" in caught.value.body["message"]


# -- streamed, then resumed ----------------------------------------------------------------


def test_a_background_stream_goes_on_without_its_reader_and_resumes(one_slot) -> None:
    client = _client(one_slot)
    body = {**SHORT, "max_output_tokens": 48}
    seen: list[Any] = []
    with client.responses.create(model="demo", background=True, stream=True, **body) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == 5:
                break  # the reader leaves mid-answer; the run must not
    assert [e.sequence_number for e in seen] == list(range(5))
    assert seen[0].type == "response.created" and seen[0].response.status == "queued"
    assert seen[0].response.background is True
    response_id = seen[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True,
                                          starting_after=seen[-1].sequence_number))
    numbers = [e.sequence_number for e in [*seen, *rest]]
    assert numbers == list(range(len(numbers)))  # continuous, none twice
    for event in [*seen, *rest]:
        validate_event(event.model_dump(mode="json", exclude_unset=True))
    final = client.responses.retrieve(response_id)
    assert rest[-1].type == f"response.{final.status}"
    assert final.status in ("completed", "incomplete")
    assert rest[-1].response.output_text == final.output_text
    # Ended, it replays from its kept events, from any point.
    again = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.sequence_number for e in again] == numbers[3:]
    assert again[-1].type == rest[-1].type
    # A normal run of the same request streams the same text.
    plain = client.responses.create(model="demo", **body)
    assert plain.output_text == final.output_text


def test_only_a_streamed_background_response_streams_again(one_slot) -> None:
    client = _client(one_slot)
    made = client.responses.create(model="demo", background=True, **SHORT)
    _ended(client, made.id)
    plain = client.responses.create(model="demo", **SHORT)
    for response_id in (made.id, plain.id):
        answer = httpx.get(f"{one_slot.url}/v1/responses/{response_id}?stream=true")
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "stream"
    for after in ("x", "-2", "+1", " 1", "1_0", "\u0663", "9" * 5000):
        bad = httpx.get(f"{one_slot.url}/v1/responses/{made.id}",
                        params={"stream": "true", "starting_after": after})
        assert bad.status_code == 400, (after, bad.text)
        assert bad.json()["error"]["param"] == "starting_after"


# -- cancel, delete, the queue ---------------------------------------------------------------


def test_cancel_ends_it_cancelled_and_frees_its_slot_at_once(one_slot) -> None:
    client = _client(one_slot)
    made = client.responses.create(model="demo", background=True, **LONG)
    _until(client, made.id, ("in_progress",))
    # Still running: it has no answer to continue from yet.
    with pytest.raises(openai.BadRequestError) as early:
        client.responses.create(model="demo", input="And?", previous_response_id=made.id)
    assert early.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(made.id)
    assert cancelled.id == made.id and cancelled.status == "cancelled"
    assert cancelled.background is True
    assert client.responses.retrieve(made.id).status == "cancelled"
    # The only slot is free: a request is served now, not after the story.
    started = time.monotonic()
    quick = _client(one_slot, timeout=15).responses.create(model="demo", **SHORT)
    assert quick.status in ("completed", "incomplete")
    assert time.monotonic() - started < 10
    # Cancelling it again answers it as it ended.
    assert client.responses.cancel(made.id).model_dump() == cancelled.model_dump()


def test_a_background_stream_is_queued_until_its_run_begins(one_slot) -> None:
    """``response.created`` and ``response.queued`` open it, both ``queued``, as OpenAI's
    do; ``response.in_progress`` comes only once its run has begun, and one cancelled
    while it still waits in the queue goes from ``queued`` to its end."""
    client = _client(one_slot)
    holder = client.responses.create(model="demo", background=True, **LONG)
    _until(client, holder.id, ("in_progress",))
    try:
        stream = client.responses.create(model="demo", background=True, stream=True, **LONG)
        events = iter(stream)
        opening = [next(events), next(events)]
        assert [e.type for e in opening] == ["response.created", "response.queued"]
        assert [e.sequence_number for e in opening] == [0, 1]
        assert all(e.response.status == "queued" for e in opening)
        for event in opening:
            validate_event(event.model_dump(mode="json", exclude_unset=True))
        waiting = opening[0].response.id
        time.sleep(0.3)  # still behind the holder
        assert client.responses.retrieve(waiting).status == "queued"
        assert client.responses.cancel(waiting).status == "cancelled"
        rest = list(events)
        assert "response.in_progress" not in [e.type for e in rest]
        assert [e.sequence_number for e in rest] == list(range(2, 2 + len(rest)))
        assert rest[-1].response.status == "cancelled"
    finally:
        client.responses.cancel(holder.id)
    ran = client.responses.create(model="demo", background=True, stream=True, **SHORT)
    kinds = [e.type for e in ran]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")


def test_a_stored_response_still_streaming_is_shown_in_progress(one_slot) -> None:
    """A stored response (not a background one) whose stream still runs: GET shows it
    ``in_progress`` with its input items, continuing from it or cancelling it by its id
    are 400s, and a DELETE meanwhile keeps it from being stored at its end (it found
    nothing, and the response was stored after all)."""
    client = _client(one_slot)
    stream = client.responses.create(model="demo", stream=True, **LONG)
    events = iter(stream)
    response_id = next(events).response.id
    try:
        shown = client.responses.retrieve(response_id)
        assert shown.status == "in_progress" and shown.id == response_id
        validate_response(shown.model_dump(mode="json", exclude_unset=True))
        listed = client.responses.input_items.list(response_id)
        assert [i.type for i in listed] == ["message"]
        with pytest.raises(openai.BadRequestError) as early:
            client.responses.create(model="demo", input="And?",
                                    previous_response_id=response_id)
        assert early.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.BadRequestError) as cancel:
            client.responses.cancel(response_id)
        assert "background" in cancel.value.body["message"]
        client.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    finally:
        stream.close()  # the run ends (stored cancelled, were it not deleted)
    deadline = time.monotonic() + 10
    while True:  # the slot comes free once the run has ended, and stored nothing
        try:
            quick = _client(one_slot, timeout=5).responses.create(model="demo", **SHORT)
            break
        except openai.APIError:
            assert time.monotonic() < deadline
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response_id)
    assert client.responses.retrieve(quick.id).status == quick.status  # stored as ever


def test_cancel_of_a_finished_one_answers_it_and_of_a_plain_one_is_400(one_slot) -> None:
    client = _client(one_slot)
    made = client.responses.create(model="demo", background=True, **SHORT)
    done = _ended(client, made.id)
    assert client.responses.cancel(made.id).model_dump() == done.model_dump()
    plain = client.responses.create(model="demo", **SHORT)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(plain.id)
    validate_error(caught.value.response.json())
    assert "background" in caught.value.body["message"]
    assert client.responses.retrieve(plain.id).status == plain.status  # untouched


def test_deleting_a_running_one_cancels_it(one_slot) -> None:
    client = _client(one_slot)
    made = client.responses.create(model="demo", background=True, **LONG)
    _until(client, made.id, ("in_progress",))
    deleted = client.responses.delete(made.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    quick = _client(one_slot, timeout=15).responses.create(model="demo", **SHORT)
    assert quick.status in ("completed", "incomplete")  # its slot was freed


def test_the_queue_holds_background_runs_and_its_429_answers_the_post(one_slot) -> None:
    client = _client(one_slot)
    running = client.responses.create(model="demo", background=True, **LONG)
    _until(client, running.id, ("in_progress",))
    waiting = client.responses.create(model="demo", background=True, **SHORT)
    assert waiting.status == "queued"
    assert client.responses.retrieve(waiting.id).status == "queued"
    with pytest.raises(openai.RateLimitError) as full:
        client.responses.create(model="demo", background=True, **SHORT)
    validate_error(full.value.response.json())
    assert full.value.response.headers.get("retry-after")
    client.responses.cancel(running.id)
    done = _ended(client, waiting.id)  # it had its turn once the slot was free
    assert done.status in ("completed", "incomplete")


# -- shutdown and restart -------------------------------------------------------------------


def test_shutdown_fails_a_running_one_and_it_stays_retrievable(tmp_path: Path) -> None:
    config = "[server]\nshutdown_grace = 0.5\n[responses]\npersist = true\n"
    env = {"AFMD_CACHE_DIR": str(tmp_path / "cache")}
    server = start_server(tmp_path, config=config, env=env)
    try:
        client = _client(server)
        made = client.responses.create(model="demo", background=True, **LONG)
        _until(client, made.id, ("in_progress",))
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    line = next(e for e in server.events if e.get("method") == "BACKGROUND")
    assert line["stream_error"] == "server_shutting_down"
    assert not [e for e in server.events if e.get("level") == "error"], server.log_text()
    server = start_server(tmp_path, config=config, env=env)
    try:
        failed = _client(server).responses.retrieve(made.id)
    finally:
        server.stop()
    assert failed.status == "failed" and failed.background is True
    assert failed.error is not None and "stopping" in failed.error.message
    assert failed.output  # what it had written when it was stopped


def test_a_persisted_unfinished_one_is_read_back_failed(tmp_path: Path) -> None:
    """A server that died while a background response ran left it ``in_progress`` on disk:
    read back, it is failed, not in progress forever (and written back so)."""
    store = ResponseStore(10, 0, tmp_path)
    response = {"id": "resp_" + "a" * 48, "object": "response", "status": "in_progress",
                "background": True, "error": None, "output": []}
    store.put(response["id"], Stored(response, (), (), time.time()))
    store.close()
    again = ResponseStore(10, 0, tmp_path)
    stored = again.get(response["id"])
    assert stored is not None and stored.response["status"] == "failed"
    assert stored.response["error"]["code"] == "server_error"
    again.close()
    third = ResponseStore(10, 0, tmp_path)
    assert third.get(response["id"]).response == stored.response  # type: ignore[union-attr]
    third.close()


def test_background_timeout_bounds_it_in_place_of_request_timeout(tmp_path: Path) -> None:
    server = start_server(tmp_path, config="[server]\nrequest_timeout = 1.0\n"
                                           "[responses]\nbackground_timeout = 3.0\n")
    try:
        client = _client(server)
        made = client.responses.create(model="demo", background=True, **LONG)
        _until(client, made.id, ("in_progress",))
        time.sleep(1.5)  # past request_timeout: still running
        assert client.responses.retrieve(made.id).status == "in_progress"
        failed = _ended(client, made.id)
    finally:
        server.stop()
    assert failed.status == "failed" and failed.error is not None
    assert "did not complete" in failed.error.message
    assert "background_timeout" in failed.error.message  # the setting that bounded it
    assert failed.output  # what it had written by then


def test_a_streamed_background_response_keeps_its_profile_event(one_slot) -> None:
    """``X-AFM-Profile`` holds for a background stream: its event is among those kept, and
    replayed; the POST's headers are any response's."""
    body = {**SHORT, "model": "demo", "background": True, "stream": True}
    with httpx.stream("POST", one_slot.url + "/v1/responses", json=body, timeout=60,
                      headers={"X-AFM-Profile": "true", "X-Request-ID": "bg-profile"}) as r:
        assert r.headers["x-request-id"] == "bg-profile"
        text = r.read().decode()
    assert "event: afm_profile" in text
    response_id = text.split('"id":"', 1)[1].split('"', 1)[0]
    replayed = httpx.get(f"{one_slot.url}/v1/responses/{response_id}?stream=true", timeout=30)
    assert replayed.text == text  # every event kept, in order, the profile's included


def test_a_quiet_follower_is_kept_alive_until_the_run_ends() -> None:
    """A follower whose run writes nothing for a while (queued behind others) is sent a
    comment, as the server cuts a response that writes nothing for request_timeout and a
    margin; the events around it are as written."""
    async def follow() -> list[bytes]:
        # follow() reads only the events; started() takes the reply's in_progress.
        reply = cast(ResponsesReply, SimpleNamespace(began=lambda: [b"in_progress"]))
        run = BackgroundRun(reply, "req", [b"created"], streamed=True)
        got: list[bytes] = []
        async for chunk in run.follow(-1, quiet=0.01):
            got.append(chunk)
            if chunk == KEEPALIVE and b"in_progress" not in got:
                run.started()
            elif chunk == b"in_progress":
                run.finish({"status": "completed"}, [b"completed"])
                run.close()
        return got

    got = asyncio.run(follow())
    assert got[0] == b"created" and got[1] == KEEPALIVE and got[-1] == b"completed"
    assert [c for c in got if c != KEEPALIVE] == [b"created", b"in_progress", b"completed"]


def test_a_run_that_ends_after_its_delete_answered_is_not_stored_again() -> None:
    """The delete waits for the cancelled run's end only so long; a later end stores
    nothing, or the deleted response would be back."""
    dialect = OpenAIResponses(ResponseStore(10, 0), ConversationStore(10, 0))
    body = b'{"model": "demo", "input": "Hi", "background": true}'
    reply = dialect.reply(dialect.parse(body), model="demo", fingerprint="")
    queued, _ = reply.queued()
    reply.keep(queued)
    assert dialect.store.delete(reply.id)
    reply.deleted()
    reply.stream_events([Content("late"), Finish("cancelled"), Usage(3, 1)])
    final, _ = reply.end_events()
    assert final["status"] == "cancelled" and dialect.store.get(reply.id) is None
