"""The dashboard in a real browser (Debian's Chromium through Playwright), each panel
checked against the API's own answers: the model rows against ``/v1/models`` and
``/health``, the live count during a stream, the last requests against the access log,
the playground's text against the same request's stream, stop, unload and load, pull, the
key flow; and on every page, no console error and no request off the server's origin.

The hooks are the issue's ``data-testid``s, a contract outside checks rely on too.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from afmd import __version__
from afmd.ports import free_ports

from conftest import ServerProcess, parse_sse, start_server
from helpers.browser import Watched, launched, watched_page
from helpers.hub import FakeHub, safetensors_bytes
from helpers.pictures import encoded, noise

pytestmark = pytest.mark.slow  # a Chromium and servers of its own

KEY = "sk-browser-test"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launched() as running:
        yield running


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("dash"),
                          config='[models.aliases]\n"gpt-4o-mini" = "demo"\n')
    yield server
    server.stop()


@pytest.fixture()
def page(browser: Any, dash: ServerProcess) -> Iterator[Watched]:
    with watched_page(browser, dash.url) as watched:
        yield watched
        watched.check()


#: How long an ``expect`` waits for the page to show what it asserts.
EXPECT_TIMEOUT_MS = 15_000


def _expect() -> Any:
    """Playwright's ``expect``, waiting up to EXPECT_TIMEOUT_MS: its default of 5 s is
    less than a page polling every second may take to show a change on two cores that
    the whole suite shares with this browser and its server (a wait, not a bound the
    dashboard is held to)."""
    from playwright.sync_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    return expect


def _open(watched: Watched, url: str) -> Any:
    """The dashboard as a browser reaches it: ``/`` sends it on to ``/ui/``."""
    page = watched.page
    page.goto(url + "/")
    assert page.url == url + "/ui/"
    _expect()(page.get_by_test_id("model-row").first).to_be_visible()
    return page


def _row(page: Any, model_id: str) -> Any:
    return page.locator(f'[data-testid="model-row"][data-model-id="{model_id}"]')


def _health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=10).json()


def _until(condition: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition never held")


def _stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The API's own streamed answer to ``body``: its text, reasoning, calls and usage."""
    response = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in parse_sse(response.text):
        if chunk == "[DONE]" or "choices" not in chunk:
            continue
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            out["content"] += delta.get("content") or ""
            out["reasoning"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                entry = out["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
            out["finish"] = choice.get("finish_reason") or out["finish"]
    return out


def _settings(page: Any, *, system: str = "", temperature: str = "0", max_tokens: str,
              prompt: str) -> None:
    page.get_by_test_id("system").fill(system)
    page.get_by_test_id("temperature").fill(temperature)
    page.get_by_test_id("max-tokens").fill(max_tokens)
    page.get_by_test_id("prompt").fill(prompt)


# ---------------------------------------------------------------------------- panels


def test_model_rows_and_status_are_the_apis(page: Watched, dash: ServerProcess) -> None:
    expect = _expect()
    ui = _open(page, dash.url)
    listed = [m["id"] for m in httpx.get(dash.url + "/v1/models").json()["data"]
              if "parent" not in m]
    configured = ui.locator('[data-testid="model-row"]:not([data-source="downloaded"])')
    expect(configured).to_have_count(len(listed))
    assert configured.evaluate_all("rows => rows.map(r => r.dataset.modelId)") == listed
    for model_id, detail in _health(dash.url)["model_details"].items():
        state = detail["state"].split(":")[0]
        row = _row(ui, model_id)
        expect(row).to_have_attribute("data-state", state)
        expect(row).to_contain_text(model_id)
        expect(row).to_contain_text(state)
        expect(row.get_by_test_id("unload")).to_have_count(1 if state == "loaded" else 0)
    expect(_row(ui, "demo")).to_contain_text("alias gpt-4o-mini")
    # Apple's model on a machine without the framework: no load could change that, and
    # its row offered a Load that could only fail.
    expect(_row(ui, "system")).to_have_attribute("data-state", "unavailable")
    expect(_row(ui, "system").get_by_role("button")).to_have_count(0)
    memory = httpx.get(dash.url + "/ui/api/models").json()["memory"]
    expect(ui.get_by_test_id("memory")).to_contain_text(
        f"{memory['loaded']} of {memory['max_loaded']} models loaded")

    expect(ui.get_by_test_id("version")).to_have_text(__version__)
    expect(ui.get_by_test_id("listener")).to_have_text([dash.url])
    expect(ui.get_by_test_id("config-file")).to_have_text(dash.wait_event("listening")["config"])
    expect(ui.get_by_test_id("uptime")).to_have_text(re.compile(r"^\d+(s|m \d+s)$"))


def test_a_selection_survives_the_polls(page: Watched, dash: ServerProcess) -> None:
    """Text a user selects to copy (a model id, the config file, a listener, a request)
    stays selected while the page polls: a poll that rewrote it, even with the same text,
    dropped the selection within a second."""
    ui = _open(page, dash.url)
    assert httpx.get(dash.url + "/v1/models").status_code == 200
    _expect()(ui.get_by_test_id("request-row").first).to_be_visible()
    targets = {
        "model id": _row(ui, "demo").locator(".model-id"),
        "model kind": _row(ui, "demo").locator("td").nth(1),
        "config file": ui.get_by_test_id("config-file"),
        "listener": ui.get_by_test_id("listener").first,
        "memory": ui.locator("#memory-text"),
        "per model": ui.locator('[data-testid="model-activity"] .model-id').first,
        "request": ui.get_by_test_id("request-row").last.locator("td.path"),
    }
    for name, target in targets.items():
        target.select_text()
        chosen = ui.evaluate("getSelection().toString()")
        assert chosen, name
        # A new request's row arrives meanwhile, and two polls at least.
        assert httpx.get(dash.url + "/v1/models").status_code == 200
        ui.wait_for_timeout(2200)
        assert ui.evaluate("getSelection().toString()") == chosen, name


def test_live_count_last_requests_and_charts(page: Watched, dash: ServerProcess) -> None:
    expect = _expect()
    ui = _open(page, dash.url)
    active = ui.get_by_test_id("active-requests")
    expect(active).to_have_text(re.compile(r"^0 running"))
    request_id = f"live-{time.monotonic_ns()}"
    finished = threading.Event()

    def run() -> None:
        httpx.post(dash.url + "/v1/chat/completions", headers={"X-Request-ID": request_id},
                   json={"model": "demo", "temperature": 0, "max_tokens": 6000,
                         "messages": [{"role": "user", "content": "Count."}]}, timeout=120)
        finished.set()

    threading.Thread(target=run, daemon=True).start()
    _until(lambda: _health(dash.url)["active_requests"] == 1)
    polls = len([r for r in page.requests if "/ui/api/activity" in r.url])
    expect(active).to_have_text(re.compile(r"^1 running · 0 queued"))
    # It reads the counts every second: at least three times in three and a half (waited
    # for only until the third, as the stream decodes at full speed meanwhile).
    deadline = time.monotonic() + 3.5

    def read() -> int:
        return len([r for r in page.requests if "/ui/api/activity" in r.url]) - polls

    while read() < 3 and time.monotonic() < deadline:
        ui.wait_for_timeout(50)
    assert read() >= 3
    expect(ui.locator('[data-testid="model-activity"][data-model-id="demo"]')).to_contain_text(
        "1 running")
    # The tokens chart draws the stream's speed while it runs.
    expect(ui.locator("#chart-tokens polyline")).to_have_count(1)
    assert httpx.post(f"{dash.url}/v1/chat/completions/{request_id}/cancel").status_code == 200
    assert finished.wait(30)
    expect(active).to_have_text(re.compile(r"^0 running"))

    logged = dash.wait_event("request", request_id=request_id)
    row = ui.locator(f'[data-testid="request-row"][data-request-id="{request_id}"]')
    expect(row).to_contain_text("POST /v1/chat/completions")
    expect(row).to_contain_text(
        f"{logged['prompt_tokens']} → {logged['completion_tokens']}")
    expect(row).to_contain_text(f"{round(logged['ttft_ms'])} ms")
    cells = row.locator("td").all_text_contents()
    assert cells[2] == "demo" and cells[3] == "200", cells


def test_playground_streams_what_the_api_streams(page: Watched, dash: ServerProcess) -> None:
    expect = _expect()
    ui = _open(page, dash.url)
    system, prompt = "You are terse.", "Write a line about rivers."
    api = _stream(dash.url, {
        "model": "demo", "temperature": 0, "max_tokens": 40,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": prompt}]})
    _settings(ui, system=system, max_tokens="40", prompt=prompt)
    with ui.expect_request("**/v1/chat/completions") as sent:
        ui.get_by_test_id("send").click()
    body = json.loads(sent.value.post_data)
    assert body["messages"] == [{"role": "system", "content": system},
                                {"role": "user", "content": prompt}]
    assert (body["model"], body["temperature"], body["max_tokens"], body["stream"]) == (
        "demo", 0, 40, True)
    assert sent.value.headers["x-afm-profile"] == "true"
    expect(ui.get_by_test_id("finish-reason")).to_have_text(api["finish"])
    assert ui.get_by_test_id("output").text_content() == api["content"]
    # Reasoning apart from the answer, never mixed into it.
    assert ui.get_by_test_id("reasoning").text_content() == api["reasoning"]
    expect(ui.get_by_test_id("reasoning-box")).to_be_visible(visible=bool(api["reasoning"]))
    usage = api["usage"]
    expect(ui.get_by_test_id("usage")).to_contain_text(
        f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion")
    profile = ui.get_by_test_id("profile")
    expect(profile).to_contain_text("TTFT")
    expect(profile).to_contain_text("decode")
    assert float(profile.get_attribute("data-ttft-ms")) > 0
    expect(ui.get_by_test_id("stop")).to_be_disabled()
    expect(ui.get_by_test_id("send")).to_be_enabled()


def test_playground_sends_images_to_a_vision_model(page: Watched, dash: ServerProcess,
                                                   tmp_path: Path) -> None:
    """A vision model is offered in the playground, and the page had no way to give it a
    picture: images chosen go as OpenAI's image parts, inline, after the text."""
    expect = _expect()
    ui = _open(page, dash.url)
    picture = tmp_path / "noise.png"
    picture.write_bytes(encoded(noise(7, (32, 32)), "PNG"))
    prompt = "What is in this picture?"
    alone = _stream(dash.url, {"model": "demo-vision", "max_tokens": 2, "temperature": 0,
                               "stream_options": {"include_usage": True},
                               "messages": [{"role": "user", "content": prompt}]})
    ui.get_by_test_id("model-select").select_option("demo-vision")
    _settings(ui, max_tokens="2", prompt=prompt)
    ui.get_by_test_id("images").set_input_files(str(picture))
    with ui.expect_request("**/v1/chat/completions") as sent:
        ui.get_by_test_id("send").click()
    (message,) = json.loads(sent.value.post_data)["messages"]
    assert message["content"][0] == {"type": "text", "text": prompt}
    assert message["content"][1]["type"] == "image_url"
    assert message["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    expect(ui.get_by_test_id("finish-reason")).to_have_text("length")
    shown = ui.get_by_test_id("usage").text_content() or ""
    prompt_tokens = int(shown.split(" prompt")[0].split()[-1])
    assert prompt_tokens > alone["usage"]["prompt_tokens"], shown  # the picture's tokens
    assert not ui.get_by_test_id("error").text_content()


def test_playground_renders_tool_calls(page: Watched, dash: ServerProcess) -> None:
    expect = _expect()
    ui = _open(page, dash.url)
    prompt = "What is the weather in Paris?"
    # One call (a random model repeats parallel calls until max_tokens), after a thinking
    # block the grammar bounds.
    api = _stream(dash.url, {"model": "demo", "temperature": 0, "max_tokens": 1500,
                             "tools": [TOOL], "tool_choice": "required",
                             "parallel_tool_calls": False,
                             "messages": [{"role": "user", "content": prompt}]})
    assert api["finish"] == "tool_calls" and api["calls"]
    _settings(ui, max_tokens="1500", prompt=prompt)
    ui.locator("details.tools summary").click()
    ui.get_by_test_id("tools").fill(json.dumps([TOOL]))
    ui.get_by_test_id("tool-choice").select_option("required")
    ui.get_by_test_id("parallel-tool-calls").uncheck()
    with ui.expect_request("**/v1/chat/completions") as sent:
        ui.get_by_test_id("send").click()
    body = json.loads(sent.value.post_data)
    assert (body["tools"], body["tool_choice"], body["parallel_tool_calls"]) == (
        [TOOL], "required", False)
    expect(ui.get_by_test_id("finish-reason")).to_have_text("tool_calls")
    calls = ui.get_by_test_id("tool-call")
    expect(calls).to_have_count(len(api["calls"]))
    for index, call in sorted(api["calls"].items()):
        item = calls.nth(index)
        expect(item.locator(".name")).to_have_text(call["name"])
        shown = json.loads(item.locator("pre").text_content())
        assert shown == json.loads(call["arguments"])
    assert ui.get_by_test_id("output").text_content() == api["content"]
    assert ui.get_by_test_id("reasoning").text_content() == api["reasoning"]


def test_stop_cancels_the_request_on_the_server(page: Watched, dash: ServerProcess) -> None:
    expect = _expect()
    ui = _open(page, dash.url)
    _settings(ui, max_tokens="6000", prompt="Tell a long story.")
    ui.get_by_test_id("send").click()
    expect(ui.get_by_test_id("output")).not_to_be_empty()
    request_id = ui.get_by_test_id("request-id").text_content()
    assert _health(dash.url)["active_requests"] == 1
    ui.get_by_test_id("stop").click()
    expect(ui.get_by_test_id("finish-reason")).to_have_text("cancelled")
    logged = dash.wait_event("request", request_id=request_id)
    assert logged["finish_reason"] == "cancelled" and logged["status"] == 200
    assert 0 < logged["completion_tokens"] < 6000
    assert not logged.get("disconnected")  # the server ended it, not a dropped connection
    assert _health(dash.url)["active_requests"] == 0
    expect(ui.get_by_test_id("send")).to_be_enabled()


def test_escape_in_the_playground_stops_the_reply(page: Watched,
                                                  dash: ServerProcess) -> None:
    expect = _expect()
    ui = _open(page, dash.url)
    _settings(ui, max_tokens="6000", prompt="Tell a long story.")
    ui.get_by_test_id("send").click()
    expect(ui.get_by_test_id("output")).not_to_be_empty()
    ui.locator("#prompt").focus()
    ui.keyboard.press("Escape")
    expect(ui.get_by_test_id("finish-reason")).to_have_text("cancelled")
    assert _health(dash.url)["active_requests"] == 0


def test_unload_and_load_from_the_row(page: Watched, dash: ServerProcess) -> None:
    expect = _expect()
    ui = _open(page, dash.url)
    row = _row(ui, "demo")
    expect(row).to_have_attribute("data-state", "loaded")
    row.get_by_test_id("unload").click()
    expect(row).to_have_attribute("data-state", "available")
    assert _health(dash.url)["model_details"]["demo"]["state"] == "available"
    expect(row.get_by_test_id("unload")).to_have_count(0)
    row.get_by_test_id("load").click()
    expect(row).to_have_attribute("data-state", "loaded")
    assert _health(dash.url)["model_details"]["demo"]["state"] == "loaded"
    expect(row.get_by_test_id("unload")).to_have_count(1)


def test_row_actions_name_their_model_and_work_from_the_keyboard(
        page: Watched, dash: ServerProcess) -> None:
    """Each row's button says whose it is (a screen reader, or a keyboard user's Tab through
    a column of identical 'Load's, hears 'Load demo-32k'), and Enter on it acts."""
    expect = _expect()
    ui = _open(page, dash.url)
    unload = ui.get_by_role("button", name="Unload demo", exact=True)
    expect(unload).to_have_count(1)
    unload.focus()
    ui.keyboard.press("Enter")
    expect(_row(ui, "demo")).to_have_attribute("data-state", "available")
    load = ui.get_by_role("button", name="Load demo", exact=True)
    # A poll can show the row unloaded before the unload's own answer came back: the
    # button is there but disabled until it has, and a disabled button takes no focus.
    expect(load).to_be_enabled()
    load.focus()
    ui.keyboard.press("Enter")
    expect(_row(ui, "demo")).to_have_attribute("data-state", "loaded")
    assert _health(dash.url)["model_details"]["demo"]["state"] == "loaded"


def test_actions_refuse_another_origin(browser: Any, dash: ServerProcess) -> None:
    """A page of another origin (the same server under another name) cannot unload."""
    with watched_page(browser, dash.url) as watched:
        ui = _open(watched, dash.url)
        other = dash.url.replace("127.0.0.1", "localhost")
        outcome = ui.evaluate("""async (url) => {
            try {
                const r = await fetch(url + "/ui/api/unload", {method: "POST",
                    headers: {"Content-Type": "application/json"},
                    body: JSON.stringify({model: "demo"})});
                return "status " + r.status;
            } catch (err) { return "refused: " + err.message; }
        }""", other)
        assert outcome.startswith("refused"), outcome
        assert _health(dash.url)["model_details"]["demo"]["state"] == "loaded"
        assert all("/ui/api/unload" not in r.url or r.url.startswith(other)
                   for r in watched.requests)


# ---------------------------------------------------------------------------- the key


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("keyed"),
                          config=f'[server]\napi_key = "{KEY}"\n')
    yield server
    server.stop()


def test_the_key_flow(browser: Any, keyed: ServerProcess) -> None:
    expect = _expect()
    url = keyed.url
    with watched_page(browser, url) as watched:
        ui = watched.page
        ui.goto(url + "/")
        field = ui.get_by_test_id("api-key")
        expect(field).to_be_visible()
        expect(ui.locator("main")).to_be_hidden()
        expect(ui.get_by_test_id("model-row")).to_have_count(0)
        # Nothing was read without the key: no refused request, no console error.
        assert not [r.url for r in watched.requests if "/ui/api/" in r.url]

        field.fill("not-the-key")
        ui.get_by_test_id("api-key-submit").click()
        expect(ui.get_by_test_id("api-key-error")).to_contain_text("refused")
        assert ui.evaluate("sessionStorage.length") == 0  # a refused key is not kept
        # Each read the wrong key made is refused, and the console reports each 401 when
        # its answer arrives, maybe after the message shows: counted once all have.
        tried = [r for r in watched.requests if "/ui/api/" in r.url
                 and r.headers.get("authorization") == "Bearer not-the-key"]
        deadline = time.monotonic() + 10
        while len(watched.errors) < len(tried) and time.monotonic() < deadline:
            ui.wait_for_timeout(50)
        refused = len(watched.errors)
        assert refused == len(tried) and all("401" in e for e in watched.errors), \
            (watched.errors, [r.url for r in tried])

        field.fill(KEY)
        ui.get_by_test_id("api-key-submit").click()
        expect(_row(ui, "demo")).to_have_attribute("data-state", "loaded")
        assert ui.evaluate("sessionStorage.getItem('afmd.apiKey')") == KEY
        assert ui.evaluate("localStorage.length") == 0
        assert ui.context.cookies() == []
        reads = [r for r in watched.requests if "/ui/api/" in r.url]
        assert reads and reads[-1].headers["authorization"] == f"Bearer {KEY}"

        # The key's actions and the playground send it too.
        row = _row(ui, "demo")
        row.get_by_test_id("unload").click()
        expect(row).to_have_attribute("data-state", "available")
        row.get_by_test_id("load").click()
        expect(row).to_have_attribute("data-state", "loaded")
        _settings(ui, max_tokens="8", prompt="Hi")
        ui.get_by_test_id("send").click()
        expect(ui.get_by_test_id("finish-reason")).to_have_text("length")
        expect(ui.get_by_test_id("usage")).to_contain_text("8 completion")

        # A reload keeps it (the tab's session); nothing else ever held it.
        ui.reload()
        expect(_row(ui, "demo")).to_be_visible()
        expect(field).to_be_hidden()
        expect(ui.locator("main")).to_be_visible()
        watched.check(allowed_errors=("401",))
        assert len(watched.errors) == refused
    with watched_page(browser, url) as fresh:  # another tab's session: asked again
        fresh.page.goto(url + "/ui/")
        expect(fresh.page.get_by_test_id("api-key")).to_be_visible()
        fresh.check()


def test_a_key_that_cannot_be_sent_is_refused_at_once(browser: Any, keyed: ServerProcess) -> None:
    """A key pasted with an invisible character (a zero-width space) cannot go in a header:
    the page says so, keeps nothing, and asks again, where it said 'checking…' for ever,
    blamed the server ('cannot reach'), and after a reload showed neither panel."""
    expect = _expect()
    with watched_page(browser, keyed.url) as watched:
        ui = watched.page
        ui.goto(keyed.url + "/ui/")
        field = ui.get_by_test_id("api-key")
        field.fill(KEY + "\u200b")
        ui.get_by_test_id("api-key-submit").click()
        expect(ui.get_by_test_id("api-key-error")).to_contain_text("U+200B")
        assert ui.evaluate("sessionStorage.length") == 0
        expect(field).to_be_visible()
        expect(field).to_be_focused()
        assert not [r.url for r in watched.requests if "/ui/api/" in r.url]
        # One kept from before (another version of the page) is dropped the same way.
        ui.evaluate("k => sessionStorage.setItem('afmd.apiKey', k)", KEY + "\u200b")
        ui.reload()
        expect(field).to_be_visible()
        expect(ui.get_by_test_id("api-key-error")).to_contain_text("U+200B")
        assert ui.evaluate("sessionStorage.length") == 0
        field.fill(KEY)
        ui.get_by_test_id("api-key-submit").click()
        expect(_row(ui, "demo")).to_have_attribute("data-state", "loaded")
        watched.check()


# ---------------------------------------------------------------------------- pull


def _hub_server(tmp_path: Path, hub: FakeHub) -> ServerProcess:
    """A server whose pulls go to the hub stand-in, into a cache of the test's own."""
    return start_server(tmp_path, env={"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
                                       "HF_HUB_DISABLE_TELEMETRY": "1"})


def test_pull_with_its_progress(browser: Any, tmp_path: Path) -> None:
    expect = _expect()
    files = {"config.json": json.dumps({"model_type": "qwen2"}).encode(),
             "model.safetensors": safetensors_bytes({"w": ("F32", [512, 64])})}
    with FakeHub() as hub:
        hub.add_repo("test-org/tiny", files)
        server = _hub_server(tmp_path, hub)
        try:
            with watched_page(browser, server.url) as watched:
                ui = _open(watched, server.url)
                ui.get_by_test_id("pull-repo").fill("test-org/tiny")
                ui.get_by_test_id("pull").click()
                pulled = ui.locator('[data-testid="pull-row"][data-repo="test-org/tiny"]')
                expect(pulled).to_have_attribute("data-state", "done", timeout=60_000)
                assert pulled.get_by_test_id("pull-progress").evaluate("p => p.value") == 1
                # Its bar is named with its repo for a screen reader.
                expect(ui.get_by_role("progressbar", name="pull test-org/tiny")).to_have_count(1)
                expect(pulled).to_contain_text("2 files")
                row = _row(ui, "test-org/tiny")
                expect(row).to_have_attribute("data-source", "downloaded")
                expect(row).to_contain_text("not configured")
                expect(row.get_by_test_id("load")).to_have_count(0)
                watched.check()
        finally:
            server.stop()


def test_a_repo_typed_while_a_pull_starts_is_kept(browser: Any, tmp_path: Path) -> None:
    """A started pull cleared the field when the server answered: a repo typed meanwhile
    (the next one to pull) was wiped, and a click on Pull then pulled nothing."""
    expect = _expect()
    with FakeHub() as hub:
        server = _hub_server(tmp_path, hub)
        try:
            with watched_page(browser, server.url) as watched:
                ui = _open(watched, server.url)
                held: list[Any] = []

                def hold(route: Any) -> None:
                    held.append(route)

                ui.route("**/ui/api/pull", hold)
                field = ui.get_by_test_id("pull-repo")
                field.fill("test-org/missing")
                ui.get_by_test_id("pull").click()
                for _ in range(200):
                    if held:
                        break
                    ui.wait_for_timeout(50)
                assert held, "the pull was never sent"
                field.fill("test-org/next")
                held[0].continue_()
                ui.unroute("**/ui/api/pull")
                expect(ui.locator('[data-testid="pull-row"][data-repo="test-org/missing"]')
                       ).to_have_count(1, timeout=30_000)
                expect(field).to_have_value("test-org/next")
                watched.check()
        finally:
            server.stop()


def test_a_selection_in_the_pulls_list_survives_its_polls(browser: Any, tmp_path: Path) -> None:
    """The list was rebuilt at every poll while a pull progressed: text the user had
    selected in it (a failed pull's message, to copy) was dropped a second later."""
    expect = _expect()
    files = {"config.json": json.dumps({"model_type": "qwen2"}).encode(),
             "model.safetensors": safetensors_bytes({"w": ("F32", [512, 64])})}
    with FakeHub() as hub:
        hub.add_repo("test-org/slow", files)
        hub.throttle("test-org/slow", "model.safetensors", 16 * 1024)  # about 8 s
        server = _hub_server(tmp_path, hub)
        try:
            with watched_page(browser, server.url) as watched:
                ui = _open(watched, server.url)
                for repo in ("test-org/missing", "test-org/slow"):
                    ui.get_by_test_id("pull-repo").fill(repo)
                    ui.get_by_test_id("pull").click()
                failed = ui.locator('[data-testid="pull-row"][data-repo="test-org/missing"]')
                expect(failed).to_have_attribute("data-state", "failed", timeout=30_000)
                slow = ui.locator('[data-testid="pull-row"][data-repo="test-org/slow"]')
                expect(slow).to_contain_text(" of ", timeout=30_000)
                selected = failed.locator("span").evaluate("""span => {
                    const range = document.createRange();
                    range.selectNodeContents(span);
                    getSelection().removeAllRanges();
                    getSelection().addRange(range);
                    return getSelection().toString();
                }""")
                assert "was not found" in selected, selected
                progress = slow.locator("span").inner_text()
                expect(slow.locator("span")).not_to_have_text(progress, timeout=10_000)
                assert ui.evaluate("getSelection().toString()") == selected
                watched.check()
        finally:
            server.stop()


# ---------------------------------------------------------------------------- a server that
# stops answering, or is another one


def test_the_page_follows_a_restarted_server(browser: Any, tmp_path: Path) -> None:
    """A server started again on the same port is another server: its last requests and
    its uptime are shown, not held back behind the first one's count."""
    expect = _expect()
    port = free_ports()
    first = start_server(tmp_path, port=False, args=["--port", str(port)])
    url = first.url
    second = None
    try:
        with watched_page(browser, url) as watched:
            ui = _open(watched, url)
            for _ in range(25):  # more lines in the first one's ring than the second's
                assert httpx.get(url + "/v1/models").status_code == 200
            expect(ui.get_by_test_id("request-row").first).to_contain_text("GET /v1/models")
            # Older than the second one will be when its uptime is read.
            started = httpx.get(url + "/ui/api/status").json()["started_at"]
            time.sleep(max(0.0, started + 8 - time.time()))
            first.stop()
            expect(ui.get_by_test_id("connection")).to_contain_text("cannot reach")
            second = start_server(tmp_path, port=False, args=["--port", str(port)])
            request_id = f"again-{time.monotonic_ns()}"
            httpx.post(url + "/v1/chat/completions", headers={"X-Request-ID": request_id},
                       json={"model": "demo", "max_tokens": 3,
                             "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
            row = ui.locator(f'[data-testid="request-row"][data-request-id="{request_id}"]')
            expect(row).to_contain_text("POST /v1/chat/completions")
            # The first server's requests are not mixed into the second one's.
            expect(ui.get_by_test_id("request-row").filter(
                has_text="GET /v1/models")).to_have_count(0)
            # The second one's uptime, read soon (not the first one's, still counting).
            started = httpx.get(url + "/ui/api/status").json()["started_at"]
            _until(lambda: _uptime_s(ui.get_by_test_id("uptime").text_content())
                   <= time.time() - started + 1.5, timeout=3)
            watched.check(allowed_errors=("ERR_CONNECTION_REFUSED",))
    finally:
        first.stop()
        if second is not None:
            second.stop()


def _uptime_s(text: str | None) -> int:
    found = re.fullmatch(r"(?:(\d+)m )?(\d+)s", text or "")
    assert found, text
    return int(found[1] or 0) * 60 + int(found[2])


def test_a_hung_server_is_not_sent_more_polls(page: Watched, dash: ServerProcess) -> None:
    """A server that takes the connection but does not answer (stopped, swapping) gets one
    poll at a time, not a second's worth more each second, and the page says it waits."""
    expect = _expect()
    ui = _open(page, dash.url)
    expect(ui.get_by_test_id("connection")).to_contain_text("updated")
    ui.wait_for_timeout(1500)  # a poll answered, none in flight
    dash.proc.send_signal(signal.SIGSTOP)
    try:
        sent = len(page.requests)
        expect(ui.get_by_test_id("connection")).to_contain_text("not answered")
        uptime = ui.get_by_test_id("uptime").text_content()
        ui.wait_for_timeout(3000)
        reads = [r.url for r in page.requests[sent:] if "/ui/api/" in r.url]
        assert len(reads) <= 3, reads  # one poll: its status, models and activity at most
        # The uptime is the last the server told, not counted on as if it were still up.
        assert ui.get_by_test_id("uptime").text_content() == uptime
    finally:
        dash.proc.send_signal(signal.SIGCONT)
    expect(ui.get_by_test_id("connection")).to_contain_text("updated")
    expect(ui.locator("main")).not_to_have_class(re.compile("stale"))


def test_a_reply_cut_off_by_the_server_going_away_says_so(browser: Any,
                                                         tmp_path: Path) -> None:
    """The server dies mid-reply: the playground says the connection was lost mid-reply
    (not only the browser's bare 'network error'), and what came stays shown."""
    expect = _expect()
    server = start_server(tmp_path)
    try:
        with watched_page(browser, server.url) as watched:
            ui = _open(watched, server.url)
            _settings(ui, max_tokens="20000", prompt="Tell a long story.")
            ui.get_by_test_id("send").click()
            expect(ui.get_by_test_id("output")).not_to_be_empty()
            server.stop(signal.SIGKILL)
            expect(ui.get_by_test_id("error")).to_contain_text(
                "connection to the server was lost")
            assert ui.get_by_test_id("output").text_content()
            expect(ui.get_by_test_id("send")).to_be_enabled()
            expect(ui.get_by_test_id("stop")).to_be_disabled()
            # Sent again while it is gone: the page says it cannot reach it.
            ui.get_by_test_id("send").click()
            expect(ui.get_by_test_id("error")).to_contain_text("cannot reach the server")
            watched.check(allowed_errors=("ERR_CONNECTION_REFUSED", "ERR_INCOMPLETE_CHUNKED"))
    finally:
        server.stop()


# ---------------------------------------------------------------------------- many models,
# a narrow window, the keyboard

LONG_ID = "mlx-community-" + "Qwen2.5-Coder-32B-Instruct-4bit-" * 4 + "end"
MISSING = "/models/" + "a-folder-whose-name-has-no-place-to-break-" * 4 + "x"


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Many models, one of them with a very long id, one whose folder is missing."""
    models = "".join(f'[[models.model]]\nid = "extra-{i:02d}"\npath = "afmd:demo"\n'
                     for i in range(30))
    models += f'[[models.model]]\nid = "{LONG_ID}"\npath = "afmd:demo"\n'
    models += f'[[models.model]]\nid = "missing"\npath = "{MISSING}"\nkind = "chat"\n'
    server = start_server(tmp_path_factory.mktemp("crowded"),
                          config=f'[models]\ndefault = "demo"\n{models}')
    yield server
    server.stop()


def _sideways(ui: Any) -> int:
    """How far the page scrolls sideways: a narrow window fits everything in its width."""
    return int(ui.evaluate("document.documentElement.scrollWidth - window.innerWidth"))


def test_a_narrow_window_does_not_scroll_sideways(browser: Any, crowded: ServerProcess) -> None:
    expect = _expect()
    with watched_page(browser, crowded.url) as watched:
        ui = _open(watched, crowded.url)
        expect(ui.locator('[data-testid="model-row"]:not([data-source="downloaded"])')
               ).to_have_count(len(_health(crowded.url)["model_details"]))
        ui.set_viewport_size({"width": 375, "height": 800})
        expect(_row(ui, LONG_ID)).to_be_visible()
        assert _sideways(ui) <= 0
        # A long error (a missing folder's path) wraps too.
        _row(ui, "missing").get_by_test_id("load").click()
        expect(ui.get_by_test_id("model-error")).to_contain_text("does not exist")
        expect(_row(ui, "missing")).to_have_attribute("data-state", "unavailable")
        assert _sideways(ui) <= 0
        # Every model's row and actions stay reachable: the table scrolls in its panel.
        _row(ui, LONG_ID).get_by_test_id("load").click()
        expect(_row(ui, LONG_ID)).to_have_attribute("data-state", "loaded")
        assert _sideways(ui) <= 0
        watched.check(allowed_errors=("500",))


def test_charts_with_nothing_to_show_claim_no_scale(browser: Any,
                                                   crowded: ServerProcess) -> None:
    """A chart with no point (no request has ended: no TTFT yet) or only zeros shows no
    made-up maximum."""
    expect = _expect()
    with watched_page(browser, crowded.url) as watched:
        ui = _open(watched, crowded.url)
        expect(ui.locator("#chart-queue polyline").first).to_be_attached()
        assert not re.search(r"\d", ui.locator("#chart-ttft-max").text_content() or "")
        assert ui.locator("#chart-queue-max").text_content() == "max 0"
        watched.check()


def test_ctrl_enter_checks_the_form_as_send_does(page: Watched, dash: ServerProcess) -> None:
    """Ctrl+Enter is the Send button: an empty prompt or a max tokens below 1 is refused
    by the form, not sent."""
    ui = _open(page, dash.url)
    _settings(ui, max_tokens="8", prompt="")
    ui.get_by_test_id("prompt").press("Control+Enter")
    _settings(ui, max_tokens="0", prompt="Hi")
    ui.get_by_test_id("prompt").press("Control+Enter")
    ui.wait_for_timeout(500)
    assert not [r for r in page.requests if "/v1/chat/completions" in r.url]
    _settings(ui, max_tokens="4", prompt="Hi")
    with ui.expect_request("**/v1/chat/completions") as sent:
        ui.get_by_test_id("prompt").press("Control+Enter")
    assert json.loads(sent.value.post_data)["max_tokens"] == 4
    _expect()(ui.get_by_test_id("finish-reason")).to_have_text("length")


def test_a_long_model_id_leaves_its_live_counts_on_one_line(browser: Any,
                                                           crowded: ServerProcess) -> None:
    """In the Live panel a loaded model with a very long id kept its counts in a sliver
    beside it, one word a line ('0 / running / · 0 / queued'), touching the id: the id
    wraps, the counts stay one line apart from it, in a wide and a phone-wide window."""
    expect = _expect()
    loaded = httpx.post(crowded.url + "/ui/api/load", json={"model": LONG_ID}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    with watched_page(browser, crowded.url) as watched:
        ui = _open(watched, crowded.url)
        item = ui.locator(f'[data-testid="model-activity"][data-model-id="{LONG_ID}"]')
        expect(item).to_be_visible()
        for width in (1400, 375):
            ui.set_viewport_size({"width": width, "height": 800})
            boxes = item.evaluate("""li => {
                const [id, counts] = li.children;
                const text = document.createRange();
                text.selectNodeContents(counts);
                const line = [...text.getClientRects()];
                return {lines: new Set(line.map((r) => Math.round(r.top))).size,
                        gap: Math.min(...line.map((r) => r.left))
                             - Math.max(...[...id.getClientRects()].map((r) => r.right))};
            }""")
            assert boxes["lines"] == 1 and boxes["gap"] >= 8, (width, boxes)
            assert _sideways(ui) <= 0
        watched.check()


def test_a_poll_answered_with_an_error_says_what_the_server_said(page: Watched,
                                                                dash: ServerProcess) -> None:
    """A server that answers the page's reads with an error (503 while it shuts down, a
    proxy's 502) was reported as one the page 'cannot reach': the page says what it
    answered, and recovers when it answers again."""
    expect = _expect()
    ui = _open(page, dash.url)
    refusal = json.dumps({"error": {"message": "the server is shutting down",
                                    "type": "server_error", "code": "shutting_down"}})
    ui.route("**/ui/api/models", lambda route: route.fulfill(
        status=503, content_type="application/json", body=refusal))
    connection = ui.get_by_test_id("connection")
    expect(connection).to_contain_text("answered 503: the server is shutting down")
    assert "cannot reach" not in (connection.text_content() or "")
    expect(ui.locator("main")).to_have_class(re.compile("stale"))
    ui.route("**/ui/api/models", lambda route: route.fulfill(
        status=502, content_type="text/html", body="<html>Bad gateway</html>"))
    expect(connection).to_have_text("the server answered 502")
    ui.unroute("**/ui/api/models")
    expect(connection).to_contain_text("updated")
    page.check(allowed_errors=("503", "502"))
    page.errors.clear()


#: Counts, from the page itself, every change of text inside a live region (a screen reader
#: reads each one out).
LIVE_CHANGES = """() => {
    window.liveChanges = [];
    const live = "[role=status], [role=alert], [role=log], [aria-live]:not([aria-live=off])";
    new MutationObserver((records) => {
        for (const r of records) {
            const node = r.target.nodeType === 1 ? r.target : r.target.parentElement;
            const region = node && node.closest(live);
            if (region && region.getAttribute("aria-busy") !== "true") {
                window.liveChanges.push(region.id + ": " + region.textContent);
            }
        }
    }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def test_a_screen_reader_hears_changes_not_every_poll(page: Watched,
                                                     dash: ServerProcess) -> None:
    """The connection line ('updated 12:00:01', rewritten each second) was a live region: a
    screen reader read the time out every second. It announces the connection's changes
    only, and a streaming reply is marked busy until it is complete."""
    expect = _expect()
    ui = _open(page, dash.url)
    connection = ui.get_by_test_id("connection")
    expect(connection).to_contain_text("updated")
    ui.evaluate(LIVE_CHANGES)
    ui.wait_for_timeout(3500)  # three polls or more, each rewriting the time
    assert ui.evaluate("window.liveChanges") == []
    # The connection lost, and back: each said once.
    ui.route("**/ui/api/models", lambda route: route.abort())
    news = ui.get_by_test_id("connection-news")
    expect(news).to_contain_text("cannot reach the server")
    ui.unroute("**/ui/api/models")
    expect(news).to_have_text("The server answers again.")
    ui.wait_for_timeout(2500)
    changes = ui.evaluate("window.liveChanges")
    assert len(changes) == 2 and all(c.startswith("connection-news") for c in changes), changes
    # A reply is busy while it streams, and complete after.
    output = ui.get_by_test_id("output")
    expect(output).to_have_attribute("aria-busy", "false")
    _settings(ui, max_tokens="6000", prompt="Tell a long story.")
    ui.get_by_test_id("send").click()
    expect(output).not_to_be_empty()
    expect(output).to_have_attribute("aria-busy", "true")
    ui.get_by_test_id("stop").click()
    expect(ui.get_by_test_id("finish-reason")).to_have_text("cancelled")
    expect(output).to_have_attribute("aria-busy", "false")
    page.check(allowed_errors=("ERR_FAILED",))
    page.errors.clear()


def test_bars_and_charts_have_names(page: Watched, dash: ServerProcess) -> None:
    """The memory bar and the three charts were a bare 'progressbar' and three bare 'img's
    to a screen reader: each says what it shows."""
    expect = _expect()
    ui = _open(page, dash.url)
    expect(ui.locator("#chart-queue polyline").first).to_be_attached()
    tree = ui.locator("body").aria_snapshot()
    nameless = [line for line in tree.splitlines()
                if re.fullmatch(r"\s*- (progressbar|img)( \[[^\]]*\])?:?", line)]
    assert not nameless, tree
    memory = ui.get_by_role("progressbar", name="memory budget in use")
    expect(memory).to_have_count(1)
    assert "budget" in (memory.evaluate("p => document.getElementById("
                                        "p.getAttribute('aria-describedby')).textContent") or "")
    for name in ("tokens per second", "time to first token", "queued and running requests"):
        expect(ui.get_by_role("img", name=re.compile(name))).to_have_count(1)


def test_the_focus_stays_where_the_keyboard_acted(page: Watched, dash: ServerProcess) -> None:
    """Enter on a row's Unload, on Send or on Stop disabled or replaced the focused button,
    and the focus fell to the top of the page: a keyboard or screen reader user lost their
    place. The focus stays: on the button taking the row's (Unload → Load), on Send and on
    Stop, which do nothing while there is nothing for them to do (Enter twice neither stops
    a reply just sent nor sends one just stopped)."""
    expect = _expect()
    ui = _open(page, dash.url)
    unload = ui.get_by_role("button", name="Unload demo", exact=True)
    unload.focus()
    ui.keyboard.press("Enter")
    expect(_row(ui, "demo")).to_have_attribute("data-state", "available")
    load = ui.get_by_role("button", name="Load demo", exact=True)
    expect(load).to_be_focused()
    expect(load).to_be_enabled()
    ui.keyboard.press("Enter")
    expect(_row(ui, "demo")).to_have_attribute("data-state", "loaded")
    unload = ui.get_by_role("button", name="Unload demo", exact=True)
    expect(unload).to_be_focused()
    expect(unload).to_be_enabled()
    assert _health(dash.url)["model_details"]["demo"]["state"] == "loaded"

    _settings(ui, max_tokens="6000", prompt="Tell a long story.")
    send, stop = ui.get_by_test_id("send"), ui.get_by_test_id("stop")
    send.focus()
    with ui.expect_request("**/v1/chat/completions"):
        ui.keyboard.press("Enter")
    ui.keyboard.press("Enter")  # again: the reply goes on
    expect(send).to_be_focused()
    expect(send).to_be_disabled()
    expect(ui.get_by_test_id("output")).not_to_be_empty()
    ui.keyboard.press("Tab")
    expect(stop).to_be_focused()
    ui.keyboard.press("Enter")
    ui.keyboard.press("Enter")  # again: nothing more
    expect(ui.get_by_test_id("finish-reason")).to_have_text("cancelled")
    expect(stop).to_be_focused()
    expect(stop).to_be_disabled()
    ui.wait_for_timeout(500)
    sent = [r for r in page.requests if r.url.endswith("/v1/chat/completions")]
    assert len(sent) == 1, [r.url for r in sent]
    assert not ui.get_by_test_id("error").text_content()
    ui.keyboard.press("Shift+Tab")
    expect(send).to_be_focused()
    expect(send).to_be_enabled()


def test_a_key_refused_by_an_action_or_a_send_is_forgotten(browser: Any,
                                                           keyed: ServerProcess) -> None:
    """A key the server stops taking (restarted with another) met first by Unload or Send,
    not by a poll, showed the key panel with the server's bare words and kept the refused
    key, to be tried again on a reload: it is forgotten and said to be refused, as a poll
    does."""
    expect = _expect()
    with watched_page(browser, keyed.url) as watched:
        ui = watched.page
        ui.goto(keyed.url + "/ui/")
        field = ui.get_by_test_id("api-key")
        for act in ("unload", "send"):
            field.fill(KEY)
            ui.get_by_test_id("api-key-submit").click()
            expect(_row(ui, "demo")).to_have_attribute("data-state", "loaded")
            # The polls fail (the page does not learn of the new key from them) and the
            # server is given a key it does not take.
            ui.route("**/ui/api/{status,models,activity}*", lambda route: route.abort())
            ui.evaluate("sessionStorage.setItem('afmd.apiKey', 'sk-not-any-more')")
            if act == "unload":
                _row(ui, "demo").get_by_test_id("unload").click()
            else:
                _settings(ui, max_tokens="4", prompt="Hi")
                ui.get_by_test_id("send").click()
            expect(field).to_be_visible()
            expect(ui.get_by_test_id("api-key-error")).to_contain_text("refused this key")
            assert ui.evaluate("sessionStorage.length") == 0, act
            # The action or the send met the refusal, not a poll.
            polled = [r.url for r in watched.requests
                      if re.search(r"/ui/api/(status|models|activity)", r.url)
                      and r.headers.get("authorization") == "Bearer sk-not-any-more"
                      and r.response() is not None]
            assert not polled, polled
            ui.unroute("**/ui/api/{status,models,activity}*")
        assert _health(keyed.url)["model_details"]["demo"]["state"] == "loaded"
        watched.check(allowed_errors=("401", "ERR_FAILED"))


def test_stop_against_a_hung_server_says_the_reply_was_dropped(page: Watched,
                                                              dash: ServerProcess) -> None:
    """Stop on a server that no longer answers (stopped, swapping): after a few seconds the
    page drops the connection, and the reply ended without a word, no finish reason and no
    error, as if it were complete. It says what happened."""
    expect = _expect()
    ui = _open(page, dash.url)
    _settings(ui, max_tokens="20000", prompt="Tell a long story.")
    ui.get_by_test_id("send").click()
    expect(ui.get_by_test_id("output")).not_to_be_empty()
    dash.proc.send_signal(signal.SIGSTOP)
    # The cancel Stop sent waits with the server; woken, it may find the run already
    # ended by the dropped connection: a 404 the page reads, which the browser logs.
    page.expected_errors.append("status of 404")
    try:
        ui.get_by_test_id("stop").click()
        expect(ui.get_by_test_id("send")).to_be_enabled()
        expect(ui.get_by_test_id("error")).to_contain_text("did not end the reply")
        assert not ui.get_by_test_id("finish-reason").text_content()
    finally:
        dash.proc.send_signal(signal.SIGCONT)
    expect(ui.get_by_test_id("connection")).to_contain_text("updated")
    _until(lambda: _health(dash.url)["active_requests"] == 0)


def test_table_headers_and_the_request_log_are_named(page: Watched,
                                                    dash: ServerProcess) -> None:
    """The models table's last column (the Load and Unload buttons) had an empty header, read
    out as nothing, and the last requests, a box that scrolls, could only be scrolled with a
    mouse where the browser does not make such a box focusable itself."""
    expect = _expect()
    ui = _open(page, dash.url)
    tree = ui.locator("main").aria_snapshot()
    nameless = [line for line in tree.splitlines()
                if re.fullmatch(r"\s*- columnheader:?", line)]
    assert not nameless, tree
    expect(ui.get_by_role("columnheader", name="actions")).to_have_count(1)
    log = ui.get_by_role("region", name="Last requests").locator(".scroll")
    assert log.get_attribute("tabindex") == "0"
    log.focus()
    expect(log).to_be_focused()


#: Holds back the answers to requests sent with ``key`` (a slow link, a busy server).
SLOW_KEY = """(key) => {
    const fetchNow = window.fetch;
    window.fetch = async (url, init) => {
        const response = await fetchNow(url, init);
        const sent = init && init.headers && init.headers.Authorization;
        if (sent === "Bearer " + key) await new Promise((done) => setTimeout(done, 1500));
        return response;
    };
}"""


def test_a_key_typed_again_is_not_forgotten_for_the_first_ones_refusal(
        browser: Any, keyed: ServerProcess) -> None:
    """A mistyped key, corrected and sent again before the server's refusal of the first
    came back: that refusal forgot the corrected key and asked for it once more."""
    expect = _expect()
    with watched_page(browser, keyed.url) as watched:
        ui = watched.page
        ui.goto(keyed.url + "/ui/")
        field = ui.get_by_test_id("api-key")
        expect(field).to_be_visible()
        ui.evaluate(SLOW_KEY, "sk-typo")
        field.fill("sk-typo")
        with ui.expect_request(lambda r: "/ui/api/" in r.url):
            ui.get_by_test_id("api-key-submit").click()
        field.fill(KEY)
        ui.get_by_test_id("api-key-submit").click()
        expect(_row(ui, "demo")).to_have_attribute("data-state", "loaded")
        refused = [r for r in watched.requests if "/ui/api/" in r.url
                   and r.headers.get("authorization") == "Bearer sk-typo"]
        assert refused
        _until(lambda: all(r.response() is not None for r in refused))
        ui.wait_for_timeout(2000)  # the typo's refusals have all come back
        expect(ui.locator("main")).to_be_visible()
        expect(field).to_be_hidden()
        assert ui.evaluate("sessionStorage.getItem('afmd.apiKey')") == KEY
        watched.check(allowed_errors=("401",))


def test_the_focus_moves_on_when_the_key_is_taken(browser: Any, keyed: ServerProcess) -> None:
    """The key typed and Enter pressed: the key panel went away with the focus in its field,
    which fell to the top of the page. It moves to the first panel's heading, the next Tab
    to that panel's first button."""
    expect = _expect()
    with watched_page(browser, keyed.url) as watched:
        ui = watched.page
        ui.goto(keyed.url + "/ui/")
        field = ui.get_by_test_id("api-key")
        field.fill(KEY)
        field.press("Enter")
        expect(_row(ui, "demo")).to_have_attribute("data-state", "loaded")
        expect(ui.get_by_role("heading", name="Models")).to_be_focused()
        ui.keyboard.press("Tab")
        assert ui.evaluate("document.activeElement.closest('[data-testid=model-row]') !== null")
        watched.check()


def test_keep_alive_and_memory_stay_on_one_line(page: Watched, dash: ServerProcess) -> None:
    """A loaded model's keep-alive ('4m 49s') broke over two lines in a wide window."""
    expect = _expect()
    ui = _open(page, dash.url)
    row = _row(ui, "demo")
    expect(row.locator(".keep-cell")).to_have_text(re.compile(r"\d+m \d+s|\d+s"))
    for width in (1400, 375):
        ui.set_viewport_size({"width": width, "height": 900})
        for cell in (".keep-cell", ".memory-cell"):
            lines = row.locator(cell).evaluate("""td => {
                const text = document.createRange();
                text.selectNodeContents(td);
                return new Set([...text.getClientRects()].map((r) => Math.round(r.top))).size;
            }""")
            assert lines == 1, (width, cell, row.locator(cell).text_content())


def test_an_action_that_cannot_reach_the_server_says_so(page: Watched,
                                                       dash: ServerProcess) -> None:
    """Unload or pull while the server cannot be reached said only the browser's
    'Failed to fetch'."""
    expect = _expect()
    ui = _open(page, dash.url)
    ui.route("**/ui/api/{unload,pull}", lambda route: route.abort())
    _row(ui, "demo").get_by_test_id("unload").click()
    error = ui.get_by_test_id("model-error")
    expect(error).to_contain_text("unload demo: the page cannot reach the server")
    ui.get_by_test_id("pull-repo").fill("test-org/tiny")
    ui.get_by_test_id("pull").click()
    expect(error).to_contain_text("pull test-org/tiny: the page cannot reach the server")
    ui.unroute("**/ui/api/{unload,pull}")
    assert _health(dash.url)["model_details"]["demo"]["state"] == "loaded"
    expect(_row(ui, "demo").get_by_test_id("unload")).to_be_enabled()
    page.check(allowed_errors=("ERR_FAILED",))
    page.errors.clear()
