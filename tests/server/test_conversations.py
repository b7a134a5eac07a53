"""OpenAI's Conversations API and the Responses API's ``conversation``: through the official
``openai`` client against the real server on the demo model (objects, item paging, turns
that continue a conversation, streamed too, and the 400s and 404s with their params), the
bounded store in process, and a persisted conversation across a restart."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from afmd.config.bounds import ConfigError
from afmd.config.load import load_config
from afmd.core.events import Content, Finish, Usage
from afmd.dialects.responses import conversation_store
from afmd.dialects.responses.conversation_store import ConversationStore, ConversationTooLarge
from afmd.dialects.responses.items import canonical_items
from afmd.dialects.responses.responses_api import OpenAIResponses
from afmd.dialects.responses.store import ResponseStore
from afmd.errors import ServerError

from conftest import start_server
from helpers.openai_schemas import validate_error
from helpers.responses_schemas import validate_event, validate_item_list, validate_response

CONV_ID = re.compile(r"^conv_[0-9a-f]{48}$")


def message(text: str, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


def status_error(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    validate_error(caught.value.response.json())
    return caught.value


def all_items(client: Any, conversation_id: str) -> list[Any]:
    return list(client.conversations.items.list(conversation_id, order="asc"))


# -- the conversation object ----------------------------------------------------------------


def test_create_retrieve_update_delete(client: Any) -> None:
    made = client.conversations.create(items=[message("Hi"), message("Hello!", "assistant")],
                                       metadata={"topic": "demo"})
    assert CONV_ID.match(made.id) and made.object == "conversation"
    assert made.metadata == {"topic": "demo"} and made.created_at > 0
    assert client.conversations.retrieve(made.id) == made
    items = all_items(client, made.id)
    assert [(i.type, i.role, i.content[0].type) for i in items] == [
        ("message", "user", "input_text"), ("message", "assistant", "output_text")]
    assert all(re.match(r"^msg_[0-9a-f]{48}$", i.id) for i in items)
    updated = client.conversations.update(made.id, metadata={"stage": "two"})
    assert updated.metadata == {"stage": "two"}  # replaced, not merged
    assert client.conversations.retrieve(made.id).metadata == {"stage": "two"}
    deleted = client.conversations.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "conversation.deleted",
                                                             True)
    gone = status_error(lambda: client.conversations.retrieve(made.id))
    assert gone.status_code == 404 and gone.body["param"] == "conversation_id"
    assert status_error(lambda: client.conversations.delete(made.id)).status_code == 404


def test_an_empty_conversation_has_empty_metadata(client: Any, http: httpx.Client) -> None:
    made = client.conversations.create()
    assert made.metadata == {} and all_items(client, made.id) == []
    bare = http.post("/v1/conversations")  # no body at all, as curl sends it
    assert bare.status_code == 200 and bare.json()["object"] == "conversation"


# -- items ----------------------------------------------------------------------------------


def test_items_are_paged_added_retrieved_and_deleted(client: Any, http: httpx.Client) -> None:
    texts = [f"line {n}" for n in range(5)]
    made = client.conversations.create(items=[message(t) for t in texts])
    # A page on the wire has the published shape of a list of items, as input_items does.
    validate_item_list(http.get(f"/v1/conversations/{made.id}/items?limit=2").json())
    ids = [i.id for i in all_items(client, made.id)]
    assert [i.content[0].text for i in all_items(client, made.id)] == texts
    newest = client.conversations.items.list(made.id, limit=2)  # desc by default
    assert [i.id for i in newest.data] == ids[::-1][:2]
    assert newest.has_more is True and newest.last_id == ids[3]
    assert newest.first_id == ids[4]  # type: ignore[attr-defined]
    rest = client.conversations.items.list(made.id, limit=2, after=newest.last_id)
    assert [i.id for i in rest.data] == [ids[2], ids[1]] and rest.has_more is True
    last = client.conversations.items.list(made.id, limit=2, after=ids[1])
    assert [i.id for i in last.data] == [ids[0]] and last.has_more is False
    asc = client.conversations.items.list(made.id, order="asc", limit=3)
    assert [i.id for i in asc.data] == ids[:3]
    # The SDK follows last_id itself while has_more says so.
    assert [i.id for i in client.conversations.items.list(made.id, limit=2)] == ids[::-1]

    added = client.conversations.items.create(
        made.id, items=[message("more"), {"type": "message", "role": "assistant",
                                          "content": [{"type": "output_text", "text": "ok"}]}])
    assert added.object == "list" and len(added.data) == 2 and added.has_more is False
    assert [i.id for i in all_items(client, made.id)] == [*ids, *(i.id for i in added.data)]
    one = client.conversations.items.retrieve(added.data[0].id, conversation_id=made.id)
    assert one.id == added.data[0].id and one.content[0].text == "more"

    after_delete = client.conversations.items.delete(ids[2], conversation_id=made.id)
    assert after_delete.id == made.id and after_delete.object == "conversation"
    assert ids[2] not in [i.id for i in all_items(client, made.id)]
    missing = status_error(lambda: client.conversations.items.retrieve(
        ids[2], conversation_id=made.id))
    assert missing.status_code == 404 and missing.body["param"] == "item_id"
    with_include = client.conversations.items.list(
        made.id, include=["message.output_text.logprobs"])
    assert len(with_include.data) == 6


def test_an_item_with_an_id_of_the_clients_own_is_found_by_it(client: Any) -> None:
    """The SDK percent-encodes the id in the path; the server looks up what it encodes."""
    own = ["x y", "caf\u00e9", "a/b", "a%2Fb", "a?b#c"]
    made = client.conversations.create(items=[{**message(n), "id": n} for n in own])
    for item_id in own:
        found = client.conversations.items.retrieve(item_id, conversation_id=made.id)
        assert found.id == item_id
    client.conversations.items.delete("a/b", conversation_id=made.id)
    assert [i.id for i in all_items(client, made.id)] == ["x y", "caf\u00e9", "a%2Fb", "a?b#c"]


# -- turns ----------------------------------------------------------------------------------


def test_two_turns_through_a_conversation(client: Any, http: httpx.Client) -> None:
    made = client.conversations.create(metadata={"user": "ada"})
    first = client.responses.create(model="demo", input="My name is Ada.",
                                    conversation=made.id, max_output_tokens=16)
    validate_response(first.model_dump(mode="json", exclude_unset=True))
    assert first.conversation is not None and first.conversation.id == made.id
    after_one = all_items(client, made.id)
    assert after_one[0].role == "user" and after_one[0].content[0].text == "My name is Ada."
    assert [i.id for i in after_one[1:]] == [o.id for o in first.output]

    alone = client.responses.create(model="demo", input="What is my name?",
                                    max_output_tokens=16, store=False)
    second = client.responses.create(model="demo", input="What is my name?",
                                     conversation={"id": made.id}, max_output_tokens=16)
    assert second.conversation is not None and second.conversation.id == made.id
    # The first turn is in the second's prompt.
    assert second.usage is not None and alone.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    after_two = all_items(client, made.id)
    assert [i.id for i in after_two[:len(after_one)]] == [i.id for i in after_one]
    assert after_two[len(after_one)].content[0].text == "What is my name?"
    assert len(after_two) == len(after_one) + 1 + len(second.output)

    counted = client.responses.input_tokens.count(model="demo", input="What is my name?",
                                                  conversation=made.id)
    bare = client.responses.input_tokens.count(model="demo", input="What is my name?")
    assert counted.input_tokens > bare.input_tokens
    # A response of a conversation is stored as others are, its conversation echoed.
    stored = http.get(f"/v1/responses/{second.id}").json()
    assert stored["conversation"] == {"id": made.id}


def test_a_streamed_turn_joins_the_conversation(client: Any) -> None:
    made = client.conversations.create(items=[message("Remember: the word is blue.")])
    events = list(client.responses.create(model="demo", input="Say it.", stream=True,
                                          conversation=made.id, max_output_tokens=16))
    for event in events:
        validate_event(event.model_dump(mode="json", exclude_unset=True))
    done = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert done.conversation is not None and done.conversation.id == made.id
    assert events[0].response.conversation.id == made.id
    items = all_items(client, made.id)
    assert [i.content[0].text for i in items[:2]] == ["Remember: the word is blue.", "Say it."]
    assert [i.id for i in items[2:]] == [o.id for o in done.output]


def test_a_refused_turn_adds_nothing(client: Any) -> None:
    made = client.conversations.create(items=[message("Hi")])
    refused = status_error(lambda: client.responses.create(
        model="demo", conversation=made.id, max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]))
    assert refused.status_code == 400 and refused.body["param"] == "input[0].call_id"
    assert len(all_items(client, made.id)) == 1
    # A problem in the conversation's own items is named by the field that brought them.
    client.conversations.items.create(made.id, items=[
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}])
    unanswered = status_error(lambda: client.responses.create(
        model="demo", conversation=made.id, input="Go on", max_output_tokens=16))
    assert unanswered.code == "missing_tool_output"
    assert unanswered.body["param"] == "conversation"
    assert len(all_items(client, made.id)) == 2


def test_one_response_at_a_time_runs_on_a_conversation(client: Any) -> None:
    """A second response on a conversation while one runs would read its history without
    the first's turn and append its own after it: it is OpenAI's 400
    ``conversation_locked``, background or not, until the first has ended."""
    made = client.conversations.create(items=[message("Hi")])
    long = {"model": "demo", "conversation": made.id, "input": "Tell me a long story.",
            "max_output_tokens": 8000, "temperature": 0}
    again = {"model": "demo", "conversation": made.id, "input": "Again",
             "max_output_tokens": 16}

    def locked(**extra: Any) -> None:
        error = status_error(lambda: client.responses.create(**again, **extra))
        assert (error.status_code, error.code, error.body["param"]) == (
            400, "conversation_locked", "conversation")

    stream = client.responses.create(**long, stream=True)
    next(iter(stream))  # it runs
    locked()
    locked(background=True)
    stream.close()  # its client left: cancelled, its turn not appended
    deadline = time.monotonic() + 10
    while True:
        try:
            client.responses.create(**again)
            break
        except openai.BadRequestError as error:
            assert error.code == "conversation_locked" and time.monotonic() < deadline
            time.sleep(0.05)
    assert len(all_items(client, made.id)) == 3  # Hi, then Again and its answer
    running = client.responses.create(**long, background=True)
    locked()
    client.responses.cancel(running.id)  # answered once the run has ended
    client.responses.create(**again)
    # A turn refused before it runs lets the conversation go at once.
    assert status_error(lambda: client.responses.create(
        **{**again, "model": "no-such-model"})).status_code == 404
    client.responses.create(**again, background=True)
    assert client.conversations.retrieve(made.id).id == made.id


def test_an_item_reference_finds_an_item_of_a_conversation(client: Any) -> None:
    """Items added through the Conversations API are referred to by id as a stored
    response's are; one deleted is no longer found."""
    made = client.conversations.create(items=[message("Remember the number 7.")])
    [kept] = all_items(client, made.id)
    alone = client.responses.create(model="demo", input="Which number?", max_output_tokens=16)
    referred = client.responses.create(
        model="demo", max_output_tokens=16, store=False,  # or it would hold the item too
        input=[{"type": "item_reference", "id": kept.id},
               {"type": "message", "role": "user", "content": "Which number?"}])
    assert referred.usage.input_tokens > alone.usage.input_tokens  # the item was in it
    client.conversations.items.delete(kept.id, conversation_id=made.id)
    gone = status_error(lambda: client.responses.create(
        model="demo", max_output_tokens=16,
        input=[{"type": "item_reference", "id": kept.id}, message("Which number?")]))
    assert gone.status_code in (400, 404) and gone.body["param"].startswith("input[0]")


def test_the_item_index_follows_the_conversations() -> None:
    store = ConversationStore(max_count=2, ttl=0)
    first = store.create({}, items("one"))
    one = first.items[0]
    assert store.item(one["id"]) is one
    second = store.create({}, items("two"))
    store.delete_item(second, 0)
    assert store.item(second.id) is None
    store.create({}, items("three"))
    store.create({}, items("four"))  # pushes the first out
    assert store.get(first.id) is None and store.item(one["id"]) is None


# -- what is refused ------------------------------------------------------------------------


def test_conversation_on_responses_is_checked(client: Any) -> None:
    made = client.conversations.create()
    first = client.responses.create(model="demo", input="Hi", max_output_tokens=16)
    both = status_error(lambda: client.responses.create(
        model="demo", input="Hi", conversation=made.id, previous_response_id=first.id))
    assert both.status_code == 400 and both.code == "mutually_exclusive_parameters"
    assert both.body["param"] is None
    for call in (lambda: client.responses.create(model="demo", input="Hi",
                                                 conversation="conv_" + "0" * 48),
                 lambda: client.responses.input_tokens.count(model="demo", input="Hi",
                                                             conversation="conv_missing")):
        unknown = status_error(call)
        assert unknown.status_code == 404 and unknown.body["param"] == "conversation"
    for value, param in (("resp_123", "conversation"), (5, "conversation"),
                         ({}, "conversation.id"), ({"id": 7}, "conversation.id")):
        bad = status_error(lambda value=value: client.responses.create(
            model="demo", input="Hi", extra_body={"conversation": value}))
        assert bad.status_code == 400 and bad.body["param"] == param, value
    assert all_items(client, made.id) == []


@pytest.mark.parametrize(("body", "param"), [
    ({"items": [message(str(n)) for n in range(21)]}, "items"),
    ({"items": "Hi"}, "items"),
    ({"items": [{"type": "message", "role": "robot", "content": "x"}]}, "items[0].role"),
    ({"items": [message("a"), {"type": "message", "role": "user"}]}, "items[1].content"),
    ({"items": [{"type": "web_search_call"}]}, "items[0].type"),
    ({"metadata": {f"k{n}": "v" for n in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 64),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"metadata": []}, "metadata"),
    ({"name": "x"}, "name"),
])
def test_a_bad_conversation_body_is_400_with_its_param(http: httpx.Client, body: Any,
                                                       param: str) -> None:
    refused = http.post("/v1/conversations", json=body)
    assert refused.status_code == 400, refused.text
    validate_error(refused.json())
    assert refused.json()["error"]["param"] == param


def test_bad_item_requests_are_400_and_unknown_ids_404(client: Any,
                                                       http: httpx.Client) -> None:
    made = client.conversations.create(items=[message("Hi")])
    base = f"/v1/conversations/{made.id}"
    for method, path, body, param in (
        ("POST", base, {}, "metadata"),
        ("POST", base, {"metadata": {}, "extra": 1}, "extra"),
        ("POST", base + "/items", {}, "items"),
        ("POST", base + "/items", {"items": [message(str(n)) for n in range(21)]}, "items"),
        ("POST", base + "/items", {"items": [{"role": "user", "content": 3}]},
         "items[0].content"),
        # Two items of one id: getting or deleting it by its id found only the first.
        ("POST", base + "/items", {"items": [{**message("a"), "id": "msg_twice"},
                                             {**message("b"), "id": "msg_twice"}]},
         "items[1].id"),
        ("GET", base + "/items?limit=0", None, "limit"),
        ("GET", base + "/items?limit=101", None, "limit"),
        ("GET", base + "/items?limit=" + "9" * 5000, None, "limit"),  # int() refuses it
        ("GET", base + "/items?order=sideways", None, "order"),
        ("GET", base + "/items?after=msg_nope", None, "after"),
        ("GET", base + "/items?include[]=everything", None, "include[0]"),
    ):
        refused = http.request(method, path, json=body)
        assert refused.status_code == 400, (path, refused.text)
        validate_error(refused.json())
        assert refused.json()["error"]["param"] == param, path
    for method, path, param in (
        ("GET", "/v1/conversations/conv_nope", "conversation_id"),
        ("POST", "/v1/conversations/conv_nope/items", "conversation_id"),
        ("GET", "/v1/conversations/conv_nope/items", "conversation_id"),
        ("DELETE", f"{base}/items/msg_nope", "item_id"),
    ):
        absent = http.request(method, path, json={"items": []} if method == "POST" else None)
        assert absent.status_code == 404, path
        validate_error(absent.json())
        assert absent.json()["error"]["param"] == param
    assert len(all_items(client, made.id)) == 1  # nothing refused was added


# -- the store, in process ------------------------------------------------------------------


def items(*texts: str) -> list[dict[str, Any]]:
    return canonical_items([message(t) for t in texts])


def test_the_least_recently_changed_conversation_leaves_first() -> None:
    store = ConversationStore(max_count=2, ttl=0)
    a, b = store.create({}, items("a")), store.create({}, items("b"))
    store.add(a, items("a2"))  # now b is the least recently changed
    c = store.create({}, [])
    assert store.get(b.id) is None and store.get(a.id) is a and store.get(c.id) is c


def test_ttl_counts_from_the_last_change(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(conversation_store.time, "time", lambda: now[0])
    store = ConversationStore(max_count=10, ttl=60)
    kept, left = store.create({}, items("kept")), store.create({}, items("left"))
    now[0] = 1050.0
    store.append_turn(kept.id, items("again"))
    now[0] = 1070.0
    assert store.get(left.id) is None and store.get(kept.id) is kept


def test_the_byte_bound_evicts_others_and_refuses_what_cannot_fit() -> None:
    one = len(ConversationStore(10, 0).create({}, items("x" * 1000)).to_json())
    bound = 3 * one + one // 2
    store = ConversationStore(max_count=100, ttl=0, max_bytes=bound)
    made = [store.create({}, items("x" * 1000)) for _ in range(4)]
    assert store.get(made[0].id) is None and all(store.get(c.id) for c in made[1:])
    assert 3 * one - 10 <= store.bytes <= bound
    with pytest.raises(ConversationTooLarge) as refused:
        store.add(made[3], items("y" * bound))
    assert refused.value.param == "items" and len(made[3].items) == 1
    store.append_turn(made[3].id, items("y" * bound))  # logged, not added
    assert len(made[3].items) == 1 and store.get(made[3].id) is made[3]


def test_metadata_that_would_not_fit_is_refused_and_the_conversation_stays() -> None:
    store = ConversationStore(max_count=10, ttl=0, max_bytes=2000)
    made = store.create({}, items("x" * 1500))
    with pytest.raises(ConversationTooLarge) as refused:
        store.set_metadata(made, {f"k{n}": "v" * 100 for n in range(16)})
    assert refused.value.param == "metadata" and made.metadata == {}
    assert store.get(made.id) is made
    store.set_metadata(made, {"k": "v"})  # a small change still fits
    assert store.get(made.id) is made and made.metadata == {"k": "v"}


def test_a_change_let_in_at_the_very_bound_never_evicts_that_conversation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its time of change is counted at its old length when it is let in; a longer one
    then must not make the store push out the conversation just changed."""
    now = [1000.0]
    monkeypatch.setattr(conversation_store.time, "time", lambda: now[0])
    probe = ConversationStore(10, 0).create({}, items("a"))
    added = items("b")
    exact = len(probe.to_json()) + len(orjson.dumps(added[0])) + 1  # what _fit counts
    store = ConversationStore(max_count=10, ttl=0, max_bytes=exact)
    other = store.create({}, [])
    made = store.create({}, items("a"))
    now[0] = 1000.123456789
    store.add(made, added)  # fits by _fit's count, a few bytes over once stored
    assert store.get(made.id) is made and len(made.items) == 2
    assert store.get(other.id) is None  # the others still leave for it


def test_a_failed_or_cancelled_turn_adds_nothing() -> None:
    """Only a turn that ended by itself (cut at max_output_tokens too) joins."""
    dialect = OpenAIResponses(ResponseStore(10, 0), ConversationStore(10, 0))
    made = dialect.conversations.create({}, items("Hi"))
    body = (b'{"model": "demo", "input": "Again", "conversation": "' + made.id.encode()
            + b'"}')
    ended = [Content("Hello"), Finish("stop"), Usage(3, 1)]
    failed = dialect.reply(dialect.parse(body), model="demo", fingerprint="")
    failed.stream_start()
    failed.stream(ended[:1])
    failed.stream_error(ServerError("the model failed"))
    cancelled = dialect.reply(dialect.parse(body), model="demo", fingerprint="")
    cancelled.body([Content("He"), Finish("cancelled"), Usage(3, 1)])
    abandoned = dialect.reply(dialect.parse(body), model="demo", fingerprint="")
    abandoned.stream_start()
    abandoned.stream(ended[:1])
    abandoned.stream_abandoned()
    assert len(made.items) == 1
    done = dialect.reply(dialect.parse(body), model="demo", fingerprint="")
    done.body(ended)
    assert [i["type"] for i in made.items] == ["message"] * 3
    assert made.items[2]["content"][0]["text"] == "Hello"


def test_a_stored_time_still_to_come_does_not_hold_back_the_ttl(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file written under a clock since set back (or edited) reads back as of now: the
    store expires from its front, and that one would hold every later one past its ttl."""
    now = [1000.0]
    monkeypatch.setattr(conversation_store.time, "time", lambda: now[0])
    ahead = ConversationStore(max_count=10, ttl=0).create({}, items("Hi"))
    ahead.updated = 1e12
    (tmp_path / f"{ahead.id}.json").write_bytes(ahead.to_json())
    store = ConversationStore(max_count=10, ttl=60, folder=tmp_path)
    later = store.create({}, items("Later"))
    now[0] = 1061.0
    assert store.get(later.id) is None and store.get(ahead.id) is None
    store.close()


def test_a_persisted_store_skips_what_it_cannot_read(tmp_path: Path) -> None:
    store = ConversationStore(max_count=10, ttl=0, folder=tmp_path)
    kept = store.create({"a": "b"}, items("Hi"))
    store.close()
    (tmp_path / "conv_0.json").write_bytes(b"{not json")
    (tmp_path / "conv_1.json").write_bytes(kept.to_json())  # another id than its name
    again = ConversationStore(max_count=10, ttl=0, folder=tmp_path)
    assert len(again) == 1
    back = again.get(kept.id)
    assert back is not None and back.items == kept.items and back.metadata == {"a": "b"}


# -- across a restart -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_persisted_conversation_survives_a_restart(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    config = "[responses]\npersist = true\n"
    env = {"AFMD_CACHE_DIR": str(cache)}
    srv = start_server(tmp_path, config=config, env=env)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        made = client.conversations.create(items=[message("Hi")], metadata={"k": "v"})
        client.responses.create(model="demo", input="Again", conversation=made.id,
                                max_output_tokens=16)
        dropped = client.conversations.create()
        client.conversations.delete(dropped.id)
        before = [i.model_dump() for i in all_items(client, made.id)]
    finally:
        srv.stop()
    assert [p.name for p in (cache / "conversations").iterdir()] == [f"{made.id}.json"]
    srv = start_server(tmp_path, config=config, env=env)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert client.conversations.retrieve(made.id) == made
        assert [i.model_dump() for i in all_items(client, made.id)] == before
        alone = client.responses.input_tokens.count(model="demo", input="Once more")
        again = client.responses.create(model="demo", input="Once more",
                                        conversation=made.id, max_output_tokens=16)
        assert again.usage is not None  # the reloaded items are in its prompt
        assert again.usage.input_tokens > alone.input_tokens + 4
        assert len(all_items(client, made.id)) == len(before) + 1 + len(again.output)
    finally:
        srv.stop()


def test_conversation_settings(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[responses]\nmax_conversations = 3\nmax_conversations_bytes = 4096\n")
    config = load_config(path, env={})
    assert (config.responses.max_conversations,
            config.responses.max_conversations_bytes) == (3, 4096)
    default = load_config(None, env={}).responses
    assert (default.max_conversations, default.max_conversations_bytes) == (1000, 256 << 20)
    env = load_config(None, env={"AFMD_RESPONSES_MAX_CONVERSATIONS": "7",
                                 "AFMD_RESPONSES_MAX_CONVERSATIONS_BYTES": "0"}).responses
    assert (env.max_conversations, env.max_conversations_bytes) == (7, 0)
    for bad, key in (("max_conversations = 0", "responses.max_conversations"),
                     ("max_conversations_bytes = -1", "responses.max_conversations_bytes")):
        path.write_text(f"[responses]\n{bad}\n")
        with pytest.raises(ConfigError) as error:
            load_config(path, env={})
        assert error.value.key == key


def test_a_conversations_size_is_kept_as_it_changes_without_serializing_it_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each change counts what it adds or takes away; its JSON is never serialized whole
    on the event loop again (a large conversation held the server for as long as it took
    to write out, at every item added), and the count stays what that JSON's length is."""
    store = ConversationStore(max_count=10, ttl=0, max_bytes=1 << 30)
    made = store.create({"k": "v"}, items(*(f"item {n} " * 200 for n in range(20))))
    for _ in range(10):
        store.add(made, items(*("z" * 1000 for _ in range(20))))
    assert made.size() == len(made.to_json()) == store.bytes
    serialized: list[int] = []
    real = orjson.dumps

    def counting(value: Any, *args: Any) -> bytes:
        data = real(value, *args)
        serialized.append(len(data))
        return data

    monkeypatch.setattr(conversation_store.orjson, "dumps", counting)
    store.add(made, items("one more"))
    assert sum(serialized) < 2000, serialized  # the new item and the head, no more
    monkeypatch.undo()
    store.delete_item(made, 3)
    store.set_metadata(made, {"a": "b" * 50})
    assert made.size() == len(made.to_json()) == store.bytes
    store.delete_item(made, 0)
    while made.items:
        store.delete_item(made, 0)
    assert made.size() == len(made.to_json()) == store.bytes
