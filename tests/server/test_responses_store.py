"""The Responses API's state and edges: the bounded store (in memory and persisted across a
restart), how items become chat turns, the [responses] settings, the gate's screening of
every route, and a failure after the stream began."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from afmd.config.bounds import ConfigError
from afmd.config.load import load_config
from afmd.core.request import Message, ToolCall
from afmd.dialects.responses import store as responses_store
from afmd.dialects.responses.items import ItemParams, canonical_items, to_messages
from afmd.dialects.responses.responses_body import parse_responses_request
from afmd.dialects.responses.store import ResponseStore, Stored
from afmd.errors import InvalidRequestError
from afmd.service.chat_template import template_messages

from conftest import ServerProcess, start_server
from helpers.openai_schemas import validate_error
from helpers.responses_schemas import validate_event, validate_response

pytestmark = pytest.mark.slow  # restarts, persistence and its own servers

# -- the store ------------------------------------------------------------------------------


def stored(n: int, created: float = 0.0) -> Stored:
    item = {"id": f"msg_{n}", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": str(n)}], "status": "completed"}
    return Stored({"id": f"resp_{n}"}, (item,), (item,), created)


def test_store_keeps_the_newest_max_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(responses_store.time, "time", lambda: 1000.0)
    store = ResponseStore(max_stored=2, ttl=0)
    for n in range(3):
        store.put(f"resp_{n}", stored(n, 1000.0))
    assert store.get("resp_0") is None and len(store) == 2
    assert store.conversation("resp_2") == stored(2).conversation
    assert store.delete("resp_1") and not store.delete("resp_1")
    nothing = ResponseStore(max_stored=0, ttl=0)
    nothing.put("resp_0", stored(0))
    assert nothing.get("resp_0") is None


def test_store_forgets_after_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(responses_store.time, "time", lambda: now[0])
    store = ResponseStore(max_stored=10, ttl=60)
    store.put("resp_old", stored(0, 1000.0))
    now[0] = 1030.0
    store.put("resp_new", stored(1, 1030.0))
    now[0] = 1061.0
    assert store.get("resp_old") is None
    assert store.get("resp_new") is not None


def test_a_stored_time_still_to_come_does_not_hold_back_the_ttl(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file written under a clock since set back (or edited) reads back as of now: the
    store expires from its front, and that one would hold every later one past its ttl."""
    now = [1000.0]
    monkeypatch.setattr(responses_store.time, "time", lambda: now[0])
    (tmp_path / "resp_0.json").write_bytes(stored(0, 1e12).to_json())
    store = ResponseStore(max_stored=10, ttl=60, folder=tmp_path)
    assert store.get("resp_0") is not None  # read back
    store.put("resp_1", stored(1, 1000.0))
    now[0] = 1061.0
    assert store.get("resp_1") is None and store.get("resp_0") is None
    store.close()


def test_store_persists_and_reloads(tmp_path: Path) -> None:
    store = ResponseStore(max_stored=2, ttl=0, folder=tmp_path)
    for n in range(3):
        store.put(f"resp_{n}", stored(n, float(n)))
    store.close()  # the writer thread has written (and removed) every file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resp_1.json", "resp_2.json"]
    (tmp_path / "resp_9.json").write_text("{not json")
    again = ResponseStore(max_stored=1, ttl=0, folder=tmp_path)
    assert again.get("resp_1") is None and again.get("resp_2") == stored(2, 2.0)
    again.close()
    assert not (tmp_path / "resp_1.json").exists()


def test_a_stored_file_of_another_shape_is_skipped_not_fatal(tmp_path: Path) -> None:
    good = stored(1, 1.0)
    (tmp_path / "resp_1.json").write_bytes(good.to_json())
    base = json.loads(good.to_json())
    shapes = {"list": [1, 2], "string": "x", "no-response": {**base, "response": 3},
              "items": {**base, "conversation": [1, 2]},
              "input": {**base, "input_items": {"a": 1}},
              "created": {**base, "created": "soon"}, "bool": {**base, "created": True},
              "missing": {"response": {}}}
    for name, shape in shapes.items():
        (tmp_path / f"resp_{name}.json").write_text(json.dumps(shape))
    store = ResponseStore(max_stored=100, ttl=0, folder=tmp_path)
    assert len(store) == 1 and store.get("resp_1") == good
    assert store.item("msg_1") == good.conversation[0]
    store.close()


def test_a_stored_file_whose_items_are_out_of_shape_is_skipped(tmp_path: Path) -> None:
    """Continuing a conversation renders its stored items as they are: an item edited out
    of shape made every continuation of it a 500 (TypeError, KeyError, AttributeError)."""
    good = stored(1, 1.0)
    (tmp_path / "resp_1.json").write_bytes(good.to_json())
    bad = {"content": [{"type": "message", "role": "user", "content": 5}],
           "missing": [{"type": "message", "role": "user"}],
           "role": [{"type": "message", "role": "wizard", "content": "x"}],
           "summary": [{"type": "reasoning", "summary": [{"x": 1}]}],
           "kind": [{"type": "weird"}]}
    for name, items in bad.items():
        shape = {"response": {"id": f"resp_{name}"}, "input_items": items,
                 "conversation": items, "created": 1.0}
        (tmp_path / f"resp_{name}.json").write_text(json.dumps(shape))
    renamed = {**json.loads(good.to_json()), "response": {"id": "resp_other"}}
    (tmp_path / "resp_renamed.json").write_text(json.dumps(renamed))
    cut = {"id": "msg_2", "type": "message", "role": "assistant", "status": "incomplete",
           "content": [{"type": "output_text", "text": "cut", "annotations": [], "logprobs": []}]}
    (tmp_path / "resp_2.json").write_bytes(
        Stored({"id": "resp_2"}, good.input_items, (*good.conversation, cut), 2.0).to_json())
    store = ResponseStore(max_stored=100, ttl=0, folder=tmp_path)
    assert sorted(store._entries) == ["resp_1", "resp_2"]
    assert store.get("resp_1") == good
    assert store.conversation("resp_2")[-1] == cut  # read back with the status it had
    for name in (*bad, "renamed"):
        with pytest.raises(InvalidRequestError) as unknown:
            parse_responses_request({"input": "hi", "previous_response_id": f"resp_{name}"},
                                    lookup=store.conversation)
        assert unknown.value.code == "previous_response_not_found"
    store.close()


def test_a_folder_entry_that_is_no_stored_file_is_skipped_unread(tmp_path: Path) -> None:
    """A FIFO named like a stored response kept the server from starting (reading it waits
    for a writer), and a file larger than the whole byte bound was read whole, then pushed
    every older response out before it left itself."""
    good = stored(1, 1.0)
    (tmp_path / "resp_1.json").write_bytes(good.to_json())
    huge = big(2, 200_000, 2.0)
    (tmp_path / "resp_2.json").write_bytes(huge.to_json())
    os.mkfifo(tmp_path / "resp_fifo.json")
    made: list[ResponseStore] = []
    loading = threading.Thread(target=lambda: made.append(ResponseStore(
        max_stored=100, ttl=0, folder=tmp_path, max_bytes=100_000)), daemon=True)
    loading.start()
    loading.join(timeout=60)
    if loading.is_alive():  # let the stuck read end, so that the test can fail
        with open(tmp_path / "resp_fifo.json", "wb"):
            pass
        loading.join()
    assert made, "the store never finished reading its folder"
    store = made[0]
    assert store.get("resp_1") == good and store.get("resp_2") is None
    store.close()


def test_a_write_that_fails_leaves_no_partial_file(tmp_path: Path) -> None:
    """A failed write (a full disk) left its temporary file behind, one per response."""
    (tmp_path / "resp_1.json").mkdir()  # the final rename cannot replace a folder
    (tmp_path / "resp_1.json" / "x").write_text("x")
    store = ResponseStore(max_stored=10, ttl=0, folder=tmp_path)
    store.put("resp_1", stored(1))
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resp_1.json"]


def test_an_item_id_held_twice_falls_back_when_one_holder_goes() -> None:
    """A client may send its own item id again with other content: deleting the newer
    response shows the older one's item, and deleting both forgets the id."""
    store = ResponseStore(max_stored=10, ttl=0)
    first = stored(1)
    second_item = {**first.conversation[0], "content": [{"type": "input_text", "text": "b"}]}
    store.put("resp_1", first)
    store.put("resp_2", Stored({"id": "resp_2"}, (second_item,), (second_item,), 0.0))
    assert store.item("msg_1") == second_item
    assert store.delete("resp_2")
    assert store.item("msg_1") == first.conversation[0]
    store.put("resp_2", Stored({"id": "resp_2"}, (second_item,), (second_item,), 0.0))
    assert store.delete("resp_1")
    assert store.item("msg_1") == second_item
    assert store.delete("resp_2")
    assert store.item("msg_1") is None


def big(n: int, size: int, created: float = 0.0) -> Stored:
    """A stored response echoing a large ``user`` field, as a client may send one."""
    base = stored(n, created)
    return Stored({**base.response, "user": "u" * size}, base.input_items,
                  base.conversation, created)


def test_store_bounds_the_bytes_it_holds_oldest_first() -> None:
    one = len(big(0, 100_000).to_json())
    store = ResponseStore(max_stored=1000, ttl=0, max_bytes=3 * one + one // 2)
    for n in range(6):
        store.put(f"resp_{n}", big(n, 100_000))
        assert store.bytes <= store.max_bytes
    assert [store.get(f"resp_{n}") is not None for n in range(6)] == [False] * 3 + [True] * 3
    assert store.bytes == 3 * one
    store.delete("resp_5")
    assert store.bytes == 2 * one
    # One response larger than the whole bound is not kept (and pushes nothing out).
    store.put("resp_huge", big(9, 10 * one))
    assert store.get("resp_huge") is None and store.get("resp_4") is not None


def test_a_long_conversation_counts_its_items_once_and_leaves_the_others_be() -> None:
    """Each response of a conversation holds the whole of it, the items shared in memory:
    counted in every response, 100 turns came to 50 times the memory they held, and one
    long conversation pushed every other response out of the store; and the index of
    item ids held an entry per item per response."""
    store = ResponseStore(max_stored=1000, ttl=0, max_bytes=200_000)
    store.put("resp_other", stored(0))
    alone = store.bytes
    history: tuple[dict[str, Any], ...] = ()
    for n in range(1, 101):  # as a reply stores a continuation: the history's own items
        item = {"id": f"msg_{n}", "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "x" * 500}], "status": "completed"}
        history = (*history, item)
        store.put(f"resp_{n}", Stored({"id": f"resp_{n}"}, (item,), history, 0.0))
    assert len(store) == 101 and store.get("resp_other") is not None
    items = sum(len(json.dumps(i, separators=(",", ":"))) for i in history)
    assert store.bytes < alone + 3 * items  # each input also in its input_items
    # The ids item_reference looks up hold each item once too, not once per response.
    assert sum(len(objects) for objects in store._items.values()) == 101
    assert store.item("msg_1") is history[0]
    # Two continuations of one response share what came before; the count falls back as
    # its holders go, to nothing once none is left.
    store.put("resp_branch", Stored({"id": "resp_branch"}, (), history, 0.0))
    for n in (*range(100, 0, -1), "other"):
        assert store.delete(f"resp_{n}")
    assert store.bytes == len(Stored({"id": "resp_branch"}, (), history, 0.0).to_json())
    assert store.delete("resp_branch") and store.bytes == 0


def test_a_persisted_store_honours_the_byte_bound_when_read_back(tmp_path: Path) -> None:
    store = ResponseStore(max_stored=100, ttl=0, folder=tmp_path)
    for n in range(5):
        store.put(f"resp_{n}", big(n, 50_000, float(n)))
    store.close()
    assert len(list(tmp_path.glob("resp_*.json"))) == 5
    one = (tmp_path / "resp_0.json").stat().st_size
    again = ResponseStore(max_stored=100, ttl=0, folder=tmp_path, max_bytes=2 * one)
    assert [again.get(f"resp_{n}") is not None for n in range(5)] == [False] * 3 + [True] * 2
    again.close()
    assert sorted(p.name for p in tmp_path.glob("resp_*.json")) == ["resp_3.json",
                                                                    "resp_4.json"]


# -- items into chat turns ------------------------------------------------------------------


def call(call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "add", "arguments": "{}"}


def output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": f"out {call_id}"}


def test_an_assistant_turn_is_one_message_and_outputs_follow_in_call_order() -> None:
    items = canonical_items([
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "thinking"}], "encrypted_content": None},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        call("a"), call("b"), output("b"), output("a"),
        call("c"), output("c"),
    ])
    messages = to_messages(items, ItemParams(0))
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool", "assistant",
                                          "tool"]
    first = messages[1]
    assert first.reasoning == "thinking" and first.content == "Let me see."
    assert [c.id for c in first.tool_calls] == ["a", "b"]
    assert [m.tool_call_id for m in messages[2:4]] == ["a", "b"]
    assert messages[4].tool_calls == (ToolCall("c", "add", "{}"),) and messages[4].content is None


def test_reasoning_sent_back_is_rendered_as_reasoning_content() -> None:
    """Templates that know ``reasoning_content`` (Qwen3, DeepSeek) put it back as the
    turn's thinking; those that do not ignore the key."""
    rendered = template_messages((
        Message(role="user", content="Hi"),
        Message(role="assistant", content="Hello", reasoning="The user greets me."),
        Message(role="user", content="Again"),
    ))
    assert rendered[1] == {"role": "assistant", "content": "Hello",
                           "reasoning_content": "The user greets me."}
    assert "reasoning_content" not in template_messages(
        (Message(role="assistant", content="Hello"),))[0]


def test_stored_items_are_named_by_previous_response_id() -> None:
    stored_items = canonical_items([{"role": "user", "content": "Hi"}, call("a")])
    params = ItemParams(len(stored_items))
    assert params(1) == "previous_response_id" and params(2, ".call_id") == "input[0].call_id"
    with pytest.raises(Exception) as missing:
        to_messages((*stored_items, *canonical_items([{"role": "user", "content": "x"}])),
                    params)
    assert getattr(missing.value, "param", None) == "previous_response_id"


# -- settings -------------------------------------------------------------------------------


def test_responses_settings(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[responses]\nmax_stored = 5\nttl = 60\npersist = true\n"
                    "max_stored_bytes = 1048576\n")
    config = load_config(path, env={})
    assert (config.responses.max_stored, config.responses.ttl) == (5, 60.0)
    assert config.responses.persist is True
    assert config.responses.max_stored_bytes == 1 << 20
    assert load_config(None, env={}).responses.max_stored_bytes == 256 << 20
    env = load_config(None, env={"AFMD_RESPONSES_PERSIST": "false",
                                 "AFMD_RESPONSES_MAX_STORED": "0",
                                 "AFMD_RESPONSES_MAX_STORED_BYTES": "4096"})
    assert env.responses.persist is False and env.responses.max_stored == 0
    assert env.responses.max_stored_bytes == 4096
    for bad, key in (("max_stored = -1", "responses.max_stored"),
                     ("max_stored_bytes = -1", "responses.max_stored_bytes"),
                     ("ttl = -5", "responses.ttl"),
                     ("persist = 1", "responses.persist"),
                     ("max_stord = 3", "responses.max_stord")):
        path.write_text(f"[responses]\n{bad}\n")
        with pytest.raises(ConfigError) as error:
            load_config(path, env={})
        assert error.value.key == key


# -- a guarded, short-lived server ----------------------------------------------------------

KEY = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("responses-guarded")
    srv = start_server(tmp, config='[server]\napi_key = "sekrit"\nrequest_timeout = 3.0\n'
                       "[queue]\nmax_concurrent_requests = 1\nmax_queued_requests = 0\n")
    yield srv
    srv.stop()


ROUTES = [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
          ("DELETE", "/v1/responses/resp_1"), ("GET", "/v1/responses/resp_1/input_items"),
          ("POST", "/v1/responses/input_tokens"), ("POST", "/v1/responses/rid/cancel"),
          ("POST", "/v1/conversations"), ("GET", "/v1/conversations/conv_1"),
          ("POST", "/v1/conversations/conv_1"), ("DELETE", "/v1/conversations/conv_1"),
          ("GET", "/v1/conversations/conv_1/items"), ("POST", "/v1/conversations/conv_1/items"),
          ("GET", "/v1/conversations/conv_1/items/msg_1"),
          ("DELETE", "/v1/conversations/conv_1/items/msg_1")]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_is_screened_by_the_gate(guarded: ServerProcess, method: str,
                                             path: str) -> None:
    body = b'{"input": "x"}' if method == "POST" else None
    headers = {"Content-Type": "application/json"}
    refused = httpx.request(method, guarded.url + path, content=body, headers=headers)
    assert refused.status_code == 401, refused.text
    validate_error(refused.json())
    assert refused.json()["error"]["code"] == "invalid_api_key"
    if body is not None:
        media = httpx.request(method, guarded.url + path, content=body,
                              headers={**KEY, "Content-Type": "text/plain"})
        assert media.status_code == 415
    wrong = httpx.request("PUT", guarded.url + path, headers=KEY)
    assert wrong.status_code == 405 and method in wrong.headers["allow"]


def test_a_failure_after_the_stream_began_is_error_then_failed(guarded: ServerProcess) -> None:
    body = {"input": "Tell me a long story.", "max_output_tokens": 8000, "stream": True,
            "temperature": 0}
    response = httpx.post(guarded.url + "/v1/responses", json=body, headers=KEY, timeout=30)
    assert response.status_code == 200
    events = []
    for block in response.text.split("\n\n"):
        if block.strip():
            event = json.loads(block.partition("\ndata: ")[2])
            validate_event(event)
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    error, failed = events[-2:]
    assert (error["type"], error["code"], error["param"]) == ("error", "timeout", None)
    assert failed["type"] == "response.failed"
    response_object = failed["response"]
    assert response_object["status"] == "failed"
    assert response_object["error"]["code"] == "server_error"
    assert response_object["output"][0]["status"] == "incomplete"
    assert response_object["output"][0]["content"][0]["text"]
    stored_object = httpx.get(f"{guarded.url}/v1/responses/{response_object['id']}",
                              headers=KEY).json()
    validate_response(stored_object)
    assert stored_object == response_object


def test_a_full_queue_is_429_and_a_late_answer_504(guarded: ServerProcess) -> None:
    """The queue and request_timeout hold for this dialect as for chat, in its envelope."""
    long = {"input": "Tell me a long story.", "max_output_tokens": 8000, "temperature": 0}
    with httpx.Client(timeout=30) as c, c.stream(
            "POST", guarded.url + "/v1/responses", json={**long, "stream": True},
            headers=KEY) as hog:
        chunks = hog.iter_bytes()  # kept: a dropped iterator closes the stream
        next(chunks)  # it holds the only slot
        full = httpx.post(guarded.url + "/v1/responses", json=long, headers=KEY, timeout=30)
        assert full.status_code == 429 and "retry-after" in full.headers
        validate_error(full.json())
        assert full.json()["error"]["code"] == "rate_limited"
    late = httpx.post(guarded.url + "/v1/responses", json=long, headers=KEY, timeout=30)
    assert late.status_code == 504
    validate_error(late.json())
    assert late.json()["error"]["code"] == "timeout"


def test_persisted_responses_survive_a_restart(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    config = "[responses]\npersist = true\nmax_stored = 2\n"
    env = {"AFMD_CACHE_DIR": str(cache)}
    srv = start_server(tmp_path, config=config, env=env)
    try:
        ids = []
        for text in ("one", "two", "three"):
            r = httpx.post(srv.url + "/v1/responses", timeout=60,
                           json={"input": text, "max_output_tokens": 16})
            ids.append(r.json()["id"])
        kept = {i: httpx.get(f"{srv.url}/v1/responses/{i}").json() for i in ids[1:]}
        assert httpx.get(f"{srv.url}/v1/responses/{ids[0]}").status_code == 404
    finally:
        srv.stop()
    assert sorted(p.stem for p in (cache / "responses").iterdir()) == sorted(ids[1:])
    srv = start_server(tmp_path, config=config, env=env)
    try:
        for i, body in kept.items():
            assert httpx.get(f"{srv.url}/v1/responses/{i}").json() == body
        follow = httpx.post(srv.url + "/v1/responses", timeout=60, json={
            "input": "four", "previous_response_id": ids[2], "max_output_tokens": 16})
        assert follow.status_code == 200
        assert follow.json()["usage"]["input_tokens"] > kept[ids[2]]["usage"]["input_tokens"]
    finally:
        srv.stop()
