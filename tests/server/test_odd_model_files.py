"""Model folders afmd did not write: the hub cache is shared with every other tool, so a
repo in it may hold any bytes. Describing one (``/api/tags``, ``/api/show``, ``afmd list``)
never fails the listing: a malformed file was a 500 for every model on ``/api/tags``.

And the heavy libraries' first import from two threads at once (transformers' package
setup is not thread-safe), which made a fresh server's first ``/api/tags`` a 500.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from afmd.engine.models.describe import count_parameters, safetensors_headers
from afmd.engine.models.loaded_model import context_length_from
from afmd.hub.cache import missing_files

from conftest import ROOT, ServerProcess, start_server

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
QUANTIZED = {"w.weight": {"dtype": "U32", "shape": [4, 4]},
             "w.scales": {"dtype": "F16", "shape": [4, 1]}}

#: name -> (config.json, the weight file's header, other files)
ODD: dict[str, tuple[Any, Any, dict[str, str]]] = {
    "header-list": (LLAMA, [1, 2], {}),
    "shape-text": (LLAMA, {"w": {"dtype": "F32", "shape": ["x"]}}, {}),
    "shape-string": (LLAMA, {"w": {"dtype": "F32", "shape": "12"}}, {}),
    "shape-negative": (LLAMA, {"w": {"dtype": "F32", "shape": [-3, 2]}}, {}),
    "entry-list": (LLAMA, {"w": [1]}, {}),
    "bits-zero": ({**LLAMA, "quantization": {"bits": 0}}, QUANTIZED, {}),
    "bits-text": ({**LLAMA, "quantization": {"bits": "x"}}, QUANTIZED, {}),
    "text-config-list": ({**LLAMA, "text_config": [1]}, {}, {}),
    "config-list": ([1], {}, {}),
    "header-empty": (LLAMA, b"", {}),
    "tokenizer-broken": (LLAMA, {}, {"tokenizer.json": "[]"}),
    "eos-text": ({**LLAMA, "eos_token_id": "x"}, {}, {}),
}


def write_repo(hub: Path, name: str, config: Any, header: Any, files: dict[str, str]) -> None:
    folder = hub / f"models--odd--{name}"
    snapshot = folder / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("a" * 40)
    (snapshot / "config.json").write_text(json.dumps(config))
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (snapshot / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    for file, text in files.items():
        (snapshot / file).write_text(text)


def test_odd_headers_and_configs_describe_as_nothing(tmp_path: Path) -> None:
    for name, (config, header, files) in ODD.items():
        write_repo(tmp_path, name, config, header, files)
        snapshot = tmp_path / f"models--odd--{name}" / "snapshots" / ("a" * 40)
        tensors = safetensors_headers(snapshot)
        quantization = config.get("quantization") if isinstance(config, dict) else None
        assert count_parameters(tensors, quantization) >= 0, name
    assert context_length_from({"text_config": [1]}) is None
    assert context_length_from({"max_position_embeddings": True}) is None
    index = tmp_path / "index"
    index.mkdir()
    (index / "config.json").write_text("{}")
    for weight_map in ({"a": 5, "b": "x.safetensors"}, {"a": ""}, [1]):
        (index / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": weight_map}))
        assert missing_files(index) == ("model.safetensors.index.json (unreadable)",)


@pytest.fixture(scope="module")
def odd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = tmp_path_factory.mktemp("hf")
    for name, (config, header, files) in ODD.items():
        write_repo(home / "hub", name, config, header, files)
    write_repo(home / "hub", "index-numbers", LLAMA, {}, {
        "model.safetensors.index.json": json.dumps({"weight_map": {"a": 5, "b": "x"}})})
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = start_server(tmp_path_factory.mktemp("odd"), env=env)
    yield proc
    proc.stop()


def test_odd_repos_are_listed_and_shown(odd_server: ServerProcess) -> None:
    with httpx.Client(base_url=odd_server.url, timeout=60) as http:
        tags = http.get("/api/tags")
        assert tags.status_code == 200, tags.text
        listed = {m["name"] for m in tags.json()["models"]}
        assert {f"odd/{name}:latest" for name in ODD} <= listed
        assert "odd/index-numbers:latest" not in listed  # incomplete: its index is unreadable
        for name in ODD:
            shown = http.post("/api/show", json={"model": f"odd/{name}"})
            assert shown.status_code == 200, (name, shown.text)
            assert shown.json()["capabilities"] == ["completion"], name
        assert http.post("/api/show", json={"model": "odd/index-numbers"}).status_code == 404
    assert "Traceback" not in odd_server.log_text()


def test_the_first_imports_from_two_threads(tmp_path: Path) -> None:
    """A fresh interpreter (this one has transformers already): describing a model on one
    thread while the vision demo is built on another, as a fresh server's default model
    loads while ``/api/tags`` builds the demo."""
    script = """
import sys, threading
from pathlib import Path
from afmd.config.tables import ModelEntry
from afmd.engine.demo import builtin
from afmd.engine.models.describe import describe
root = Path(sys.argv[1])
text = builtin.materialize("demo", cache_root=root)
assert "transformers" not in sys.modules
errors = []
def run(work):
    try:
        work()
    except Exception as exc:
        errors.append(repr(exc))
threads = [
    threading.Thread(target=run, args=(
        lambda: describe(text, ModelEntry(id="demo", path="afmd:demo")),)),
    threading.Thread(target=run, args=(
        lambda: builtin.materialize("demo-vision", cache_root=root),))]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("errors:", errors)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert "errors: []" in done.stdout, (done.stdout, done.stderr[-2000:])
