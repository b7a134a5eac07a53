"""The official JavaScript SDKs, run by Node against afmd: OpenAI's ``openai``, Anthropic's
``@anthropic-ai/sdk`` and ``ollama`` (ollama-js), at the versions tests/agents/package.json
pins (installed once with the agents, helpers/agents.py), as an app built on them calls
them (tests/agents/js_sdks.mjs: every step in one Node process, against one server).

What the Python SDKs' tests cannot show: the JS SDKs' own code on afmd's answers. Their
stream helpers check what they accumulate (indexes, item ids, the final object against
the events) and throw where it does not add up; the OpenAI SDK asks embeddings as base64
and decodes them itself; the zod helpers transform schemas and parse the answer; the
runners call tools and send their results back. Where two APIs render the same prompt,
their greedy answers are compared, and the embeddings are compared with what the server
gives plain HTTP, so a step that answers but answers something else fails too.
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from helpers import agents
from helpers.servers import ServerProcess, start_server

PROMPT = "Name three colours."
MESSAGES = [{"role": "user", "content": PROMPT}]
#: The requests the script makes that must fail, and how: everything else is 2xx.
REFUSED = {("GET", "/v1/models/nope"): 404, ("POST", "/api/chat"): 404,
           ("POST", "/api/pull"): 400}
#: Where the script aborts a stream it is reading.
ABORTED = ("/api/chat", "/v1/messages")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of its own, so that its log holds the script's requests only."""
    reason = agents.missing_tools()
    if reason is not None:
        pytest.skip(reason)
    proc = start_server(tmp_path_factory.mktemp("js-sdks"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def run(server: ServerProcess) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The script's results by SDK and step, and the server's access log of its requests."""
    folder = agents.installed()
    before = len(server.events)
    done = subprocess.run(["node", str(folder / "js_sdks.mjs"), server.url], cwd=folder,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    # The streams the SDKs abort are logged once the server has seen the client leave.
    for path in ABORTED:
        server.wait_event("request", path=path, disconnected=True)
    return results, [e for e in list(server.events)[before:] if e.get("event") == "request"]


def ok(results: dict[str, Any], sdk: str, step: str) -> Any:
    """A step's result, which must not be an error the SDK threw."""
    result = results[sdk][step]
    assert not (isinstance(result, dict) and "error" in result), (sdk, step, result)
    return result


def failed(results: dict[str, Any], sdk: str, step: str) -> dict[str, Any]:
    result = results[sdk][step]
    assert isinstance(result, dict) and "error" in result, (sdk, step, result)
    error: dict[str, Any] = result["error"]
    return error


def test_every_request_was_answered(run: tuple[dict[str, Any], list[dict[str, Any]]]
                                    ) -> None:
    """2xx but for the refusals the script asks for; no stream ended in an error, and the
    two the SDKs abort are logged as the client's leaving."""
    _, requests = run
    assert len(requests) > 50
    wrong = [(e["method"], e["path"], e["status"]) for e in requests
             if not 200 <= e["status"] < 300
             and REFUSED.get((e["method"], e["path"])) != e["status"]]
    assert not wrong, wrong
    assert not [e for e in requests if e.get("stream_error")]
    left = sorted(e["path"] for e in requests if e.get("disconnected"))
    assert left == sorted(ABORTED)


def test_openai_chat(run: tuple[dict[str, Any], list[dict[str, Any]]],
                     http: httpx.Client) -> None:
    results, _ = run
    chat = ok(results, "openai", "chat")
    assert chat["object"] == "chat.completion" and chat["finish"] == "length"
    assert chat["usage"]["completion_tokens"] == 8 and chat["text"]
    headers = dict(chat["headers"])
    assert chat["requestID"] == headers["x-request-id"]
    # Sanic's empty alt-svc went out on every answer, which the SDK shows as it is.
    assert all(value for _, value in chat["headers"]), chat["headers"]
    want = http.post("/v1/chat/completions", json={
        "model": "demo", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}).json()
    assert chat["text"] == want["choices"][0]["message"]["content"]
    streamed = ok(results, "openai", "chat_stream")
    assert streamed["text"] == chat["text"] and streamed["finish"] == ["length"]
    assert streamed["ids"] == 1
    # include_usage: a last chunk with no choices and the whole usage.
    assert streamed["lastChoices"] == 0 and streamed["usage"]["completion_tokens"] == 8
    helper = ok(results, "openai", "chat_helper_stream")
    assert helper["deltas"] == helper["text"] == chat["text"]
    assert helper["usage"]["total_tokens"] == chat["usage"]["total_tokens"]
    logprobs = ok(results, "openai", "chat_logprobs")
    assert "".join(logprobs["tokens"]) == logprobs["text"]
    assert chat["text"].startswith(logprobs["text"])
    assert logprobs["tops"] == [2] * 4 and all(lp <= 0 for lp in logprobs["logprobs"])


def _city(arguments: str | dict[str, Any]) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert list(args) == ["city"], args
    city = args["city"]
    assert isinstance(city, str) and len(city) <= 8
    return city


def test_openai_tools_and_formats(run: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    results, _ = run
    tools = ok(results, "openai", "chat_tools")
    assert tools["finish"] == "tool_calls"
    (call,) = tools["calls"]
    assert call["type"] == "function" and call["name"] == "weather"
    assert call["id"].startswith("call_")
    _city(call["arguments"])
    schema = ok(results, "openai", "chat_json_schema")
    assert schema["finish"] == "stop" and json.loads(schema["text"])["n"] in range(10)
    parsed = ok(results, "openai", "chat_parse_zod")
    assert parsed["parsed"] == json.loads(parsed["text"]) and parsed["parsed"]["n"] in range(10)
    # runTools called the tool with the parsed arguments and kept its result for the
    # conversation's next turn (a named tool_choice ends the run after one call).
    ran = ok(results, "openai", "chat_run_tools")
    (args,) = ran["called"]
    _city(args)
    assert ran["roles"] == ["user", "assistant", "tool"]
    assert ran["tool"]["content"] == "sunny"


def test_openai_completions_and_embeddings(run: tuple[dict[str, Any], list[dict[str, Any]]],
                                           http: httpx.Client) -> None:
    results, _ = run
    completion = ok(results, "openai", "completion")
    assert completion["object"] == "text_completion"
    assert ok(results, "openai", "completion_stream")["text"] == completion["text"]
    want = http.post("/v1/completions", json={
        "model": "demo", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}).json()
    assert completion["text"] == want["choices"][0]["text"]
    embeddings = ok(results, "openai", "embeddings")
    floats = np.array(embeddings["floats"], dtype=np.float32)
    assert floats.shape == (2, 64)
    # The SDK's own base64 request, decoded by the SDK, is the float answer exactly.
    assert np.array_equal(np.array(embeddings["decoded"], dtype=np.float64),
                          floats.astype(np.float64))
    sent = np.stack([np.frombuffer(base64.b64decode(b), dtype="<f4")
                     for b in embeddings["base64"]])
    assert np.array_equal(sent, floats)
    plain = http.post("/v1/embeddings", json={"model": "demo-embedding",
                                              "input": ["sky", "grass"]}).json()
    assert np.array_equal(np.array([d["embedding"] for d in plain["data"]], dtype=np.float32),
                          floats)
    assert embeddings["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    ollama = np.array(ok(results, "ollama", "embed"), dtype=np.float32)
    assert np.array_equal(ollama, floats)


def test_openai_models(run: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    results, _ = run
    models = ok(results, "openai", "models")
    assert {"demo", "demo-embedding"} <= set(models["listed"])
    assert models["one"] == {"id": "demo", "object": "model"}
    missing = failed(results, "openai", "model_missing")
    assert missing["class"] == "NotFoundError" and missing["status"] == 404
    assert missing["body"]["code"] == "model_not_found"


def test_openai_responses(run: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    results, _ = run
    response = ok(results, "openai", "response")
    assert response["status"] == "incomplete"
    assert response["incomplete"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == 16
    # The same prompt as chat's, greedy: chat's 8 tokens begin Responses' 16.
    assert response["text"].startswith(ok(results, "openai", "chat")["text"])
    streamed = ok(results, "openai", "response_stream")
    assert streamed["sequence"] == list(range(len(streamed["types"])))
    assert streamed["types"][:2] == ["response.created", "response.in_progress"]
    assert streamed["types"][-1] == "response.incomplete" and streamed["status"] == "incomplete"
    assert streamed["deltas"] == streamed["text"] == response["text"]
    helper = ok(results, "openai", "response_helper_stream")
    assert helper["deltas"] == helper["text"] == response["text"]
    assert helper["status"] == "incomplete"
    counted = ok(results, "openai", "input_tokens")
    assert counted == {"object": "response.input_tokens",
                       "input_tokens": response["usage"]["input_tokens"]}


def test_openai_responses_state(run: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    results, _ = run
    tools = ok(results, "openai", "response_tools")
    assert tools["status"] == "completed" and tools["types"] == ["function_call"]
    assert tools["call"]["name"] == "weather" and tools["call"]["call_id"].startswith("call_")
    _city(tools["call"]["arguments"])
    assert tools["second"]["previous"] == tools["second"]["firstId"]
    assert tools["second"]["status"] in ("completed", "incomplete")
    previous = ok(results, "openai", "response_previous")
    assert previous["previous"] == previous["firstId"]
    # The stored turn is in the prompt, not in this response's own input items.
    assert previous["secondInput"] > previous["firstInput"]
    assert previous["items"] == [["message", "user"]]
    background = ok(results, "openai", "response_background")
    assert background["created"] == "queued" and background["background"] is True
    assert background["status"] == "incomplete" and background["id"]
    assert background["text"] == ok(results, "openai", "response")["text"]
    conversation = ok(results, "openai", "conversation")
    assert conversation["object"] == "conversation"
    assert conversation["metadata"] == {"topic": "js"}
    assert conversation["items"] == [["message", "user"], ["message", "user"],
                                     ["message", "assistant"]]
    assert conversation["lastItem"] == conversation["answerItem"]
    assert conversation["updated"] == {"topic": "sdk"} and conversation["deleted"] is True


def test_anthropic_messages(run: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    results, _ = run
    message = ok(results, "anthropic", "message")
    assert message["type"] == "message" and message["stop"] == "max_tokens"
    assert message["usage"]["output_tokens"] == 8
    assert message["requestID"].startswith("req_")
    # Chat's prompt and Anthropic's are one rendering: the same greedy answer.
    assert message["text"] == ok(results, "openai", "chat")["text"]
    usage = message["usage"]
    assert (usage["input_tokens"] + usage["cache_read_input_tokens"]
            + usage["cache_creation_input_tokens"]) == ok(results, "anthropic", "count_tokens")
    types = ok(results, "anthropic", "stream")["types"]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    helper = ok(results, "anthropic", "helper_stream")
    assert helper["deltas"] == helper["text"] == message["text"]
    assert helper["stop"] == "max_tokens" and helper["usage"] == message["usage"]


def test_anthropic_tools(run: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    results, _ = run
    tools = ok(results, "anthropic", "tools")
    assert tools["stop"] == "tool_use" and tools["answered"] == "message"
    (use,) = tools["uses"]
    assert use["name"] == "weather" and use["id"].startswith("toolu_")
    _city(use["input"])
    streamed = ok(results, "anthropic", "tools_stream")
    assert streamed["stop"] == "tool_use"
    assert streamed["snapshot"] == streamed["input"] and _city(streamed["input"])


def test_anthropic_parse_models_and_abort(run: tuple[dict[str, Any], list[dict[str, Any]]]
                                          ) -> None:
    results, _ = run
    assert ok(results, "anthropic", "parse_zod")["colour"] in ("red", "green", "blue")
    models = ok(results, "anthropic", "models")
    assert {"id": "demo", "type": "model", "display_name": "demo"} in models["listed"]
    assert models["one"] == {"id": "demo", "type": "model"}
    # Anthropic's envelope, which the SDK reads its type and request id from.
    missing = failed(results, "anthropic", "model_missing")
    assert missing["class"] == "NotFoundError" and missing["type"] == "not_found_error"
    assert missing["requestID"].startswith("req_")
    assert failed(results, "anthropic", "abort")["class"] == "APIUserAbortError"


def test_ollama(run: tuple[dict[str, Any], list[dict[str, Any]]], http: httpx.Client) -> None:
    results, _ = run
    assert ok(results, "ollama", "version")["version"]
    assert {"demo:latest", "demo-embedding:latest"} <= set(ok(results, "ollama", "list"))
    show = ok(results, "ollama", "show")
    assert show["context"] == 131072 and show["family"] == "qwen2"
    assert {"completion", "tools"} <= set(show["capabilities"])
    assert "demo:latest" in ok(results, "ollama", "ps")
    chat = ok(results, "ollama", "chat")
    assert chat["done"] is True and chat["reason"] == "length" and chat["eval"] == 8
    assert chat["text"] == ok(results, "openai", "chat")["text"]
    streamed = ok(results, "ollama", "chat_stream")
    assert streamed["text"] == chat["text"]
    assert streamed["done"][-1] is True and not any(streamed["done"][:-1])
    assert ok(results, "ollama", "generate")["text"] == ok(results, "openai", "completion")["text"]
    missing = failed(results, "ollama", "chat_missing")
    assert missing["class"] == "ResponseError" and missing["status"] == 404
    assert missing["message"] == "model 'nope' not found"
    # A name from Ollama's library is no Hugging Face repo: refused before any download,
    # streamed or not. (A repo the hub lacks fails after the stream's 200, as an
    # {"error"} line: test_ollama_api.py, against a stand-in hub, which a server forked
    # from the test zygote cannot be pointed at.)
    for step in ("pull_missing", "pull_missing_stream"):
        pulled = failed(results, "ollama", step)
        assert pulled["class"] == "ResponseError" and pulled["status"] == 400
        assert pulled["message"] == ("'llama3.2' is not a Hugging Face repo id (expected "
                                     "OWNER/NAME, e.g. mlx-community/Qwen2.5-0.5B-Instruct-4bit)")
    assert failed(results, "ollama", "abort")["name"] == "AbortError"
