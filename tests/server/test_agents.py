"""The coding agents people point at a local server, run unchanged against afmd: Claude
Code (``claude -p``, json and stream-json, its default tools), Codex CLI (``codex exec``,
a custom provider on the Responses API, its default features), OpenCode (``opencode
run``, an openai-compatible provider), the AI SDK's default OpenAI provider (a two-step
tool loop, stored responses), aider (``aider --message``, an ``openai/`` model, its default
``whole`` edit format and the ``diff`` one) and Continue's CLI (``cn -p``, a config.yaml
model with ``provider: openai``). Each runs against its own afmd (so the access log says
which requests were its), all at once; every request it made must be answered 2xx and it
must print no API error. The model's text is nonsense; the protocol exchange is what is
tested. Only the agents whose tests are selected run (``-k aider`` runs aider alone).

The agents are installed by npm at the versions tests/agents/package.json pins, aider by
pip at the version tests/agents/requirements-aider.txt pins (helpers/agents.py). The
request shapes they send are kept in tests/data/agents/ for the fast replay test,
tests/server/test_agent_requests.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from helpers import agents
from helpers.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

MODEL = "demo-agent"
PROMPT = "say hi"
TIMEOUT = 420  # seconds per agent run: a first prompt of ~13k tokens prefilled on a CPU


@dataclass
class Run:
    """One agent's runs against its own server."""

    outputs: list[subprocess.CompletedProcess[str]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # the access log
    events: list[dict[str, Any]] = field(default_factory=list)  # all the server logged
    seconds: float = 0.0


def _base_env(home: Path, work: Path) -> dict[str, str]:
    # PWD too: OpenCode takes its project folder from it, not from the working directory.
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "PWD": str(work), "LANG": "C.UTF-8", "NO_COLOR": "1"}


def _claude(folder: Path, url: str, work: Path, env: dict[str, str]) -> list[list[str]]:
    env.update({
        "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "dummy",
        "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CONFIG_DIR": str(Path(env["HOME"]) / ".claude"),
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    })
    claude = str(folder / "node_modules" / ".bin" / "claude")
    return [[claude, "-p", PROMPT, "--output-format", "json"],
            [claude, "-p", PROMPT, "--output-format", "stream-json", "--verbose"]]


def _codex(folder: Path, url: str, work: Path, env: dict[str, str]) -> list[list[str]]:
    home = Path(env["HOME"]) / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "afmd"\n\n[model_providers.afmd]\n'
        f'name = "afmd"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        'env_key = "AFMD_API_KEY"\n')
    env.update({"CODEX_HOME": str(home), "AFMD_API_KEY": "dummy"})
    return [[str(folder / "node_modules" / ".bin" / "codex"), "exec",
             "--skip-git-repo-check", PROMPT]]


def _opencode(folder: Path, url: str, work: Path, env: dict[str, str]) -> list[list[str]]:
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"afmd": {
            "npm": "@ai-sdk/openai-compatible", "name": "afmd",
            "options": {"baseURL": url + "/v1", "apiKey": "dummy"},
            "models": {MODEL: {"name": MODEL}}}},
        "model": f"afmd/{MODEL}", "autoupdate": False, "share": "disabled"}))
    home = Path(env["HOME"])
    agents.copy_opencode_config(home / ".config" / "opencode")
    env.update({"XDG_CONFIG_HOME": str(home / ".config"),
                "XDG_DATA_HOME": str(home / ".local" / "share"),
                "XDG_CACHE_HOME": str(home / ".cache"),
                "XDG_STATE_HOME": str(home / ".local" / "state"),
                "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"})
    return [[str(folder / "node_modules" / ".bin" / "opencode"), "run", PROMPT,
             "-m", f"afmd/{MODEL}"]]


def _ai_sdk(folder: Path, url: str, work: Path, env: dict[str, str]) -> list[list[str]]:
    return [["node", str(folder / "ai_sdk_loop.mjs"), url + "/v1", MODEL]]


def _aider(folder: Path, url: str, work: Path, env: dict[str, str]) -> list[list[str]]:
    (work / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    # The model's context, told to aider; it also spares aider fetching litellm's price
    # list from GitHub (its ModelInfoManager looks there only for models it is not told).
    (work / ".aider.model.metadata.json").write_text(json.dumps({f"openai/{MODEL}": {
        "max_input_tokens": 131072, "max_output_tokens": 8192,
        "litellm_provider": "openai", "mode": "chat"}}))
    env.update({"OPENAI_API_BASE": url + "/v1", "OPENAI_API_KEY": "dummy",
                # litellm fetches its own copy of that list at import unless told not to.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    aider = [str(agents.aider_installed() / "bin" / "aider"), "--model", f"openai/{MODEL}",
             "--message", PROMPT, "--no-git", "--yes-always", "--no-check-update",
             "--no-show-model-warnings", "--analytics-disable", "--map-tokens", "0"]
    # Its default for a model it does not know, then the one most local setups choose.
    # Each in a home of its own: a home that has run this aider before makes it import
    # litellm in a background thread while its main thread imports it too, a race of
    # aider's own that fails a request now and then before it leaves.
    homes = [Path(env["HOME"]) / f"aider-{edit_format}" for edit_format in ("whole", "diff")]
    for home in homes:
        home.mkdir()
    return [["env", f"HOME={home}", *aider, "--edit-format", edit_format, "calc.py"]
            for home, edit_format in zip(homes, ("whole", "diff"), strict=True)]


def _continue(folder: Path, url: str, work: Path, env: dict[str, str]) -> list[list[str]]:
    config = Path(env["HOME"]) / ".continue" / "config.yaml"
    config.parent.mkdir()
    config.write_text(
        "name: afmd\nversion: 0.0.1\nschema: v1\nmodels:\n"
        f"  - name: afmd\n    provider: openai\n    model: {MODEL}\n"
        f"    apiBase: {url}/v1\n    apiKey: dummy\n    roles: [chat, edit, apply]\n")
    env["CONTINUE_CLI_ENABLE_TELEMETRY"] = "0"
    return [[str(folder / "node_modules" / ".bin" / "cn"), "-p", PROMPT,
             "--config", str(config)]]


AGENTS: dict[str, Callable[[Path, str, Path, dict[str, str]], list[list[str]]]] = {
    "claude": _claude, "codex": _codex, "opencode": _opencode, "ai_sdk": _ai_sdk,
    "aider": _aider, "continue": _continue}
#: Layers of the model each agent talks to (helpers.agents.quick_model): one where the
#: agent's flow allows, as its prefill of an agent's long prompt costs a fraction of two
#: layers'; aider's flow did not finish against a one-layer model, so it gets two.
LAYERS: dict[str, int] = {"claude": 1, "codex": 1, "opencode": 1, "ai_sdk": 1,
                          "continue": 1, "aider": 2}
#: Which agent each test needs: the fixture runs only those of the selected tests.
NEEDS = {"test_claude_code": "claude", "test_codex": "codex", "test_opencode": "opencode",
         "test_ai_sdk_tool_loop": "ai_sdk", "test_aider": "aider",
         "test_continue": "continue"}


def _run(name: str, folder: Path, server: ServerProcess, tmp: Path) -> Run:
    home, work = tmp / "home", tmp / "work"
    home.mkdir()
    work.mkdir()
    env = _base_env(home, work)
    commands = AGENTS[name](folder, server.url, work, env)
    run = Run()
    before = len(server.events)  # the harness's own readiness polls are not the agent's
    started = time.monotonic()
    for command in commands:  # in order: the second reuses the first's prefix cache
        run.outputs.append(subprocess.run(
            command, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=TIMEOUT, check=False))
    run.seconds = time.monotonic() - started
    run.events = list(server.events)[before:]
    run.requests = [e for e in run.events if e.get("event") == "request"]
    return run


#: Agents that could not be installed because the registry was out of reach, and why.
unreachable: dict[str, str] = {}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    reason = agents.missing_tools()
    if reason is not None:
        pytest.skip(reason)
    names = sorted({NEEDS[item.originalname] for item in request.session.items
                    if item.module is request.module and item.originalname in NEEDS})
    folder = agents.installed()
    if "aider" in names:
        try:
            agents.aider_installed()  # before the runs start: it takes minutes, once
        except agents.RegistryUnreachable as error:
            names.remove("aider")
            unreachable["aider"] = f"pip could not reach the package index: {error}"
    models = {layers: agents.quick_model(tmp_path_factory.mktemp("model"), layers)
              for layers in {LAYERS[name] for name in names}}
    # A first prompt of ~13k tokens may take minutes to prefill on a busy CPU.
    servers = {name: start_server(
        tmp_path_factory.mktemp(f"server-{name}"),
        config=(f'[server]\nrequest_timeout = {TIMEOUT}\n[[models.model]]\nid = "{MODEL}"\n'
                f'path = "{models[LAYERS[name]]}"\n'))
        for name in names}
    try:
        with ThreadPoolExecutor(max(1, len(names))) as pool:
            futures = {name: pool.submit(_run, name, folder, servers[name],
                                         tmp_path_factory.mktemp(name))
                       for name in names}
            yield {name: future.result() for name, future in futures.items()}
    finally:
        for server in servers.values():
            server.stop()


def _answered(run: Run, endpoint: str, at_least: int) -> None:
    """Every request 2xx, and the agent's own requests reached ``endpoint``."""
    assert run.requests, "the agent made no request"
    failed = [(e["method"], e["path"], e["status"]) for e in run.requests
              if not 200 <= e["status"] < 300]
    assert not failed, failed
    # Nothing refused at the gate (not a request line), no stream ended by an error. (An
    # agent may leave a request of its own behind as it exits, a title or a quota check a
    # busy machine has not answered yet: a client's choice, not the server's failure.)
    troubled = [e for e in run.events if e.get("event") == "refused"
                or e.get("stream_error") or e.get("level") in ("error", "critical")]
    assert not troubled, troubled
    posts = [e for e in run.requests if e["method"] == "POST" and e["path"] == endpoint]
    assert len(posts) >= at_least, [(e["method"], e["path"]) for e in run.requests]
    # Each was a generation (the model may end its turn at once: 0 tokens is an answer).
    assert all(isinstance(e.get("completion_tokens"), int) for e in posts), posts


def _clean(output: subprocess.CompletedProcess[str]) -> None:
    assert output.returncode == 0, output.stdout[-2000:] + output.stderr[-2000:]


def test_claude_code(runs: dict[str, Run]) -> None:
    run = runs["claude"]
    _answered(run, "/v1/messages", at_least=2)
    plain, streamed = run.outputs
    for output in (plain, streamed):
        _clean(output)
    result = json.loads(plain.stdout)
    assert result["is_error"] is False and result.get("api_error_status") is None, result
    assert result["stop_reason"] == "end_turn" and "API Error" not in result["result"]
    lines = [json.loads(line) for line in streamed.stdout.splitlines() if line.strip()]
    final = lines[-1]
    assert final["type"] == "result" and final["is_error"] is False, final
    assert "API Error" not in final["result"]


def test_codex(runs: dict[str, Run]) -> None:
    run = runs["codex"]
    _answered(run, "/v1/responses", at_least=1)
    (output,) = run.outputs
    _clean(output)
    errors = [line for line in output.stderr.splitlines()
              if line.startswith("ERROR") or "unexpected status" in line]
    assert not errors, errors
    assert "tokens used" in output.stderr


def test_opencode(runs: dict[str, Run]) -> None:
    run = runs["opencode"]
    _answered(run, "/v1/chat/completions", at_least=1)
    (output,) = run.outputs
    _clean(output)
    assert "Error" not in output.stderr, output.stderr[-2000:]
    assert output.stdout.strip()


def test_ai_sdk_tool_loop(runs: dict[str, Run]) -> None:
    run = runs["ai_sdk"]
    _answered(run, "/v1/responses", at_least=2)
    (output,) = run.outputs
    _clean(output)
    result = json.loads(output.stdout.strip().splitlines()[-1])
    assert result["steps"][0] == "tool-calls" and len(result["steps"]) == 2, result
    (call,) = result["calls"]
    assert all(0 <= n <= 9 for n in call)


def _ran(runs: dict[str, Run], name: str) -> Run:
    if name in unreachable:
        pytest.skip(unreachable[name])
    return runs[name]


#: What litellm raises for a failure inside its own client before a request leaves (an
#: exception of no text wrapped as a 500): no status, no connection, no body of ours.
_LOCAL_FAILURE = "litellm.InternalServerError: InternalServerError: OpenAIException -"


def _server_caused(errors: list[str], events: list[dict[str, Any]]) -> list[str]:
    """The errors aider printed, less one retry of a failure inside litellm itself: what
    this server did is in its log, which :func:`_answered` holds to 2xx answers, nothing
    refused and no stream error, and which must show no answer aider left unread; a
    failure of the server's prints a status, a connection or a body."""
    local = [line for line in errors if line.rstrip() == _LOCAL_FAILURE]
    if len(local) != 1 or any(e.get("disconnected") for e in events):
        return errors  # an answer aider left unread: the failure may have been in it
    retries = [line for line in errors if line.startswith("Retrying in ")]
    rest = [line for line in errors if line not in local and line not in retries]
    return errors if len(retries) != 1 or rest else []


def test_aider(runs: dict[str, Run]) -> None:
    run = _ran(runs, "aider")
    _answered(run, "/v1/chat/completions", at_least=2)
    for output, edit_format in zip(run.outputs, ("whole", "diff"), strict=True):
        _clean(output)
        text = output.stdout + output.stderr
        assert f"with {edit_format} edit format" in text, text[-2000:]
        # What aider prints when litellm raises: the exception's class, then a retry.
        errors = [line for line in text.splitlines()
                  if "litellm." in line or "APIError" in line or "Retrying" in line
                  or "BadRequest" in line or "Connection" in line]
        assert not _server_caused(errors, run.events), (errors, text[-4000:], run.events)
        assert "Tokens: " in text, text[-2000:]  # the turn was answered and counted


def test_continue(runs: dict[str, Run]) -> None:
    run = _ran(runs, "continue")
    _answered(run, "/v1/chat/completions", at_least=1)
    (output,) = run.outputs
    _clean(output)
    # cn reports a failed request on stderr ({"status":"error","message":"400 …"}, exit 1);
    # stdout is the demo model's answer, random text that may spell "Error" itself.
    assert "error" not in output.stderr.lower(), output.stderr[-2000:]
