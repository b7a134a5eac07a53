"""The client-run Responses tools' pieces that need no model: a cut call's whole values
(never a truncated command or path) and a shell call's commands read as they stream."""

from __future__ import annotations

import json

import pytest

from afmd.dialects.responses.client_tools import CommandStream, call_item, whole_values


@pytest.mark.parametrize(("written", "values"), [
    ('{"commands": ["ls", "rm -rf /tmp/bu', {"commands": ["ls"]}),
    ('{"commands": ["ls"], "timeout_ms": 12', {"commands": ["ls"]}),
    ('{"commands": ["ls"], "timeout_ms": 12}', {"commands": ["ls"], "timeout_ms": 12}),
    ('{"operation": {"type": "delete_file", "path": "src/ma',
     {"operation": {"type": "delete_file"}}),
    ('{"comm', {}),
    ('{"commands": ["a\\"b", "c\\', {"commands": ['a"b']}),
    ('{"a": {"b": [1, 2, tr', {"a": {"b": [1, 2]}}),
    ("", {}),
])
def test_a_cut_call_keeps_only_whole_values(written: str, values: object) -> None:
    assert whole_values(written) == values


def test_a_cut_patch_is_an_update_that_changes_nothing() -> None:
    item = call_item("apply_patch_call", "apc_1", "call_1", '{"operation": {"type": "upd',
                     "incomplete", None)
    assert item["status"] == "in_progress"  # the API's status has no "incomplete"
    assert item["operation"] == {"type": "update_file", "path": "", "diff": ""}


ARGUMENTS = json.dumps({"timeout_ms": 500, "commands": ["ls -la", 'echo "hi\\n" \u00e9🙂', ""],
                        "max_output_length": 4096})


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(ARGUMENTS)])
def test_commands_stream_as_they_are_written(size: int) -> None:
    stream = CommandStream()
    events = [event for start in range(0, len(ARGUMENTS), size)
              for event in stream.feed(ARGUMENTS[start:start + size])]
    commands = json.loads(ARGUMENTS)["commands"]
    assert stream.finish(commands) == []
    for index, command in enumerate(commands):
        mine = [(kind, text) for kind, number, text in events if number == index]
        assert mine[0] == ("added", "") and mine[-1] == ("done", command)
        assert "".join(text for kind, text in mine if kind == "delta") == command
    assert [e[1] for e in events] == sorted(e[1] for e in events)


def test_commands_not_streamed_are_sent_at_the_end() -> None:
    stream = CommandStream()
    stream.feed('{"commands": ["ls", "pw')
    assert stream.finish(["ls", "pwd", "id"]) == [
        ("delta", 1, "d"), ("done", 1, "pwd"),
        ("added", 2, ""), ("delta", 2, "id"), ("done", 2, "id")]
