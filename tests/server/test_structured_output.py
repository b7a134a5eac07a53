"""Structured output end to end: response_format json_schema / json_object on the demo model.

Under the grammar even random weights write valid JSON matching the schema. Strings carry
``maxLength`` and integers bounds so that answers stay short (random weights otherwise
write until ``max_tokens``).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from conftest import parse_sse

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "maxItems": 3},
        "note": {"type": ["string", "null"], "maxLength": 8},
        "choice": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                             {"type": "boolean"}]},
        "owner": {"$ref": "#/$defs/owner"},
        "flags": {"type": "object",
                  "properties": {"active": {"type": "boolean"},
                                 "level": {"enum": [1, 2, 3]}},
                  "required": ["active", "level"], "additionalProperties": False},
    },
    "required": ["id", "kind", "tags", "note", "choice", "owner", "flags"],
    "additionalProperties": False,
    "$defs": {
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    },
}


def json_schema_format(schema: dict[str, Any], name: str = "thing") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True,
                                                   "schema": schema}}


def post(http: Any, **body: Any) -> Any:
    return http.post("/v1/chat/completions",
                     json={"messages": MESSAGES, "max_tokens": 300, **body})


def resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/")
        node: Any = root
        for part in ref[2:].split("/"):
            node = node[part]
        schema = node
    return schema


def check_key_order(pairs: Any, schema: dict[str, Any], root: dict[str, Any]) -> None:
    """Every object's keys come in the order of its schema's ``properties``."""
    schema = resolve(schema, root)
    if isinstance(pairs, list) and pairs and all(isinstance(p, tuple) for p in pairs):
        keys = [k for k, _ in pairs]
        order = list(schema.get("properties", {}))
        assert keys == [k for k in order if k in keys], f"{keys} not in schema order {order}"
        for key, value in pairs:
            check_key_order(value, schema["properties"][key], root)
    elif isinstance(pairs, list):
        items = schema.get("items", {})
        for value in pairs:
            check_key_order(value, items, root)


def pairs_of(text: str) -> Any:
    """The JSON text with each object as its list of (key, value) pairs, in text order."""
    return json.loads(text, object_pairs_hook=list)


def check_json_answer(content: str | None, schema: dict[str, Any]) -> Any:
    assert content is not None
    assert "```" not in content
    assert content == content.strip()
    value = json.loads(content)
    jsonschema.validate(value, schema)
    check_key_order(pairs_of(content), schema, schema)
    return value


def test_json_schema_rich_schema_is_followed(http) -> None:
    def run(seed: int) -> Any:
        return post(http, response_format=json_schema_format(SCHEMA), seed=seed)

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(run, range(5)))
    values = []
    for response in responses:
        assert response.status_code == 200, response.text
        assert "x-grammar-constraints" not in response.headers
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        values.append(check_json_answer(choice["message"]["content"], SCHEMA))
    # Different seeds, different (valid) answers: the grammar constrains, not a template.
    assert len({json.dumps(v) for v in values}) > 1


def test_streamed_json_schema_reassembles_to_the_same_json(http) -> None:
    body = {"response_format": json_schema_format(SCHEMA), "seed": 3}
    whole = post(http, **body)
    assert whole.status_code == 200
    content = whole.json()["choices"][0]["message"]["content"]
    check_json_answer(content, SCHEMA)
    streamed = post(http, stream=True, **body)
    assert streamed.status_code == 200
    events = parse_sse(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks]
    text = "".join(d for d in deltas if d)
    assert text == content
    assert sum(1 for d in deltas if d) > 3, "the answer streams as it is written"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0][
        "finish_reason"]] == ["stop"]


class Address(BaseModel):
    street: str = Field(max_length=10)
    number: int = Field(ge=1, le=999)


class Person(BaseModel):
    name: str = Field(max_length=12)
    mood: Literal["happy", "sad", "calm"]
    age: int = Field(ge=0, le=120)
    address: Address


def test_parse_with_a_pydantic_model(client) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="demo", messages=MESSAGES, response_format=Person, max_tokens=300,
            seed=seed,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        person = message.parsed
        assert isinstance(person, Person)
        assert isinstance(person.address, Address)
        assert person.mood in ("happy", "sad", "calm")
        assert 0 <= person.age <= 120 and len(person.name) <= 12
        assert [k for k, _ in pairs_of(message.content)] == list(Person.model_fields)
        assert "```" not in message.content


class Meeting(BaseModel):
    starts: datetime.datetime
    day: datetime.date
    alarm: datetime.time
    moved: list[datetime.datetime] = Field(max_length=2)


def test_dates_are_written_as_pydantic_reads_them(client) -> None:
    """``format`` ``date-time``, ``date`` and ``time`` (a pydantic date field's schema)
    are held to what pydantic parses: RFC 3339 as written by llguidance also allowed
    ``t``/``z``, ``:60`` and any February 29, and ``parse()`` raised on such answers
    (``2666-12-31T23:48:60Z``, ``6666-11-30t23:56:60Z``)."""
    for seed in range(4):
        completion = client.chat.completions.parse(
            model="demo", messages=MESSAGES, response_format=Meeting, max_tokens=300,
            seed=seed, reasoning_effort="none",
        )
        assert completion.choices[0].finish_reason == "stop"
        meeting = completion.choices[0].message.parsed
        assert isinstance(meeting, Meeting) and isinstance(meeting.starts, datetime.datetime)
        jsonschema.validate(json.loads(completion.choices[0].message.content),
                            Meeting.model_json_schema())


def test_json_object_is_a_json_object(http) -> None:
    finished = 0
    for seed in range(4):
        response = post(http, response_format={"type": "json_object"}, seed=seed)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        content = choice["message"]["content"]
        assert content.startswith("{") and "```" not in content
        if choice["finish_reason"] == "stop":
            finished += 1
            assert isinstance(json.loads(content), dict)
    assert finished >= 2


UNIQUE = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "uniqueItems": True, "minItems": 2, "maxItems": 4}


def test_unsupported_keyword_is_best_effort_and_says_so(http) -> None:
    # Seeds 0 and 1 repeat an item on the demo model: best effort still answers (200).
    for seed in range(4):
        response = post(http, response_format=json_schema_format(UNIQUE), seed=seed,
                        max_tokens=60)
        assert response.status_code == 200, response.text
        assert response.headers["x-grammar-constraints"] == "downgraded"
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        value = json.loads(choice["message"]["content"])
        # What the grammar could enforce, it did.
        jsonschema.validate(value, {**UNIQUE, "uniqueItems": False})
    streamed = post(http, response_format=json_schema_format(UNIQUE), seed=0, stream=True,
                    max_tokens=60)
    assert streamed.status_code == 200
    assert streamed.headers["x-grammar-constraints"] == "downgraded"
    assert "error" not in streamed.text


#: zod 4's ``z.email()`` pattern (ECMA-262: it opens with look-aheads), as the AI SDK
#: sends a tool's parameters.
ZOD_EMAIL = (r"^(?!\.)(?!.*\.\.)([A-Za-z0-9_'+\-\.]*)[A-Za-z0-9_+-]@"
             r"([A-Za-z0-9][A-Za-z0-9\-]*\.)+[A-Za-z]{2,}$")


def test_ecma_patterns_are_valid_schemas(http) -> None:
    """A schema's ``pattern`` is an ECMA-262 regular expression. Python's ``re`` judged
    them, so ``\\p{L}`` and ``(?<name>...)`` made the schema invalid (400); llguidance
    cannot enforce look-around, so zod's email pattern made it one that "cannot be used"
    (400): the AI SDK's tools with an email parameter failed on every request."""
    letters = {"type": "object", "additionalProperties": False, "required": ["word", "year"],
               "properties": {"word": {"type": "string", "pattern": r"^\p{L}{1,6}$"},
                              "year": {"type": "string", "pattern": r"^(?<y>[0-9]{4})$"}}}
    response = post(http, response_format=json_schema_format(letters), temperature=0)
    assert response.status_code == 200, response.text
    assert "x-grammar-constraints" not in response.headers  # llguidance enforces both
    value = json.loads(response.json()["choices"][0]["message"]["content"])
    assert value["word"].isalpha() and 1 <= len(value["word"]) <= 6, value
    assert value["year"].isdigit() and len(value["year"]) == 4, value

    email = {"type": "object", "additionalProperties": False, "required": ["to"],
             "properties": {"to": {"type": "string", "format": "email", "maxLength": 12,
                                   "pattern": ZOD_EMAIL}}}
    tools = [{"type": "function", "function": {"name": "send", "parameters": email}}]
    response = post(http, tools=tools, tool_choice="required", temperature=0)
    assert response.status_code == 200, response.text
    # The rest of the schema is enforced; the pattern is not, and the answer says so.
    assert response.headers["x-grammar-constraints"] == "downgraded"
    call = response.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    arguments = json.loads(call["arguments"])
    assert set(arguments) == {"to"} and len(arguments["to"]) <= 12, arguments

    broken = {"type": "object", "properties": {"a": {"type": "string", "pattern": "["}}}
    response = post(http, response_format=json_schema_format(broken))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_schema"
    assert "is not a 'regex'" in response.json()["error"]["message"]


def test_supported_schema_is_not_downgraded(http) -> None:
    response = post(http, response_format=json_schema_format(
        {"type": "object", "properties": {"ok": {"type": "boolean"}},
         "required": ["ok"], "additionalProperties": False}), max_tokens=150)
    assert response.status_code == 200
    assert "x-grammar-constraints" not in response.headers
    assert json.loads(response.json()["choices"][0]["message"]["content"]) in (
        {"ok": True}, {"ok": False})


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "foo"},
        {"type": 5},
        {"type": "object", "properties": {"a": {"type": "nope"}}},
        {"type": "object", "required": "a"},
        {"type": "array", "maxItems": -1},
    ],
    ids=["unknown-type", "numeric-type", "nested-unknown-type", "required-not-array",
         "negative-maxItems"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_schema_that_is_not_a_schema_is_rejected(http, schema: Any, stream: bool) -> None:
    response = post(http, response_format=json_schema_format(schema), stream=stream)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_schema"
    assert error["param"] == "response_format.json_schema.schema"
    assert error["type"] == "invalid_request_error"


def test_tool_parameters_that_are_not_a_schema_are_rejected(http) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
    response = post(http, tools=tools)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_schema",
                                               "tools[0].function.parameters")


def test_schema_that_is_not_an_object_is_a_type_error(http) -> None:
    response = post(http, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": ["not", "an", "object"]}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_type",
                                               "response_format.json_schema.schema")


@pytest.mark.parametrize("name", ["a b", "", "x" * 65, "r\u00e9sum\u00e9", "a.b"])
def test_a_schema_name_follows_a_tool_names_rule(http, name: str) -> None:
    response = post(http, response_format=json_schema_format({"type": "object"}, name))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value",
                                               "response_format.json_schema.name")
    assert post(http, response_format=json_schema_format({"type": "object"}, "A-z_0-9"),
                max_tokens=4).status_code == 200


def _plan(response_format: dict[str, Any], *, downgraded: bool = False) -> Any:
    from afmd.dialects.openai.chat_body import parse_chat_request
    from afmd.service.output_plan import OutputPlan

    request = parse_chat_request({"messages": MESSAGES, "response_format": response_format})
    schema = request.response_format.schema if request.response_format else None
    return OutputPlan(json_answer=True, schema=schema, downgraded=downgraded)


def test_final_check_accepts_every_number_json_allows() -> None:
    """A JSON grammar may write 6e99999 or a 40-digit integer: valid JSON, not an error."""
    from afmd.errors import ServerError

    plan = _plan({"type": "json_object"})
    plan.check_answer('{"a": 6e99999, "b": 1234567890123456789012345678901234567890}')
    for bad in ('{"a": ', "[1, 2]", "```json\n{}\n```"):
        with pytest.raises(ServerError) as info:
            plan.check_answer(bad)
        assert info.value.code == "invalid_json_output"


def test_final_check_of_output_nested_too_deep_to_read_is_invalid_json() -> None:
    """Nesting deeper than either parser reads is the invalid-JSON error, not a crash."""
    from afmd.errors import ServerError

    deep = "[" * 100_000 + "]" * 100_000
    for plan in (_plan({"type": "json_object"}), _plan(json_schema_format(UNIQUE))):
        with pytest.raises(ServerError) as info:
            plan.check_answer(deep)
        assert info.value.code == "invalid_json_output"


def test_final_check_of_output_too_deep_for_the_schema_check_is_invalid_json() -> None:
    """A recursive schema lets output nest as deep as the tokens allow; readable JSON
    that the schema check cannot descend through is an answer left unchecked: an error."""
    from afmd.errors import ServerError

    nested = {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
              "$ref": "#/$defs/n"}
    plan = _plan(json_schema_format(nested))
    plan.check_answer("[[[]]]")
    with pytest.raises(ServerError) as info:
        plan.check_answer("[" * 1000 + "]" * 1000)
    assert info.value.code == "invalid_json_output"


def test_final_check_of_a_downgraded_schema_is_best_effort() -> None:
    from afmd.errors import ServerError

    plan = _plan(json_schema_format(UNIQUE))
    with pytest.raises(ServerError):
        plan.check_answer("[1, 1]")
    _plan(json_schema_format(UNIQUE), downgraded=True).check_answer("[1, 1]")
    with pytest.raises(ServerError):
        _plan(json_schema_format(UNIQUE), downgraded=True).check_answer("[1, 1")


#: A pattern Python's backtracking ``re`` takes hours to search on any text it matches.
_BACKTRACKS = "^(a|a)*a{40}$"


def test_final_check_leaves_patterns_to_the_grammar() -> None:
    """The grammar held the answer to its patterns with a linear matcher; the check after
    it, on the event loop, searched them again with ``re``, which took hours on the very
    answer the grammar wrote, and the server answered no one meanwhile. Run in a process
    of its own, so that such a search fails the test instead of stalling the suite. The
    answer's other keywords are still checked."""
    code = f"""
import json
from afmd.errors import ServerError
from afmd.service.output_plan import OutputPlan

value = {{"type": "string", "pattern": {_BACKTRACKS!r}}}
for schema, answer in (
        ({{"type": "object", "properties": {{"a": value}}, "required": ["a"]}},
         {{"a": "a" * 41}}),
        ({{"type": "object", "patternProperties": {{{_BACKTRACKS!r}: {{"type": "integer"}}}},
          "additionalProperties": False}}, {{"a" * 41: 1}})):
    plan = OutputPlan(json_answer=True, schema=schema, downgraded=False)
    plan.check_answer(json.dumps(answer))
try:
    OutputPlan(json_answer=True, schema={{"type": "object", "properties": {{"a": value}},
                                          "required": ["a"]}}).check_answer('{{"a": 5}}')
except ServerError as exc:
    assert exc.code == "invalid_json_output"
else:
    raise AssertionError("a wrong type passed the check")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_one_schema_verdict_serves_each_place_it_is_used(http) -> None:
    """Schema checks are cached by schema; the error still names where this one was."""
    bad = {"type": "object", "properties": {"x": {"type": 7}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    for _ in range(2):
        error = post(http, tools=tools).json()["error"]
        assert (error["code"], error["param"]) == ("invalid_schema",
                                                   "tools[0].function.parameters")
        error = post(http, response_format=json_schema_format(bad)).json()["error"]
        assert (error["code"], error["param"]) == ("invalid_schema",
                                                   "response_format.json_schema.schema")
    good = {**bad, "properties": {"x": {"type": "integer"}}}
    assert post(http, response_format=json_schema_format(good)).status_code == 200


# ------------------------------------------------- a grammar the engine stops following
#
# The compiler accepts this schema, but its output is forced item after item, and
# following that outgrows llguidance's per-step parser limit ("Too many items") once
# decoding starts; the matcher then allows only the end of output. That is the
# client's schema at fault, said as a compile failure is, never a cut answer (it was a
# 500 invalid_json_output, or a tool call cut short). Thinking is off so that the answer,
# and the failure, come first.
FORCED = {"type": "array", "items": {"const": 16}, "minItems": 100000}
FORCED_TOOL = {"type": "object", "properties": {"a": FORCED}, "required": ["a"]}
HI = [{"role": "user", "content": "hi"}]
STOPPED = "the grammar engine stopped following it during generation (parser error: Too many"

# (path, body, the field the error names)
RUNTIME_FAILURES = [
    ("/v1/chat/completions",
     {"messages": HI, "max_tokens": 8, "reasoning_effort": "none",
      "response_format": json_schema_format(FORCED)},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions",
     {"messages": HI, "max_tokens": 8, "reasoning_effort": "none", "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": FORCED_TOOL}}]},
     "tools"),
    ("/v1/responses",
     {"input": "hi", "max_output_tokens": 16, "reasoning": {"effort": "none"},
      "text": {"format": {"type": "json_schema", "name": "x", "schema": FORCED}}},
     "text.format.schema"),
    ("/v1/messages",
     {"model": "demo", "messages": HI, "max_tokens": 8, "thinking": {"type": "disabled"},
      "output_config": {"format": {"type": "json_schema", "schema": FORCED}}},
     "output_config.format.schema"),
    ("/api/chat",
     {"model": "demo", "messages": HI, "stream": False, "think": False, "format": FORCED},
     None),
    ("/api/generate",
     {"model": "demo", "prompt": "hi", "stream": False, "think": False, "format": FORCED},
     None),
]


@pytest.mark.parametrize(("path", "body", "field"), RUNTIME_FAILURES,
                         ids=["chat", "chat-tool", "responses", "messages", "ollama-chat",
                              "ollama-generate"])
def test_a_grammar_the_engine_stops_following_is_the_clients_error(
    http: Any, path: str, body: dict[str, Any], field: str | None
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if path.startswith("/api/"):  # Ollama's errors are one message
        assert STOPPED in error
    elif path == "/v1/messages":
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{field}: ") and STOPPED in error["message"]
    else:
        assert (error["code"], error["param"]) == ("invalid_schema", field)
        assert STOPPED in error["message"]
    alive = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert alive.status_code == 200


def test_a_stream_whose_grammar_the_engine_stops_following_ends_with_the_error(http) -> None:
    response = http.post("/v1/chat/completions", json={
        **RUNTIME_FAILURES[0][1], "stream": True})
    assert response.status_code == 200  # the stream began before the grammar gave up
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    errors = [e["error"] for e in events[:-1] if "error" in e]
    assert len(errors) == 1, events
    assert (errors[0]["code"], errors[0]["param"]) == ("invalid_schema",
                                                       "response_format.json_schema.schema")
    assert STOPPED in errors[0]["message"]
    finishes = [c["finish_reason"] for e in events[:-1] if "choices" in e
                for c in e["choices"] if c.get("finish_reason")]
    assert finishes == []  # no "stop" claims the cut answer is whole


# ------------------------------------------------ a stop sequence inside a JSON answer
#
# The client's stop sequence cuts the answer where the client asked: that text, with
# finish_reason "stop" (Anthropic: "stop_sequence"), as OpenAI answers; it was a 500
# invalid_json_output, the server blamed for the cut the client asked for.
SHORT = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8},
                                          "b": {"type": "integer"}},
         "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_stop_sequence_cuts_a_json_answer_where_the_client_asked(http, stream: bool) -> None:
    response = http.post("/v1/chat/completions", json={
        "messages": HI, "max_tokens": 60, "reasoning_effort": "none", "stop": [":"],
        "stream": stream, "response_format": json_schema_format(SHORT)})
    assert response.status_code == 200, response.text
    if stream:
        events = parse_sse(response.text)[:-1]
        assert not [e for e in events if "error" in e], events
        content = "".join(c["delta"].get("content") or "" for e in events
                          for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"]
                  if c.get("finish_reason")]
    else:
        choice = response.json()["choices"][0]
        content, finish = choice["message"]["content"], [choice["finish_reason"]]
    # The grammar writes the keys in order: '{"a"' and then the colon the stop cut at.
    assert (content, finish) == ('{"a"', ["stop"])


def reasoned_answer(http: Any, stream: bool, stop: list[str]) -> tuple[str, str, str]:
    """Reasoning, content and finish reason of an answer the demo model thinks about first
    (its reasoning holds a ':' too)."""
    asked = [{"role": "user", "content": "What is the weather in Paris, and what is 2+3?"}]
    response = http.post("/v1/chat/completions", json={
        "messages": asked, "max_tokens": 300, "seed": 0, "reasoning_effort": "medium",
        "stream": stream, "response_format": json_schema_format(SHORT), "stop": stop})
    assert response.status_code == 200, response.text
    if stream:
        deltas = [c["delta"] for e in parse_sse(response.text)[:-1] for c in e["choices"]]
        finish = [c["finish_reason"] for e in parse_sse(response.text)[:-1]
                  for c in e["choices"] if c.get("finish_reason")]
        return ("".join(d.get("reasoning_content") or "" for d in deltas),
                "".join(d.get("content") or "" for d in deltas), finish[-1])
    choice = response.json()["choices"][0]
    return (choice["message"].get("reasoning_content") or "",
            choice["message"]["content"], choice["finish_reason"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_stop_sequence_in_the_reasoning_does_not_end_the_answer(http, stream: bool) -> None:
    """Only the content is matched, as OpenAI matches a reasoning model's: a stop sequence
    the reasoning holds leaves the answer whole; one in the content still cuts it."""
    reasoning, content, finish = reasoned_answer(http, stream, [])
    assert reasoning and content and finish == "stop"
    stop = next(reasoning[i:i + 3] for i in range(len(reasoning) - 2)
                if reasoning[i:i + 3].strip() and reasoning[i:i + 3] not in content)
    assert reasoned_answer(http, stream, [stop]) == (reasoning, content, "stop"), stop
    assert reasoned_answer(http, stream, [stop, ":"]) == (
        reasoning, content[: content.index(":")], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_newline_stop_leaves_the_answer_after_the_thinking(http, stream: bool) -> None:
    """The blank lines the model writes after ``</think>`` are not the answer (the client
    never sees them): a "\n" stop cuts the answer at its own first line break, not before
    its first character."""
    reasoning, content, _ = reasoned_answer(http, stream, [])
    assert content and "\n" not in content[:1]
    assert reasoned_answer(http, stream, ["\n"]) == (
        reasoning, content.split("\n")[0], "stop")


def test_a_stop_sequence_cuts_a_json_answer_in_messages(http) -> None:
    response = http.post("/v1/messages", json={
        "model": "demo", "messages": HI, "max_tokens": 60, "thinking": {"type": "disabled"},
        "stop_sequences": [":"], "output_config": {"format": {"type": "json_schema",
                                                              "schema": SHORT}}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", ":")
    assert [b["text"] for b in body["content"] if b["type"] == "text"] == ['{"a"']
