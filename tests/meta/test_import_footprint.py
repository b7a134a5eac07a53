"""What ``afmd serve`` imports before a model is loaded: never transformers or mlx-lm.

mlx-lm and ``llguidance.hf`` both import transformers, which alone keeps ~45 MB resident.
A server with no model loaded yet, or whose model folder is missing so the load fails, has
no use for it; the "RSS without a model ≤ 80 MB" goal holds only while these stay out of
``sys.modules`` until a real load begins. A fresh interpreter is the only honest place to
check: in the test process, other tests have long since imported everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # fresh interpreters measuring imports

#: Modules that must wait for a model load (or a grammar built for a loaded model).
HEAVY = ("transformers", "mlx_lm", "llguidance.hf", "afmd.engine.batch.generation_thread",
         "mlx_vlm", "PIL",
         "afmd.engine.vision.vision_model")

# Imports the way `afmd serve` does (cli, then logs and server), builds the whole server
# object, then lets the registry try a model whose local folder does not exist, as the
# benchmark's "RSS without a model" row does.
_SCRIPT = """
import asyncio, json, sys

import afmd.cli.main
from afmd import logs
from afmd.config.load import load_config
from afmd.engine import models
from afmd.errors import ServerError
from afmd.server import Server

config = load_config(env={}, overrides={"model": "/nonexistent/afmd-test-no-model"})
logs.configure("error", "json")
server = Server(config)
before = sorted(name for name in HEAVY if name in sys.modules)


async def load() -> str:
    try:
        await server.registry.begin_load(config.resolve_model(None))
    except ServerError as exc:
        return exc.message
    return "loaded"

outcome = asyncio.run(load())
after = sorted(name for name in HEAVY if name in sys.modules)
print(json.dumps({"before": before, "after": after, "outcome": outcome}))
"""


def test_serving_stack_and_failed_load_import_no_transformers() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{_SCRIPT}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("AFMD_")},
            "HF_HUB_OFFLINE": "1",
        },
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["before"] == [], f"imported by the serving stack: {result['before']}"
    assert "does not exist" in result["outcome"], result["outcome"]
    assert result["after"] == [], f"imported by a load that could not succeed: {result['after']}"
