"""The dashboard's server side, over HTTP: ``GET /``, the page and its files, ``/ui/api/``
against the API's own answers, the actions, and the screening (key, origin, ``[ui]``).

What the page does with all this, in a real browser, is tests/server/test_dashboard_browser.py.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from afmd import __version__
from afmd.core.events import Usage
from afmd.http.dashboard_state import Activity
from afmd.http.routes.dashboard import prefers_html

from conftest import ROOT, ServerProcess, parse_sse, start_server
from helpers.hub import FakeHub, safetensors_bytes

BROWSER_ACCEPT = ("text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,"
                  "image/webp,*/*;q=0.8")
ALLOWED_ORIGIN = "http://app.example"
KEY = "sk-dashboard-test"


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("ui")
    server = start_server(
        folder,
        config=(f'[server]\nallowed_origins = ["http://app.example"]\n'
                f'unix_socket = "{folder / "afmd.sock"}"\n'
                '[models.aliases]\n"gpt-4o-mini" = "demo"\n'))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("keyed"),
                          config=f'[server]\napi_key = "{KEY}"\n')
    yield server
    server.stop()


@pytest.fixture()
def http(ui: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ui.url, timeout=60) as client:
        yield client


def _error(response: httpx.Response, status: int, code: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "Hello there"}],
            "temperature": 0, **fields}


@pytest.fixture()
def long_stream(ui: ServerProcess) -> Iterator[Any]:
    """A greedy stream that runs until cancelled (it is, at the end), by its request id."""
    request_id = f"long-{time.monotonic_ns()}"
    done = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=ui.url, timeout=120) as client, client.stream(
                "POST", "/v1/chat/completions", headers={"X-Request-ID": request_id},
                json=_chat(max_tokens=6000, stream=True)) as response:
            for _ in response.iter_bytes():
                pass
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    handle = SimpleNamespace(id=request_id, done=done)
    _until(lambda: httpx.get(ui.url + "/health").json()["active_requests"] == 1)
    yield handle
    httpx.post(f"{ui.url}/v1/chat/completions/{request_id}/cancel")
    assert done.wait(30)


def _until(condition: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition never held")


# ---------------------------------------------------------------------------- GET /


@pytest.mark.parametrize(("accept", "html"), [
    (BROWSER_ACCEPT, True),
    ("text/html", True),
    ("application/xhtml+xml, */*;q=0.1", True),
    ("*/*", False),  # curl
    (None, False),
    ("", False),
    ("application/json", False),  # SDKs
    ("application/json, text/html", False),  # equal q: the first wins
    ("text/html;q=0.5, application/json", False),
    ("text/html;q=0, */*", False),
    ("text/plain;q=0.2, text/html;q=0.9", True),
    ("text/html;q=x", False),
])
def test_prefers_html(accept: str | None, html: bool) -> None:
    assert prefers_html(accept) is html


def test_root_sends_a_browser_to_the_dashboard_and_others_get_plain_text(
        http: httpx.Client) -> None:
    browser = http.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert browser.status_code == 302
    assert browser.headers["location"] == "/ui/"
    assert "accept" in browser.headers["vary"].lower()
    for accept in ("*/*", "application/json"):
        plain = http.get("/", headers={"Accept": accept})
        assert plain.status_code == 200
        assert plain.headers["content-type"].startswith("text/plain")
        assert plain.text == "Ollama is running"
    head = http.head("/")
    assert head.status_code == 200 and head.content == b""
    followed = http.get("/", headers={"Accept": BROWSER_ACCEPT}, follow_redirects=True)
    assert followed.url.path == "/ui/"
    assert followed.headers["content-type"] == "text/html; charset=utf-8"


# ---------------------------------------------------------------------------- the page


def test_the_page_and_its_files(http: httpx.Client) -> None:
    page = http.get("/ui/")
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    referenced = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert referenced and all(url.startswith("/ui/") for url in referenced), referenced
    for url in referenced:
        asset = http.get(url)
        assert asset.status_code == 200, url
        assert asset.headers["content-security-policy"] == csp
    assert http.get("/ui/dashboard.js").headers["content-type"].startswith("text/javascript")
    assert http.get("/ui/dashboard.css").headers["content-type"].startswith("text/css")
    _error(http.get("/ui/nothing.js"), 404, "unknown_url")
    _error(http.get("/ui/api/nothing"), 404, "unknown_url")
    bare = http.get("/ui")
    assert bare.status_code == 302 and bare.headers["location"] == "/ui/"


def test_the_page_is_written_here_and_shipped_as_package_data() -> None:
    """Every file is afmd's own (no CDN, no framework: small), named in the package data
    and in the frozen build."""
    folder = ROOT / "afmd" / "data" / "ui"
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["dashboard.css", "dashboard.js", "favicon.svg", "index.html"]
    assert sum((folder / f).stat().st_size for f in files) < 64 * 1024
    for name in files:
        text = (folder / name).read_text()
        urls = [u for u in re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", text)
                if u != "http://www.w3.org/2000/svg"]  # an XML namespace, never fetched
        assert not urls, (name, urls)
    assert '"data/ui/*"' in (ROOT / "pyproject.toml").read_text()
    assert '"data/ui/*"' in (ROOT / "build" / "afmd.spec").read_text()


# ---------------------------------------------------------------------------- reads


def test_status(ui: ServerProcess, http: httpx.Client) -> None:
    status = http.get("/ui/api/status").json()
    assert status["version"] == __version__
    assert sorted(status["listeners"], key=lambda x: x["address"]) == [
        {"address": ui.url, "up": True},
        {"address": next(a for a in ui.addresses if a.startswith("unix:")), "up": True}]
    assert status["config_file"] == ui.wait_event("listening")["config"]
    assert Path(status["config_file"]).is_file()
    assert status["default_model"] == "demo"
    assert status["api_key_required"] is False
    assert 0 <= status["uptime_s"] <= status["now"] - status["started_at"] + 1


def test_the_server_instance_tells_a_restart(http: httpx.Client, keyed: ServerProcess) -> None:
    """Which server answers, for a page that outlives one: the same in every read of one
    server, another for another (whose requests count from one again)."""
    instance = http.get("/ui/api/status").json()["instance"]
    assert re.fullmatch(r"[0-9a-f]{32}", instance)
    assert http.get("/ui/api/activity").json()["instance"] == instance
    other = httpx.get(keyed.url + "/ui/api/activity",
                      headers={"Authorization": f"Bearer {KEY}"}).json()["instance"]
    assert other != instance


def test_models_are_the_apis_models_with_their_state(http: httpx.Client) -> None:
    payload = http.get("/ui/api/models").json()
    rows = {m["id"]: m for m in payload["models"] if m["source"] != "downloaded"}
    listed = http.get("/v1/models").json()["data"]
    assert list(rows) == [m["id"] for m in listed if "parent" not in m]
    health = http.get("/health").json()
    for model_id, detail in health["model_details"].items():
        row = rows[model_id]
        state = detail["state"]
        assert (row["state"] if row["reason"] is None
                else f"{row['state']}: {row['reason']}") == state
        for key in ("memory_bytes", "active", "queued", "expires_at"):
            assert row[key] == detail[key], (model_id, key)
    kinds = {m["id"]: m["kind"] for m in listed}
    assert {i: r["kind"] for i, r in rows.items()} == {i: kinds[i] for i in rows}
    assert rows["demo"]["default"] and rows["demo"]["aliases"] == ["gpt-4o-mini"]
    assert rows["demo"]["source"] == "built-in" and rows["demo"]["state"] == "loaded"
    memory = payload["memory"]
    assert memory["loaded"] == sum(r["state"] == "loaded" for r in rows.values())
    assert memory["used_bytes"] >= rows["demo"]["memory_bytes"] > 0
    assert memory["budget_bytes"] > memory["used_bytes"]


def test_the_last_requests_are_the_access_log(ui: ServerProcess,
                                              http: httpx.Client) -> None:
    after = http.get("/ui/api/activity").json()["t"]
    request_id = f"ring-{time.monotonic_ns()}"
    reply = http.post("/v1/chat/completions", headers={"X-Request-ID": request_id},
                      json=_chat(max_tokens=12))
    usage = reply.json()["usage"]
    logged = ui.wait_event("request", request_id=request_id)
    entry = _until(lambda: next((e for e in http.get("/ui/api/activity").json()["requests"]
                                 if e["request_id"] == request_id), None))
    for key in ("method", "path", "status", "model", "prompt_tokens", "completion_tokens",
                "ttft_ms", "duration_ms", "finish_reason"):
        assert entry[key] == logged[key], key
    assert entry["completion_tokens"] == usage["completion_tokens"] == 12
    assert 0 < entry["ttft_ms"] <= entry["duration_ms"]
    # The page's own polling is not in the ring (it would be all there is).
    assert not [e for e in http.get("/ui/api/activity").json()["requests"]
                if e["path"].startswith("/ui")]
    # The series: one point a second, and this request's tokens in it, once.
    time.sleep(1.2)
    points = http.get(f"/ui/api/activity?after={after}").json()["series"]
    assert all(b["t"] - a["t"] >= 1 for a, b in itertools.pairwise(points))
    assert sum(p["tokens_per_s"] for p in points) == 12
    assert [p["ttft_ms"] for p in points if p["ttft_ms"] is not None] == [entry["ttft_ms"]]
    since = http.get("/ui/api/activity").json()["seq"]
    assert http.get(f"/ui/api/activity?since={since}").json()["requests"] == []
    _error(http.get("/ui/api/activity?since=-1"), 400, "invalid_value")


def test_running_requests_and_tokens_while_a_stream_runs(http: httpx.Client,
                                                         long_stream: Any) -> None:
    live = http.get("/ui/api/activity").json()
    health = http.get("/health").json()
    assert live["active"] == health["active_requests"] == 1
    assert live["models"]["demo"] == {"active": 1, "queued": 0}
    assert live["queued"] == health["queued_requests"] == 0
    # Tokens are counted while the stream runs, not only when it ends.
    t = live["t"]
    points = _until(lambda: [p for p in http.get(f"/ui/api/activity?after={t}").json()["series"]
                             if p["tokens_per_s"] > 0], timeout=5)
    assert points[0]["active"] == 1
    assert not long_stream.done.is_set()


# ---------------------------------------------------------------------------- actions


def test_unload_and_load(http: httpx.Client) -> None:
    def state() -> str:
        return http.get("/health").json()["model_details"]["demo"]["state"]

    unloaded = http.post("/ui/api/unload", json={"model": "demo"})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.json() == {"id": "demo", "state": "available"}
    assert state() == "available"
    _error(http.post("/ui/api/unload", json={"model": "demo"}), 409, "model_not_loaded")
    loaded = http.post("/ui/api/load", json={"model": "gpt-4o-mini"})  # an alias
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["id"] == "demo" and loaded.json()["memory_bytes"] > 0
    assert state() == "loaded"
    assert http.post("/ui/api/load", json={"model": "demo"}).json()["state"] == "loaded"
    _error(http.post("/ui/api/load", json={"model": "nope"}), 404, "model_not_found")
    _error(http.post("/ui/api/load", json={}), 400, "missing_required_parameter")
    _error(http.post("/ui/api/load", json={"model": "demo", "x": 1}), 400,
           "unknown_parameter")
    _error(http.post("/ui/api/load", content=b"model=demo"), 415, "unsupported_media_type")


def test_a_busy_model_is_not_unloaded(http: httpx.Client, long_stream: Any) -> None:
    error = _error(http.post("/ui/api/unload", json={"model": "demo"}), 409, "model_busy")
    assert "1 running" in error["message"]
    assert http.get("/health").json()["model_details"]["demo"]["state"] == "loaded"


def test_actions_come_from_the_page_only(ui: ServerProcess, http: httpx.Client) -> None:
    # An origin allowed to read the API may read the dashboard's data too...
    read = http.get("/ui/api/status", headers={"Origin": ALLOWED_ORIGIN})
    assert read.status_code == 200
    assert read.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    # ...but not change what the server holds.
    error = _error(http.post("/ui/api/unload", json={"model": "demo"},
                             headers={"Origin": ALLOWED_ORIGIN}), 403, "origin_not_allowed")
    assert "own page" in error["message"]
    _error(http.post("/ui/api/pull", json={"model": "a/b"},
                     headers={"Sec-Fetch-Site": "cross-site"}), 403, "origin_not_allowed")
    # Any other origin is refused by the gate, before the body is read.
    _error(http.post("/ui/api/load", json={"model": "demo"},
                     headers={"Origin": "http://evil.example"}), 403, "origin_not_allowed")
    _error(http.get("/ui/api/models", headers={"Origin": "http://evil.example"}), 403,
           "origin_not_allowed")
    # The page's own origin (the Host it was sent to) passes, reads and actions alike.
    own = {"Origin": ui.url, "Sec-Fetch-Site": "same-origin"}
    assert http.post("/ui/api/load", json={"model": "demo"}, headers=own).status_code == 200
    assert http.post("/v1/chat/completions", json=_chat(max_tokens=1),
                     headers=own).status_code == 200
    # A page at another name of this machine is another origin, even on the same port.
    other = ui.url.replace("127.0.0.1", "localhost")
    _error(http.post("/ui/api/load", json={"model": "demo"}, headers={"Origin": other}), 403,
           "origin_not_allowed")


def test_clearing_the_kv_cache_is_not_for_other_origins(http: httpx.Client) -> None:
    """``POST /afmd/cache/clear`` deletes every client's cached prefixes, files included:
    an origin allowed to use the API may not (it could, from any page it served), and
    ``afmd cache clear``, which sends no Origin, still does."""
    for headers in ({"Origin": ALLOWED_ORIGIN}, {"Sec-Fetch-Site": "cross-site"}):
        error = _error(http.post("/afmd/cache/clear", json={}, headers=headers), 403,
                       "origin_not_allowed")
        assert "afmd cache clear" in error["message"]
    cleared = http.post("/afmd/cache/clear", json={"model": "demo"})
    assert cleared.status_code == 200, cleared.text
    assert [c["model"] for c in cleared.json()["cleared"]] == ["demo"]


def test_the_key_guards_what_the_page_reads_not_the_page(keyed: ServerProcess) -> None:
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        for path in ("/", "/ui/", "/ui/dashboard.js", "/ui/favicon.svg"):
            assert http.get(path).status_code == 200, path
        assert http.get("/ui/auth").json() == {"api_key_required": True}
        for path in ("/ui/api/status", "/ui/api/models", "/ui/api/activity"):
            _error(http.get(path), 401, "invalid_api_key")
            _error(http.get(path, headers={"Authorization": "Bearer wrong"}), 401,
                   "invalid_api_key")
            assert http.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
            assert http.get(path, headers={"x-api-key": KEY}).status_code == 200
        _error(http.post("/ui/api/unload", json={"model": "demo"}), 401, "invalid_api_key")
        _error(http.post("/ui/api/pull", json={"model": "a/b"}), 401, "invalid_api_key")
        status = http.get("/ui/api/status", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert status["api_key_required"] is True
        assert KEY not in http.get("/ui/").text + http.get("/ui/dashboard.js").text


def test_ui_off(tmp_path: Path) -> None:
    server = start_server(tmp_path, config="[ui]\nenabled = false\n")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            root = http.get("/", headers={"Accept": BROWSER_ACCEPT})
            assert root.status_code == 200 and root.text == "Ollama is running"
            for path in ("/ui/", "/ui", "/ui/dashboard.js", "/ui/auth", "/ui/api/status"):
                _error(http.get(path), 404, "unknown_url")
    finally:
        server.stop()


# ---------------------------------------------------------------------------- pulls


def test_pull_from_the_dashboard(tmp_path: Path) -> None:
    files = {
        "config.json": json.dumps({"model_type": "qwen2"}).encode(),
        "model.safetensors": safetensors_bytes({"w": ("F32", [256, 64])}),
        "tokenizer_config.json": b"{}",
        "README.md": b"# not fetched\n",
    }
    with FakeHub() as hub:
        hub.add_repo("test-org/tiny", files)
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
               "HF_HUB_DISABLE_TELEMETRY": "1"}
        server = start_server(tmp_path, env=env)
        try:
            with httpx.Client(base_url=server.url, timeout=30) as http:
                started = http.post("/ui/api/pull", json={"model": "test-org/tiny"})
                assert started.status_code == 202, started.text
                assert started.json()["repo"] == "test-org/tiny"
                assert started.json()["state"] == "pulling"

                def pull() -> dict[str, Any] | None:
                    pulls = http.get("/ui/api/models").json()["pulls"]
                    return pulls[0] if pulls[0]["state"] != "pulling" else None

                done = _until(pull, timeout=60)
                assert done["state"] == "done", done
                wanted = sum(len(files[f]) for f in files if f != "README.md")
                assert done["total_bytes"] == done["completed_bytes"] == wanted
                assert done["files"] == done["files_done"] == 3
                row = next(m for m in http.get("/ui/api/models").json()["models"]
                           if m["id"] == "test-org/tiny")
                assert row["source"] == "downloaded" and row["state"] == "unavailable"
                assert "not configured" in row["reason"]
                assert row["size_bytes"] == wanted

                for bad in ("not a repo", "a/b\n", "a/..", "test-org/tiny@../../x"):
                    _error(http.post("/ui/api/pull", json={"model": bad}), 400,
                           "invalid_value")
                http.post("/ui/api/pull", json={"model": "test-org/missing"})
                failed = _until(lambda: next(
                    (p for p in http.get("/ui/api/models").json()["pulls"]
                     if p["repo"] == "test-org/missing" and p["state"] != "pulling"), None),
                    timeout=60)
                assert failed["state"] == "failed"
                assert "was not found" in failed["error"]
        finally:
            server.stop()


# ---------------------------------------------------------------------------- the series


class _Scheduler:
    active = 1
    queued = 2


class _Generation:
    def __init__(self, tokens: int = 0) -> None:
        self.tokens = tokens


class _Run:
    def __init__(self) -> None:
        self.generation = _Generation()


def test_a_duplicate_request_id_does_not_count_the_running_ones_tokens_again(
        ui: ServerProcess) -> None:
    """A request that reuses a running request's X-Request-ID is refused (409), and its
    access line leaves the running one's live count alone: taking it made the next second
    count every token of the running request again, so the tokens-per-second chart
    showed twice what was generated."""
    after = httpx.get(ui.url + "/ui/api/activity").json()["t"]
    request_id = f"dup-{time.monotonic_ns()}"
    body: dict[str, str] = {}

    def run() -> None:
        with httpx.Client(base_url=ui.url, timeout=120) as client:
            body["text"] = client.post(
                "/v1/chat/completions", headers={"X-Request-ID": request_id},
                json=_chat(max_tokens=6000, stream=True,
                           stream_options={"include_usage": True})).text

    def counted() -> float:
        series = httpx.get(ui.url + "/ui/api/activity", params={"after": after}).json()
        return sum(p["tokens_per_s"] for p in series["series"])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    _until(counted)  # a second has counted some of its tokens while it runs
    duplicate = httpx.post(ui.url + "/v1/chat/completions",
                           headers={"X-Request-ID": request_id}, json=_chat(max_tokens=2))
    _error(duplicate, 409, "duplicate_request_id")
    seen = counted()
    _until(lambda: counted() > seen)  # sampled again while it runs
    httpx.post(f"{ui.url}/v1/chat/completions/{request_id}/cancel")
    thread.join(30)
    usage = [c for c in parse_sse(body["text"]) if isinstance(c, dict) and c.get("usage")]
    told = usage[-1]["usage"]["completion_tokens"]
    _until(lambda: counted() >= told)
    time.sleep(1.2)  # the next second too
    assert counted() == told


def test_the_series_counts_tokens_live_and_the_rest_at_the_end() -> None:
    run = _Run()
    runs = {"r1": run}
    state = SimpleNamespace(running={"r1": 1},
                            pipeline=SimpleNamespace(find=runs.get, scheduler=_Scheduler()))
    activity = Activity()
    run.generation.tokens = 5
    first = activity.sample(state.pipeline, state.running, now=100.0)
    assert (first.tokens_per_s, first.active, first.queued) == (5, 1, 2)
    run.generation.tokens = 12
    assert activity.sample(state.pipeline, state.running, now=101.0).tokens_per_s == 7
    run.generation = _Generation(3)  # a second round (server tools)
    assert activity.sample(state.pipeline, state.running, now=102.0).tokens_per_s == 3
    # It ends with 20 tokens in all: the 5 not seen yet go into the next second.
    state.running.clear()
    activity.record("POST", "/v1/chat/completions", 200, duration_ms=3000.0,
                    request_id="r1", model="demo", usage=Usage(4, 20), ttft_ms=50.0,
                    finish_reason="stop", error_code=None)
    last = activity.sample(state.pipeline, state.running, now=103.0)
    assert (last.tokens_per_s, last.ttft_ms) == (5, 50.0)
    assert sum(p.tokens_per_s for p in activity.series) == 20
    # A request never seen running (shorter than a second) counts whole.
    activity.record("POST", "/v1/completions", 200, duration_ms=9.0, request_id="r2",
                    model="demo", usage=Usage(4, 7), ttft_ms=None, finish_reason="length",
                    error_code=None)
    activity.record("GET", "/ui/api/models", 200, duration_ms=1.0, request_id=None,
                    model=None, usage=None, ttft_ms=None, finish_reason=None,
                    error_code=None)
    assert activity.sample(state.pipeline, state.running, now=104.0).tokens_per_s == 7
    snapshot = activity.snapshot()
    assert [e["path"] for e in snapshot["requests"]] == ["/v1/chat/completions",
                                                         "/v1/completions"]
    assert [p["t"] for p in activity.snapshot(after=102)["series"]] == [103, 104]
    assert activity.snapshot(since=1)["requests"][0]["request_id"] == "r2"
