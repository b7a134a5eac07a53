"""Ollama's API through the official ``ollama`` npm package (what Open WebUI-style apps
and Node tools are built on), installed with npm at a pinned version into a cache folder
and run by Node against the real server: version, tags, show, chat (whole and streamed),
generate, embed, ps and an error, each checked against what afmd's OpenAI routes answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ServerProcess

#: The npm package and the version the tests pin.
PACKAGE = "ollama@0.6.4"

SCRIPT = r"""
import { Ollama } from 'ollama'

const client = new Ollama({ host: process.env.AFMD_URL })
const messages = [{ role: 'user', content: 'Name three colours.' }]
const options = { temperature: 0, num_predict: 12 }
const out = {}
out.version = await client.version()
out.list = await client.list()
out.show = await client.show({ model: 'demo' })
out.chat = await client.chat({ model: 'demo', messages, options })
out.stream = []
for await (const part of await client.chat({ model: 'demo:latest', messages, options,
                                             stream: true })) {
  out.stream.push(part)
}
out.generate = await client.generate({ model: 'demo', prompt: 'def f(x):', raw: true,
                                       options })
out.embed = await client.embed({ model: 'demo-embedding', input: ['sky', 'grass'] })
out.ps = await client.ps()
try {
  await client.chat({ model: 'nope', messages })
} catch (error) {
  out.error = { name: error.name, message: error.error ?? error.message,
                status: error.status_code }
}
console.log(JSON.stringify(out))
"""


@pytest.fixture(scope="module")
def package() -> Path:
    """A folder with the pinned package installed (kept between runs: npm is asked once)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed: the ollama npm client cannot run")
    folder = Path(tempfile.gettempdir()) / "afmd-tests-npm" / PACKAGE.replace("@", "-")
    if not (folder / "node_modules" / "ollama" / "package.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(folder),
             PACKAGE], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    (folder / "check.mjs").write_text(SCRIPT)
    return folder


@pytest.fixture(scope="module")
def answers(package: Path, server: ServerProcess) -> dict[str, Any]:
    result = subprocess.run(["node", str(package / "check.mjs")], capture_output=True,
                            text=True, timeout=120, cwd=package,
                            env={**os.environ, "AFMD_URL": server.url})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_models(answers: dict[str, Any]) -> None:
    assert tuple(int(p) for p in answers["version"]["version"].split(".")) >= (0, 6, 4)
    names = {m["name"] for m in answers["list"]["models"]}
    assert {"demo:latest", "demo-embedding:latest"} <= names
    show = answers["show"]
    assert show["model_info"]["qwen2.context_length"] == 131072
    assert "completion" in show["capabilities"] and "tools" in show["capabilities"]
    assert any(m["name"] == "demo:latest" for m in answers["ps"]["models"])


def test_chat_and_generate_equal_openais(answers: dict[str, Any], http: httpx.Client) -> None:
    want = http.post("/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 12, "temperature": 0}).json()
    chat = answers["chat"]
    assert chat["message"]["content"] == want["choices"][0]["message"]["content"]
    assert chat["done"] is True and chat["eval_count"] == 12
    stream = answers["stream"]
    assert stream[-1]["done"] is True and not any(p["done"] for p in stream[:-1])
    assert "".join(p["message"]["content"] for p in stream) == chat["message"]["content"]
    completion = http.post("/v1/completions", json={
        "model": "demo", "prompt": "def f(x):", "max_tokens": 12, "temperature": 0}).json()
    assert answers["generate"]["response"] == completion["choices"][0]["text"]


def test_embed_and_errors(answers: dict[str, Any], http: httpx.Client) -> None:
    want = http.post("/v1/embeddings", json={"model": "demo-embedding",
                                             "input": ["sky", "grass"]}).json()
    for row, item in zip(answers["embed"]["embeddings"], want["data"], strict=True):
        assert max(abs(a - b) for a, b in zip(row, item["embedding"], strict=True)) < 1e-6
    assert answers["error"]["status"] == 404
    assert answers["error"]["message"] == "model 'nope' not found"
