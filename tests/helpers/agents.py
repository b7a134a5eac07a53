"""The coding agents of tests/server/test_agents.py (and the JavaScript SDKs of
tests/server/test_js_sdks.py): installed from npm at the versions
tests/agents/package.json pins, into a cache folder keyed by that file's hash (aider from
PyPI, at the version tests/agents/requirements-aider.txt pins, into a virtual environment
keyed the same way), and the model they talk to.

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
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from helpers.paths import USER_CACHE

ROOT = Path(__file__).resolve().parent.parent.parent
PINS = ROOT / "tests" / "agents" / "package.json"
AIDER_PINS = ROOT / "tests" / "agents" / "requirements-aider.txt"
#: Files copied next to the installed packages (Node resolves an ES module's imports from
#: the script's own folder, not from NODE_PATH).
SCRIPTS = ("ai_sdk_loop.mjs", "js_sdks.mjs")
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
    return Path(os.environ.get(CACHE_ENV) or USER_CACHE)


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
            _npm_install(folder, pins, timeout=900, quiet=False)
            marker.write_text(json.dumps(json.loads(pins)["dependencies"]) + "\n")
        for name in SCRIPTS:
            shutil.copyfile(PINS.parent / name, folder / name)
    return folder


def opencode_config() -> Path | None:
    """A folder to copy as OpenCode's config folder (``$XDG_CONFIG_HOME/opencode``): what
    OpenCode installs there on its first start, its plugin package at its own version,
    installed here once (beside the agents, under their lock) from the same npm cache.

    OpenCode's first start in a fresh home npm-installs that package (a few dozen
    packages from the registry) before it sends a request: every test run paid that, on
    the CPU the servers share, and needed the registry mid-test. A home whose config
    folder holds it is one where OpenCode has run before, as on a user's machine; what
    it sends afmd is the same. None when the install fails (OpenCode then installs the
    package itself, as it does in a fresh home)."""
    version = json.loads(PINS.read_bytes())["dependencies"]["opencode-ai"]
    root = cache_root()
    folder = root / f"opencode-config-{version}"
    marker = folder / ".installed"
    package = json.dumps({"dependencies": {"@opencode-ai/plugin": version}}, indent=2) + "\n"
    with _locked(root / "agents.lock"):
        if not marker.is_file():
            try:
                _npm_install(folder, package.encode(), timeout=300, quiet=True)
            except (subprocess.SubprocessError, OSError):
                return None
            marker.write_text(version + "\n")
    return folder


def _npm_install(folder: Path, package: bytes, *, timeout: float, quiet: bool) -> None:
    """``package`` (a package.json) installed into ``folder`` from the suite's npm cache,
    in a staging folder renamed into place once npm succeeded, so that an install cut
    short never passes for a finished one; a failure raises. ``quiet`` keeps npm's output
    out of the test's log (an install whose failure only costs time); the agents' own
    shows there. The caller holds the agents' lock."""
    root = cache_root()
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
    try:
        (staging / "package.json").write_bytes(package)
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error",
             "--cache", str(root / "npm")],
            cwd=staging, check=True, stdin=subprocess.DEVNULL, capture_output=quiet,
            timeout=timeout)
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def copy_opencode_config(dest: Path) -> None:
    """``dest`` (a home's ``$XDG_CONFIG_HOME/opencode``) made from :func:`opencode_config`:
    hard links where the file system allows, as the installed files are only read (npm
    replaces files, never writes one in place); nothing when there is none."""
    source = opencode_config()
    if source is None:
        return

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # another file system
            shutil.copy2(src, dst)

    shutil.copytree(source, dest, copy_function=link, symlinks=True,
                    ignore=shutil.ignore_patterns(".installed"))


class RegistryUnreachable(Exception):
    """pip could not reach the package index: the one reason a pinned tool may be skipped."""


#: What pip prints when the index cannot be reached (no network, no proxy, DNS down).
_UNREACHABLE = ("NewConnectionError", "Temporary failure in name resolution",
                "Name or service not known", "Network is unreachable",
                "No matching distribution found", "Could not find a version")


def aider_installed() -> Path:
    """The virtual environment whose bin/aider is the pinned aider, created on first use.

    A venv of its own, not the test venv: aider pins its own litellm, openai and httpx,
    which must not change what the SDK tests import. Raises RegistryUnreachable when pip
    cannot reach the index, CalledProcessError for any other failure."""
    pins = AIDER_PINS.read_bytes()
    root = cache_root()
    folder = root / f"aider-{hashlib.sha256(pins).hexdigest()[:16]}"
    marker = folder / ".installed"
    with _locked(root / "aider.lock"):
        if not marker.is_file():
            # Built in place: a venv's scripts name its interpreter by absolute path, so
            # it cannot be staged elsewhere and moved. The marker says it is complete.
            shutil.rmtree(folder, ignore_errors=True)
            venv = folder / "venv"
            try:
                subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True,
                               stdin=subprocess.DEVNULL, timeout=300)
                install = subprocess.run(
                    [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input",
                     "--disable-pip-version-check", "--quiet", "-r", str(AIDER_PINS)],
                    stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900,
                    check=False)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            if install.returncode != 0:
                shutil.rmtree(folder, ignore_errors=True)
                tail = install.stderr[-1500:]
                if any(sign in tail for sign in _UNREACHABLE):
                    raise RegistryUnreachable(tail)
                raise subprocess.CalledProcessError(
                    install.returncode, install.args, install.stdout, install.stderr)
            marker.write_text(pins.decode())
    return folder / "venv"


#: The end token's logit per unit of the hidden dimension it follows, by layers kept: one
#: layer's hidden states lean further from positive there, so it needs a steeper head for
#: the end token to be about as likely as after two.
END_SCALE = {2: 12.0, 1: 20.0}


def quick_model(dest: Path, layers: int = 2) -> Path:
    """The demo-32k model (its larger vocabulary makes an agent's prompt about a third
    fewer tokens to prefill), its head made to end a turn soon: only the end token's logit
    follows one hidden dimension, every other logit is 0, so the end token is likely
    wherever that dimension is positive. A real model for the engine; only the text it
    writes is (as the demo's) nonsense.

    ``layers=1`` keeps the first layer alone: a prefill then computes no attention (the
    one layer's keys and values follow from the embeddings; its attention output is only
    needed for the last token's logits), which is nearly all of what an agent's prompt of
    many thousand tokens costs on a CPU. What it writes differs from the two-layer model's,
    which some agents' flows depend on (see the agents' tests)."""
    import mlx.core as mx

    from afmd.engine.demo import builtin as demo

    demo.build("demo-32k", dest)
    path = dest / "model.safetensors"
    weights = mx.load(str(path))
    assert isinstance(weights, dict)
    config = json.loads((dest / "config.json").read_text())
    if layers != config["num_hidden_layers"]:
        assert 1 <= layers < config["num_hidden_layers"], layers
        kept = {f"model.layers.{i}." for i in range(layers)}
        weights = {name: value for name, value in weights.items()
                   if not name.startswith("model.layers.")
                   or any(name.startswith(prefix) for prefix in kept)}
        config["num_hidden_layers"] = layers
        (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    end = config["eos_token_id"][0]
    norm = mx.zeros_like(weights["model.norm.weight"])
    norm[0] = 1.0
    head = mx.zeros_like(weights["lm_head.weight"])
    head[end, 0] = END_SCALE[layers]
    weights["model.norm.weight"], weights["lm_head.weight"] = norm, head
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return dest
