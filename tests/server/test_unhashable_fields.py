"""Values of the wrong shape where a dialect looks a string up: a 400 naming the field.

An object or an array where a ``type`` (or a role, a mode) goes used to reach a set
lookup first and end as ``TypeError: unhashable type`` (a 500). Integer fields take
integers only: an integral float as large as ``1e20`` is no integer, and no field holds
more than int64.
"""

from __future__ import annotations

from typing import Any

import pytest

HI = [{"role": "user", "content": "hi"}]
FN = [{"type": "function", "name": "f"}]

# (path, body, the field the error names)
SHAPES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/responses", {"input": [{"type": {"a": 1}, "role": "user", "content": "hi"}]},
     "input[0].type"),
    ("/v1/responses", {"input": [{"type": [[{}]], "role": "user", "content": "hi"}]},
     "input[0].type"),
    ("/v1/responses", {"input": [{"type": "message", "role": {}, "content": "hi"}]},
     "input[0].role"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": [1], "name": "f"}]},
     "tools[0].type"),
    ("/v1/responses", {"input": "hi", "tools": FN, "tool_choice": {"type": {}}},
     "tool_choice.type"),
    ("/v1/responses", {"input": "hi", "tools": FN, "tool_choice": {
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": ["function"]}]}},
     "tool_choice.tools[0].type"),
    ("/v1/responses", {"input": "hi", "tools": FN, "tool_choice": {
        "type": "allowed_tools", "mode": {"auto": 1}, "tools": FN}},
     "tool_choice.mode"),
    ("/v1/chat/completions", {"messages": [{"role": {"x": 1}, "content": "hi"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": {}, "function": {}}]},
     "tools[0].type"),
]

INTEGERS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/messages", {"model": "demo", "messages": HI, "max_tokens": 1e20}, "max_tokens"),
    ("/v1/messages", {"model": "demo", "messages": HI, "max_tokens": 2.5}, "max_tokens"),
    ("/v1/messages", {"model": "demo", "messages": HI, "max_tokens": "8"}, "max_tokens"),
    ("/v1/messages", {"model": "demo", "messages": HI, "max_tokens": True}, "max_tokens"),
    ("/v1/messages", {"model": "demo", "messages": HI, "max_tokens": 8,
                      "top_k": 1.5}, "top_k"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 1e20}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "n": 1.5}, "n"),
    ("/v1/chat/completions", {"messages": HI, "seed": 2**64}, "seed"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1e20}, "max_output_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
]


def _named(response: Any, path: str, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if path == "/v1/messages":
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(field + ": "), error
    else:
        assert error["param"] == field, error
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body", "field"), SHAPES,
                         ids=[f"{p}:{f}" for p, _, f in SHAPES])
def test_unhashable_values_are_a_400_naming_the_field(http: Any, path: str,
                                                      body: dict[str, Any],
                                                      field: str) -> None:
    _named(http.post(path, json=body), path, field)


@pytest.mark.parametrize(("path", "body", "field"), INTEGERS,
                         ids=[f"{p}:{f}:{b.get(f)!r}" for p, b, f in INTEGERS])
def test_integer_fields_take_integers(http: Any, path: str, body: dict[str, Any],
                                      field: str) -> None:
    _named(http.post(path, json=body), path, field)


@pytest.mark.parametrize(("options", "field"), [
    ({"num_predict": 1e20}, "num_predict"), ({"num_predict": 2.5}, "num_predict"),
    ({"top_k": "8"}, "top_k"), ({"seed": 2**64}, "seed")])
def test_ollama_integer_options_take_integers(http: Any, options: dict[str, Any],
                                              field: str) -> None:
    response = http.post("/api/chat", json={"model": "demo", "messages": HI,
                                            "stream": False, "options": options})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]


def test_an_integral_float_of_ordinary_size_is_still_an_integer(http: Any) -> None:
    response = http.post("/v1/messages", json={"model": "demo", "messages": HI,
                                               "max_tokens": 4.0})
    assert response.status_code == 200, response.text
