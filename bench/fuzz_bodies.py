"""Fuzzed request bodies for every dialect, against a real afmd: no 5xx, never a dead server.

Each body starts as a valid request of one dialect (chat, completions, embeddings,
Responses, Messages and its token counter, Ollama's chat, generate and embed) and gets a
few random mutations: a value replaced by one of the wrong shape (objects and arrays where
strings go, floats and huge numbers where integers go, strings where numbers go), a key
removed, a known field of any dialect added with such a value, or a JSON schema with
extreme numbers, deep nesting or a huge enum put where each dialect takes one
(``response_format``, tool parameters, ``text.format``, ``output_config``, Ollama's
``format``). Bodies are encoded with the stdlib, so integers beyond 64 bits and ``NaN``
reach the server as written.

Counts status codes per dialect; exits 1 on any 5xx or if the server stops answering.

    python -m bench.fuzz_bodies --bodies 5000 --seed 1
    python -m bench.fuzz_bodies --url http://127.0.0.1:9999 --bodies 50000
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

HI = [{"role": "user", "content": "hi"}]
FUNCTION = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}}, "required": ["n"]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}},
          "required": ["a"]}

#: (dialect, path, a valid body) — small outputs, so accepted bodies finish quickly.
BASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat", "/v1/chat/completions", {"model": "demo", "messages": HI, "max_tokens": 4}),
    ("chat", "/v1/chat/completions", {
        "messages": HI, "max_tokens": 16, "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": FUNCTION}}]}),
    ("chat", "/v1/chat/completions", {
        "messages": HI, "max_tokens": 16, "stream": True, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}),
    ("completions", "/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 4}),
    ("embeddings", "/v1/embeddings", {"model": "demo-embedding", "input": "hi"}),
    ("responses", "/v1/responses", {"input": "hi", "max_output_tokens": 16}),
    ("responses", "/v1/responses", {
        "input": [{"type": "message", "role": "user", "content": "hi"}],
        "max_output_tokens": 16, "tool_choice": "auto",
        "tools": [{"type": "function", "name": "f", "parameters": FUNCTION}]}),
    ("responses", "/v1/responses", {
        "input": "hi", "max_output_tokens": 16, "store": False,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}}),
    ("messages", "/v1/messages", {"model": "demo", "messages": HI, "max_tokens": 4}),
    ("messages", "/v1/messages", {
        "model": "demo", "messages": HI, "max_tokens": 16, "tool_choice": {"type": "auto"},
        "tools": [{"name": "f", "input_schema": FUNCTION}]}),
    ("messages", "/v1/messages", {
        "model": "demo", "messages": HI, "max_tokens": 16,
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}),
    ("count_tokens", "/v1/messages/count_tokens", {"model": "demo", "messages": HI}),
    ("ollama_chat", "/api/chat", {"model": "demo", "messages": HI, "stream": False,
                                  "options": {"num_predict": 4}}),
    ("ollama_chat", "/api/chat", {"model": "demo", "messages": HI, "stream": False,
                                  "format": SCHEMA, "options": {"num_predict": 16}}),
    ("ollama_generate", "/api/generate", {"model": "demo", "prompt": "hi", "stream": False,
                                          "options": {"num_predict": 4}}),
    ("ollama_embed", "/api/embed", {"model": "demo-embedding", "input": "hi"}),
]

#: Fields of every dialect: added to bodies of the others too.
FIELDS = [
    "model", "messages", "input", "prompt", "max_tokens", "max_completion_tokens",
    "max_output_tokens", "n", "top_k", "top_p", "temperature", "stop", "stop_sequences",
    "stream", "stream_options", "tools", "tool_choice", "response_format", "text",
    "output_config", "format", "options", "seed", "logprobs", "top_logprobs", "logit_bias",
    "parallel_tool_calls", "reasoning", "reasoning_effort", "thinking", "system",
    "instructions", "previous_response_id", "store", "include", "metadata", "user",
    "suffix", "echo", "best_of", "keep_alive", "think", "images", "raw", "template",
    "encoding_format", "dimensions", "truncate", "prediction", "service_tier", "context",
    "presence_penalty", "frequency_penalty", "conversation", "truncation",
]
#: Fields inside Ollama's options.
OPTIONS = ["num_predict", "num_ctx", "top_k", "top_p", "temperature", "seed", "stop",
           "repeat_penalty", "min_p", "num_keep"]
#: Strings that are meaningful somewhere, so mutations reach past the first type check.
WORDS = ["function", "auto", "required", "none", "any", "tool", "json_schema", "json_object",
         "text", "message", "user", "assistant", "system", "developer", "input_text",
         "output_text", "function_call", "function_call_output", "reasoning", "allowed_tools",
         "tool_use", "tool_result", "image", "enabled", "disabled", "adaptive", "low", "high",
         "demo", "f", "", "x" * 300,
         # JSON's own punctuation: as a stop sequence it cuts a structured answer or a
         # call's arguments mid-value.
         '"', ":", "{", ","]
INT64_MIN = -(2**63)
NUMBERS = [0, -1, 1, 2, 2.5, 1e20, -1e20, 1e300, -1e300, INT64_MIN, INT64_MIN + 1,
           INT64_MIN - 1, 2**63 - 1, 2**63, 2**64, 10**40, 1e-300, -0.0, 4.0, 16,
           float("nan"), float("inf")]


def weird(rng: random.Random, depth: int = 0) -> Any:
    """A value of a random shape: the wrong one for most fields."""
    roll = rng.random()
    if roll < 0.3:
        return rng.choice(NUMBERS)
    if roll < 0.5:
        return rng.choice(WORDS)
    if roll < 0.6:
        return rng.choice([None, True, False])
    if roll < 0.65:
        return "8"
    if depth > 2 or roll < 0.8:
        return rng.choice([[], {}, [1], ["x"], {"type": rng.choice(WORDS)},
                           [{"type": rng.choice(WORDS)}], {"type": {"a": 1}},
                           {"type": [1, 2]}, [[{}]]])
    if roll < 0.9:
        return [weird(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    return {rng.choice([*FIELDS, "type", "name", "role", "content", "id"]):
            weird(rng, depth + 1) for _ in range(rng.randint(1, 3))}


def schema(rng: random.Random, depth: int = 0) -> Any:
    """A JSON schema aimed at the grammar compiler's edges."""
    roll = rng.random()
    number = rng.choice(NUMBERS)
    if roll < 0.15:
        return {"enum": [rng.choice(NUMBERS) for _ in range(rng.randint(1, 3))]}
    if roll < 0.3:
        return {"const": number}
    if roll < 0.45:
        kind = rng.choice(["integer", "number"])
        out: dict[str, Any] = {"type": kind}
        for key in rng.sample(["minimum", "maximum", "exclusiveMinimum",
                               "exclusiveMaximum", "multipleOf"], rng.randint(1, 3)):
            out[key] = rng.choice(NUMBERS)
        if rng.random() < 0.3:
            out["maximum"] = out.get("minimum", number)
        return out
    if roll < 0.55:
        return {"type": "string", rng.choice(["minLength", "maxLength", "pattern",
                                              "format"]): rng.choice(
            [*NUMBERS, "^a+$", "(", "\\d{99999}", "date-time", "x{2,1}"])}
    if roll < 0.6:
        return {"enum": list(range(rng.choice([100, 20_000])))}
    if roll < 0.65:
        return weird(rng)
    if depth > 4:
        return {"type": "integer"}
    if roll < 0.8:
        return {"type": "object", "properties": {
            f"p{i}": schema(rng, depth + 1) for i in range(rng.randint(1, 3))},
            "required": rng.choice([[], ["p0"], "p0", [1]])}
    if roll < 0.9:
        return {rng.choice(["anyOf", "oneOf", "allOf"]): [
            schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    return {"type": "array", "items": schema(rng, depth + 1),
            rng.choice(["minItems", "maxItems"]): rng.choice(NUMBERS)}


def _places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path in a body (a key or an index per step)."""
    out = [path] if path else []
    if isinstance(value, dict):
        for key, child in value.items():
            out += _places(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            out += _places(child, (*path, i))
    return out


def _parent(body: Any, path: tuple[Any, ...]) -> Any:
    for step in path[:-1]:
        body = body[step]
    return body


def _put_schema(dialect: str, body: dict[str, Any], rng: random.Random) -> None:
    s = schema(rng)
    tool_params = {"type": "object", "properties": {"v": s}} if rng.random() < 0.5 else s
    if dialect == "chat":
        if rng.random() < 0.5:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": s}}
        else:
            body["tools"] = [{"type": "function",
                              "function": {"name": "f", "parameters": tool_params}}]
    elif dialect == "responses":
        if rng.random() < 0.5:
            body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": s}}
        else:
            body["tools"] = [{"type": "function", "name": "f", "parameters": tool_params}]
    elif dialect in ("messages", "count_tokens"):
        if rng.random() < 0.5:
            body["output_config"] = {"format": {"type": "json_schema", "schema": s}}
        else:
            body["tools"] = [{"name": "f", "input_schema": tool_params}]
    elif dialect.startswith("ollama"):
        body["format"] = s


def _cap(obj: dict[str, Any], key: str, cap: int) -> None:
    """``obj[key]`` back to ``cap`` where it is absent or a whole number that asks for a
    long (or, for Ollama's 0 and negatives, unlimited) generation; other values stay."""
    value = obj.get(key)
    whole = type(value) is int or (
        type(value) is float and value.is_integer() and abs(value) < 2**53)
    if value is None or (whole and not 1 <= value <= 64):
        obj[key] = cap


def fuzz_body(rng: random.Random) -> tuple[str, str, bytes]:
    """One mutated body: (dialect, path, the JSON bytes)."""
    dialect, path, base = rng.choice(BASES)
    body = copy.deepcopy(base)
    if rng.random() < 0.35:
        _put_schema(dialect, body, rng)
    for _ in range(rng.randint(0 if dialect != "count_tokens" else 1, 3)):
        roll = rng.random()
        places = _places(body)
        if roll < 0.55 and places:
            where = rng.choice(places)
            _parent(body, where)[where[-1]] = weird(rng)
        elif roll < 0.7 and places:
            where = rng.choice(places)
            parent = _parent(body, where)
            if isinstance(parent, dict):
                del parent[where[-1]]
        elif roll < 0.9:
            body[rng.choice(FIELDS)] = weird(rng)
        else:
            options = body.setdefault("options", {})
            if isinstance(options, dict):
                options[rng.choice(OPTIONS)] = weird(rng)
    # Accepted bodies stay short: a cap a mutation removed comes back, and a valid but
    # large one is lowered (a long generation is no bug: it would only end in the
    # request timeout's 504 and slow the run). Wrong shapes are left as they are.
    for key in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
        if key in base:
            _cap(body, key, base[key])
    # Apple's model answers 503 model_unavailable where its framework cannot run (any
    # machine but a Mac on macOS 26): a designed answer, not one a body provokes.
    if body.get("model") == "system":
        body["model"] = "demo"
    if dialect in ("ollama_chat", "ollama_generate"):
        if body.get("options") is None:
            body["options"] = {}
        if isinstance(body["options"], dict):
            _cap(body["options"], "num_predict", 16)
    return dialect, path, json.dumps(body).encode()


async def run(url: str, bodies: int, seed: int, concurrency: int, timeout: float,
              log: Any = print) -> dict[str, Any]:
    """Send ``bodies`` fuzzed bodies; the counts, the 5xx found and whether it lived."""
    rng = random.Random(seed)
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    failures: list[dict[str, Any]] = []
    queue: asyncio.Queue[tuple[str, str, bytes] | None] = asyncio.Queue(maxsize=concurrency * 2)
    alive = True
    started = time.perf_counter()

    async def worker(http: httpx.AsyncClient) -> None:
        while (item := await queue.get()) is not None:
            dialect, path, payload = item
            try:
                response = await http.post(path, content=payload, headers={
                    "Content-Type": "application/json"})
                status = str(response.status_code)
                if response.status_code >= 500:
                    failure = {"dialect": dialect, "path": path, "status": status,
                               "body": payload.decode()[:2000],
                               "answer": response.text[:500]}
                    failures.append(failure)
                    if len(failures) <= 10:  # as they come: a long run shows them early
                        log("  5xx: " + json.dumps(failure)[:1500])
            except httpx.TimeoutException:
                status = "timeout"
            except httpx.TransportError as exc:
                status = f"transport:{type(exc).__name__}"
            counts[dialect][status] += 1

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        tasks = [asyncio.create_task(worker(http)) for _ in range(concurrency)]
        for i in range(bodies):
            await queue.put(fuzz_body(rng))
            if (i + 1) % 1000 == 0:
                try:
                    health = await http.get("/health", timeout=30)
                    alive = health.status_code < 500
                except httpx.HTTPError:
                    alive = False
                log(f"  {i + 1} bodies, {time.perf_counter() - started:.0f} s, "
                    f"5xx so far {len(failures)}, alive {alive}")
                if not alive:
                    break
        for _ in tasks:
            await queue.put(None)
        await asyncio.gather(*tasks)
        try:
            alive = alive and (await http.get("/health", timeout=30)).status_code < 500
        except httpx.HTTPError:
            alive = False
    return {"bodies": sum(sum(c.values()) for c in counts.values()),
            "seconds": round(time.perf_counter() - started, 1),
            "counts": {d: dict(sorted(c.items())) for d, c in sorted(counts.items())},
            "failures": failures, "alive": alive}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running afmd (default: start one on the demo model)")
    parser.add_argument("--bodies", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", type=Path, help="write the counts here as JSON")
    args = parser.parse_args(argv)
    server = None
    url = args.url
    if url is None:
        from bench.soak import start_server

        work = Path(tempfile.mkdtemp(prefix="afmd-fuzz-"))
        server = start_server(work, model="demo", concurrency=args.concurrency,
                              settings={}, launcher=None, cache_dir=work / "cache")
        url = server.url
    try:
        result = asyncio.run(run(url, args.bodies, args.seed, args.concurrency,
                                 args.timeout))
        if server is not None:
            result["alive"] = result["alive"] and server.alive()
    finally:
        if server is not None:
            server.stop()
    text = json.dumps({k: v for k, v in result.items() if k != "failures"}, indent=1)
    print(text)
    for failure in result["failures"][:20]:
        print(json.dumps(failure))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["alive"] and not result["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
