"""The coding agents of tests/server/test_agents.py: installed from npm at the versions
tests/agents/package.json pins, into a cache folder keyed by that file's hash, and the
model they talk to.

The install is shared by every run (and every pytest-xdist worker, under a file lock): it
is a few hundred megabytes of native binaries that change only when the pins do. The
model is the built-in demo, its output head turned so that it ends its turn within a few
dozen tokens: random weights otherwise write until the window is full (131,072 tokens),
and an agent that gets no end of turn retries or reports an error, whatever the server
did right.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PINS = ROOT / "tests" / "agents" / "package.json"
#: Files copied next to the installed packages (Node resolves an ES module's imports from
#: the script's own folder, not from NODE_PATH).
SCRIPTS = ("ai_sdk_loop.mjs",)
#: Set to use another cache folder (CI's, a shared one).
CACHE_ENV = "AFMD_AGENTS_CACHE"


def missing_tools() -> str | None:
    """Why the agents cannot run here, or None."""
    absent = [name for name in ("node", "npm") if shutil.which(name) is None]
    if absent:
        return (f"{' and '.join(absent)} not installed: the agents are npm packages "
                "(.ci/run installs Node.js; apt-get install nodejs npm)")
    return None


def cache_root() -> Path:
    default = Path.home() / ".cache" / "afmd-tests"
    return Path(os.environ.get(CACHE_ENV) or default)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def installed() -> Path:
    """The folder whose node_modules hold the pinned agents, installed on first use."""
    pins = PINS.read_bytes()
    root = cache_root()
    folder = root / f"agents-{hashlib.sha256(pins).hexdigest()[:16]}"
    marker = folder / ".installed"
    with _locked(root / "agents.lock"):
        if not marker.is_file():
            staging = Path(tempfile.mkdtemp(prefix=".agents-", dir=root))
            try:
                (staging / "package.json").write_bytes(pins)
                subprocess.run(
                    ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error",
                     "--cache", str(root / "npm")],
                    cwd=staging, check=True, stdin=subprocess.DEVNULL, timeout=900)
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(staging, folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            marker.write_text(json.dumps(json.loads(pins)["dependencies"]) + "\n")
        for name in SCRIPTS:
            shutil.copyfile(PINS.parent / name, folder / name)
    return folder


def quick_model(dest: Path) -> Path:
    """The demo-32k model (its larger vocabulary makes an agent's prompt about a third
    fewer tokens to prefill), its head made to end a turn soon: only the end token's logit
    follows one hidden dimension, every other logit is 0, so the end token is likely
    wherever that dimension is positive. A real model for the engine; only the text it
    writes is (as the demo's) nonsense."""
    import mlx.core as mx

    from afmd.engine.demo import builtin as demo

    demo.build("demo-32k", dest)
    path = dest / "model.safetensors"
    weights = mx.load(str(path))
    assert isinstance(weights, dict)
    end = json.loads((dest / "config.json").read_text())["eos_token_id"][0]
    norm = mx.zeros_like(weights["model.norm.weight"])
    norm[0] = 1.0
    head = mx.zeros_like(weights["lm_head.weight"])
    head[end, 0] = 12.0
    weights["model.norm.weight"], weights["lm_head.weight"] = norm, head
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return dest
