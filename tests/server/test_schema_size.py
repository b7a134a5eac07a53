"""What a request's JSON schemas cost the server before the grammar compiler sees them.

Every schema is checked against JSON Schema's metaschema first, pure Python holding the
GIL at a cost per subschema: the check is made cheaper (``afmd/service/metaschema.py``).
"""

from __future__ import annotations

import os

import httpx

from conftest import ServerProcess

HI = [{"role": "user", "content": "hi"}]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
