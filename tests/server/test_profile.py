"""The ``X-AFM-Profile`` stream events, on the real server and demo model.

``X-AFM-Profile: true`` adds one event ``{"afm_profile": PROFILE}`` to a stream;
``X-AFM-Profile: extended`` adds ``{"afm_profile_extended": {"summary": PROFILE,
"samples": [SAMPLE, ...]}}`` instead. Either comes after the finish chunk and the usage
chunk (when ``include_usage``) and right before ``data: [DONE]``; it is not a chunk (no
``choices``). A non-streaming answer carries the same key at its top level.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from typing import Any

import httpx
import jsonschema
import pytest

from conftest import ServerProcess, parse_sse

CHAT = "/v1/chat/completions"

_COUNT = {"type": "integer", "minimum": 0}
_MS = {"type": "number", "minimum": 0}
_RATE = {"type": ["number", "null"], "exclusiveMinimum": 0}

#: One request's profile. Token counts match the usage chunk; times are milliseconds from
#: the request's arrival (queue_ms: until it got a slot; ttft_ms: until its first token;
#: total_ms: until it finished); rates are null when there was nothing to measure;
#: peak_memory_bytes is null where the platform cannot tell; chip names the processor;
#: gpu_power_w is null (afmd does not sample power); bandwidth_gb_s is the estimate
#: "weight bytes per decoded token x decode rate", null without a decode rate. The
#: prediction's counts are usage's; ``speculation`` has, per proposal source that ran
#: (prediction, prompt_lookup, draft), the proposed tokens verification accepted and
#: rejected and its passes.
PROFILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "prompt_tokens", "cached_tokens", "cached_ram_tokens", "cached_disk_tokens",
        "completion_tokens", "queue_ms", "ttft_ms",
        "total_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes",
        "chip", "gpu_power_w", "bandwidth_gb_s", "accepted_prediction_tokens",
        "rejected_prediction_tokens", "speculation",
    ],
    "properties": {
        "prompt_tokens": _COUNT,
        "cached_tokens": _COUNT,
        "cached_ram_tokens": _COUNT,
        "cached_disk_tokens": _COUNT,
        "completion_tokens": _COUNT,
        "queue_ms": _MS,
        "ttft_ms": _MS,
        "total_ms": _MS,
        "prefill_tokens_per_s": _RATE,
        "decode_tokens_per_s": _RATE,
        "peak_memory_bytes": {"type": ["integer", "null"], "minimum": 0},
        "chip": {"type": "string", "minLength": 1},
        "gpu_power_w": {"type": ["number", "null"], "minimum": 0},
        "bandwidth_gb_s": {"type": ["number", "null"], "minimum": 0},
        "accepted_prediction_tokens": _COUNT,
        "rejected_prediction_tokens": _COUNT,
        "speculation": {
            "type": "object",
            "propertyNames": {"enum": ["prediction", "prompt_lookup", "draft"]},
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["accepted", "rejected", "verifications"],
                "properties": {"accepted": _COUNT, "rejected": _COUNT, "verifications": _COUNT},
            },
        },
    },
}

#: A progress sample: ms since the request's arrival, completion tokens so far, and the
#: memory in use then.
SAMPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["t_ms", "tokens", "memory_bytes"],
    "properties": {"t_ms": _MS, "tokens": _COUNT, "memory_bytes": _COUNT},
}

#: The two events, each an object with exactly one key.
SUMMARY_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["afm_profile"],
    "properties": {"afm_profile": PROFILE_SCHEMA},
}
EXTENDED_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["afm_profile_extended"],
    "properties": {
        "afm_profile_extended": {
            "type": "object",
            "additionalProperties": False,
            "required": ["summary", "samples"],
            "properties": {
                "summary": PROFILE_SCHEMA,
                "samples": {"type": "array", "minItems": 1, "items": SAMPLE_SCHEMA},
            },
        }
    },
}

MAX_SAMPLE_GAP = 16  # tokens between consecutive samples, at most


def check(schema: dict[str, Any], instance: Any) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(instance)


def body(text: str = "Describe the weather.", *, max_tokens: int = 24,
         include_usage: bool = True) -> dict[str, Any]:
    b: dict[str, Any] = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if include_usage:
        b["stream_options"] = {"include_usage": True}
    return b


def profiled_stream(http: httpx.Client, mode: str, **kw: Any) -> tuple[list[Any], float]:
    t0 = time.monotonic()
    r = http.post(CHAT, json=body(**kw), headers={"X-AFM-Profile": mode})
    wall_ms = (time.monotonic() - t0) * 1000
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    return events, wall_ms


def check_summary(profile: dict[str, Any], usage: dict[str, Any], wall_ms: float) -> None:
    assert profile["prompt_tokens"] == usage["prompt_tokens"]
    assert profile["completion_tokens"] == usage["completion_tokens"]
    assert profile["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert profile["cached_tokens"] <= profile["prompt_tokens"]
    assert profile["queue_ms"] <= profile["ttft_ms"] <= profile["total_ms"] <= wall_ms
    assert profile["gpu_power_w"] is None  # not measured, so not reported
    if profile["completion_tokens"] > 1:
        assert profile["decode_tokens_per_s"] is not None
    # bandwidth is derived from the decode rate, so it exists exactly when that does
    assert (profile["bandwidth_gb_s"] is None) == (profile["decode_tokens_per_s"] is None)


def test_summary_event_position_and_shape(http: httpx.Client) -> None:
    events, wall_ms = profiled_stream(http, "true")
    chunks, profile_event = events[:-2], events[-2]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]  # usage chunk, then profile
    assert all("afm_profile" not in c and "afm_profile_extended" not in c for c in chunks)
    assert "choices" not in profile_event
    check(SUMMARY_EVENT_SCHEMA, profile_event)
    check_summary(profile_event["afm_profile"], chunks[-1]["usage"], wall_ms)


def test_summary_event_without_include_usage(http: httpx.Client) -> None:
    events, _ = profiled_stream(http, "true", include_usage=False)
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert not any(isinstance(e, dict) and e.get("usage") for e in events)
    check(SUMMARY_EVENT_SCHEMA, events[-2])
    assert events[-2]["afm_profile"]["completion_tokens"] == 24


def test_extended_event_and_samples(http: httpx.Client) -> None:
    events, wall_ms = profiled_stream(http, "extended", max_tokens=100)
    chunks, event = events[:-2], events[-2]
    assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
    assert not any("afm_profile" in c or "afm_profile_extended" in c for c in chunks)
    assert "choices" not in event and "afm_profile" not in event
    check(EXTENDED_EVENT_SCHEMA, event)
    summary = event["afm_profile_extended"]["summary"]
    samples = event["afm_profile_extended"]["samples"]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 100
    check_summary(summary, usage, wall_ms)

    tokens = [s["tokens"] for s in samples]
    times = [s["t_ms"] for s in samples]
    assert tokens == sorted(tokens) and times == sorted(times)
    assert tokens[0] <= MAX_SAMPLE_GAP
    gaps = [b - a for a, b in itertools.pairwise(tokens)]
    assert max(gaps) <= MAX_SAMPLE_GAP, tokens
    # The last sample is taken as the generation finishes and counts every token.
    assert tokens[-1] == summary["completion_tokens"], tokens
    assert summary["queue_ms"] <= times[0] and times[-1] <= summary["total_ms"]
    assert all(s["memory_bytes"] > 0 for s in samples)


def test_no_profile_without_the_header(http: httpx.Client) -> None:
    for headers in ({}, {"X-AFM-Profile": "false"}):
        r = http.post(CHAT, json=body(max_tokens=4), headers=headers)
        assert r.status_code == 200
        assert "afm_profile" not in r.text
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []


#: A whole answer's output-token count, where each dialect keeps it.
NON_STREAMING: dict[str, tuple[str, dict[str, Any], Any]] = {
    "chat": (CHAT, {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8},
             lambda d: d["usage"]["completion_tokens"]),
    "completions": ("/v1/completions", {"prompt": "Hi.", "max_tokens": 8},
                    lambda d: d["usage"]["completion_tokens"]),
    "responses": ("/v1/responses", {"input": "Hi.", "max_output_tokens": 16, "store": False},
                  lambda d: d["usage"]["output_tokens"]),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Hi."}],
                                  "max_tokens": 8}, lambda d: d["usage"]["output_tokens"]),
    "ollama": ("/api/chat", {"messages": [{"role": "user", "content": "Hi."}],
                             "options": {"num_predict": 8}}, lambda d: d["eval_count"]),
}


@pytest.mark.parametrize("dialect", list(NON_STREAMING))
@pytest.mark.parametrize("mode", ["true", "extended"])
def test_a_whole_answer_carries_the_profile_in_every_dialect(
    http: httpx.Client, dialect: str, mode: str
) -> None:
    """A non-streaming answer has nowhere to put an event: the profile is a key at its
    top level, in every dialect (Ollama's answer always had it; the others dropped the
    header silently). Without the header, the body is the API's own, key for key."""
    path, payload, output_tokens = NON_STREAMING[dialect]
    payload = {"model": "demo", **payload, "stream": False}
    r = http.post(path, json=payload, headers={"X-AFM-Profile": mode})
    assert r.status_code == 200, r.text
    data = r.json()
    if mode == "true":
        check(PROFILE_SCHEMA, data["afm_profile"])
        profile = data["afm_profile"]
    else:
        check(EXTENDED_EVENT_SCHEMA, {"afm_profile_extended": data["afm_profile_extended"]})
        profile = data["afm_profile_extended"]["summary"]
        assert "afm_profile" not in data
    assert profile["completion_tokens"] == output_tokens(data)
    plain = http.post(path, json=payload)
    assert plain.status_code == 200, plain.text
    assert "afm_profile" not in plain.text
    if dialect == "chat":
        assert set(plain.json()) == {"id", "object", "created", "model",
                                     "system_fingerprint", "choices", "usage"}


def test_openai_client_streams_with_profile_header(client: Any) -> None:
    kwargs: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Describe the weather."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    plain = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-AFM-Profile": "true"},
    )
    chunks = list(stream)  # the client does not choke on the extra event
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1
    assert usage_chunks[0].usage.completion_tokens == 12
    # The client has no notion of the event: it surfaces as one last "chunk" without
    # choices, its payload kept as an extra field. Code that guards on `chunk.choices`
    # (as it must for the usage chunk) skips it.
    extra = chunks[-1]
    assert extra is not usage_chunks[0]
    assert not extra.choices
    check(SUMMARY_EVENT_SCHEMA, {"afm_profile": extra.model_extra["afm_profile"]})
    assert extra.model_extra["afm_profile"]["completion_tokens"] == 12


def test_queue_ms_counts_the_wait(server: ServerProcess) -> None:
    """A request queued behind four long ones reports the time it waited in queue_ms."""
    url = server.url
    hogs: list[tuple[str, threading.Thread]] = []
    opened = threading.Barrier(5, timeout=30)

    def hog(rid: str) -> None:
        long_body = {**body(max_tokens=4000), "stream_options": {"include_usage": False}}
        with httpx.Client(timeout=60) as c, c.stream(
            "POST", url + CHAT, json=long_body, headers={"X-Request-ID": rid}
        ) as r:
            assert r.status_code == 200
            opened.wait()
            for _ in r.iter_lines():
                pass

    for i in range(4):  # the shared server's max_concurrent_requests
        rid = f"hog-{i}-{uuid.uuid4().hex[:8]}"
        thread = threading.Thread(target=hog, args=(rid,), daemon=True)
        thread.start()
        hogs.append((rid, thread))
    try:
        opened.wait()
        result: dict[str, Any] = {}

        def queued() -> None:
            with httpx.Client(base_url=url, timeout=60) as c:
                result["events"], result["wall_ms"] = profiled_stream(c, "true", max_tokens=4)

        waiter = threading.Thread(target=queued, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").json()["queued_requests"] != 1:
            assert time.monotonic() < deadline, "the request never queued"
            time.sleep(0.02)
        seen_queued = time.monotonic()
        time.sleep(0.3)  # let it wait a measurable while (not an assertion)
        waited_ms = (time.monotonic() - seen_queued) * 1000
        r = httpx.post(f"{url}{CHAT}/{hogs[0][0]}/cancel")
        assert r.status_code == 200
        waiter.join(30)
        assert not waiter.is_alive()
        profile = result["events"][-2]["afm_profile"]
        assert profile["queue_ms"] >= waited_ms
        assert profile["queue_ms"] <= profile["ttft_ms"] <= profile["total_ms"]
        assert profile["total_ms"] <= result["wall_ms"]
    finally:
        for rid, _ in hogs:
            httpx.post(f"{url}{CHAT}/{rid}/cancel")
        for _, thread in hogs:
            thread.join(30)
    deadline = time.monotonic() + 5
    while True:
        health = httpx.get(url + "/health").json()
        if health["active_requests"] == 0 and health["queued_requests"] == 0:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.02)


def test_profile_event_is_valid_json_line(http: httpx.Client) -> None:
    """The event is one ``data:`` line of compact JSON, like every chunk."""
    r = http.post(CHAT, json=body(max_tokens=3), headers={"X-AFM-Profile": "extended"})
    blocks = [b for b in r.text.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]"
    profile_block = blocks[-2]
    assert profile_block.startswith('data: {"afm_profile_extended":')
    assert "\n" not in profile_block
    json.loads(profile_block[len("data: "):])
