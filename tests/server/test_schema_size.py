"""What a request's JSON schemas cost the server before the grammar compiler sees them.

Every schema is checked against JSON Schema's metaschema first, pure Python holding the
GIL at a cost per subschema: the check is made cheaper (``afmd/service/metaschema.py``),
and a request's schemas are bounded in subschemas before any is checked. A schema of
tens of thousands of subschemas cost seconds of a core, on past the request's deadline,
only for the grammar compiler to refuse it afterwards ("schema too large"); counted first
now, a request whose schemas hold more than the compiler takes in one is a 400 naming the
schema, at a cost bounded by the count (``afmd/grammar/schema_size.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import pytest

from conftest import ServerProcess

#: More object subschemas than llguidance compiles in one schema (50,000), each ``{}``.
TOO_MANY = {"anyOf": [{} for _ in range(50_001)]}
#: Half as many: two of them together are past the bound, each alone within it.
HALF = {"type": "object", "properties": {"a": {"anyOf": [{} for _ in range(25_001)]}}}
HI = [{"role": "user", "content": "hi"}]


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# (path, body, the field the refusal names)
REQUESTS = [
    ("/v1/chat/completions",
     {"messages": HI, "max_tokens": 8, "response_format": {
         "type": "json_schema", "json_schema": {"name": "x", "schema": TOO_MANY}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions",
     {"messages": HI, "max_tokens": 8, "tools": [_tool("f", HALF), _tool("g", HALF)]},
     "tools[1].function.parameters"),
    ("/v1/responses",
     {"input": "hi", "max_output_tokens": 16, "text": {"format": {
         "type": "json_schema", "name": "x", "schema": TOO_MANY}}},
     "text.format.schema"),
    ("/v1/messages",
     {"model": "demo", "messages": HI, "max_tokens": 8, "output_config": {
         "format": {"type": "json_schema", "schema": TOO_MANY}}},
     "output_config.format.schema"),
    ("/api/chat", {"model": "demo", "messages": HI, "stream": False, "format": TOO_MANY},
     "format"),
]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize(("path", "body", "field"), REQUESTS,
                         ids=["chat", "chat-tools", "responses", "messages", "ollama-chat"])
def test_schemas_past_the_compilers_count_are_refused_before_the_metaschema_check(
        server: ServerProcess, http: httpx.Client, path: str, body: dict[str, Any],
        field: str) -> None:
    before = _cpu_seconds(server.proc.pid)
    started = time.monotonic()
    response = http.post(path, json=body)
    took = time.monotonic() - started
    assert response.status_code == 400, response.text[:500]
    error = response.json()
    message = error["error"] if path.startswith("/api/") else error["error"]["message"]
    assert "more than 50000 subschemas" in message, message
    if path.startswith("/api/") or path == "/v1/messages":  # the field starts the message
        assert message.startswith(field + ": "), message
    else:
        assert error["error"]["param"] == field
        assert error["error"]["code"] == "invalid_schema"
    spent = _cpu_seconds(server.proc.pid) - before
    assert spent < 1.5, f"the server spent {spent:.1f} s of CPU ({took:.1f} s) on the refusal"


#: Within the compiler's count, and in jsonschema's own check seconds of a core.
MANY = {"anyOf": [{} for _ in range(40_000)]}


def test_a_schema_within_the_count_is_checked_at_a_bounded_cost(
        server: ServerProcess, http: httpx.Client) -> None:
    """The metaschema check resolved 2020-12's dynamic references for every subschema,
    several times each; checked against the vocabularies joined into one document it
    costs a fraction (``afmd/service/metaschema.py``), and the schema is served."""
    before = _cpu_seconds(server.proc.pid)
    response = http.post("/v1/chat/completions", json={
        "messages": HI, "max_tokens": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": MANY}}})
    assert response.status_code == 200, response.text[:500]
    spent = _cpu_seconds(server.proc.pid) - before
    assert spent < 3, f"the server spent {spent:.1f} s of CPU on a 40,000-branch anyOf"
