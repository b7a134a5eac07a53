"""``afmd doctor``: what someone debugging an IDE plugin's connection needs, on one screen.

Which config file afmd reads (and whether it is valid), the endpoint to put in the plugin,
whether a server answers there and what its /health says, whether the port is taken and by
which process, and the models with their cache state. Standard library only, no MLX or
Sanic: it answers instantly, also from the frozen binary, also while afmd is down.

This module finds those things and the problems among them; the report and its text are
:mod:`afmd.cli.doctor_report`'s, the port's owners :mod:`afmd.cli.port_owners`'.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from afmd.cli import endpoint
from afmd.cli.doctor_report import Report, owner_text, render
from afmd.cli.port_owners import port_in_use, port_owners
from afmd.config.bounds import ConfigError
from afmd.config.load import BREW_PREFIXES, default_config_path, load_config
from afmd.config.sections import BUILTIN_SYSTEM_PATH, Config
from afmd.engine.apple import framework
from afmd.hub import cache as hubcache
from afmd.paths import cache_dir, huggingface_hub_cache, models_cache_dir

__all__ = ["describe_models", "diagnose", "run"]

_DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


# ---------------------------------------------------------------------------- config


def _locate_config(flag: str | None, env: dict[str, str]) -> tuple[str | None, str]:
    """(path, how it was chosen), by the same rules as ``afmd serve``."""
    if flag is not None:
        return flag, "--config"
    found = default_config_path(env=env)
    if found is None:
        return None, "none found: built-in defaults (no --config, $AFMD_CONFIG or Homebrew etc)"
    if env.get("AFMD_CONFIG"):
        return str(found), "$AFMD_CONFIG"
    return str(found), "Homebrew prefix"


def _brew_log(config_path: str | None, env: dict[str, str]) -> Path | None:
    """Where ``brew services`` writes afmd's log, if afmd looks Homebrew-installed."""
    prefixes = [env["HOMEBREW_PREFIX"]] if env.get("HOMEBREW_PREFIX") else []
    prefixes += list(BREW_PREFIXES)
    if config_path is not None:
        parts = Path(config_path).parts
        if parts[-3:] == ("etc", "afmd", "config.toml"):
            prefixes.insert(0, str(Path(*parts[:-3])))
    for prefix in prefixes:
        log = Path(prefix) / "var" / "log" / "afmd.log"
        if log.is_file():
            return log
    return None


# ---------------------------------------------------------------------------- models


def _model_state(path: str) -> tuple[str, str | None, bool]:
    """(kind, cache state, missing) of a configured model path."""
    if path == BUILTIN_SYSTEM_PATH:  # Apple's model: what the framework says now
        found = framework.availability()
        return "Apple on-device model", f"{found.status} ({found.detail})", False
    if path.startswith("afmd:"):
        variant = path.split(":", 1)[1]
        pattern = re.compile(rf"^{re.escape(variant)}-[0-9a-f]{{12}}$")
        root = models_cache_dir()
        built = sorted(
            entry for entry in (root.iterdir() if root.is_dir() else ())
            if pattern.match(entry.name) and all((entry / f).is_file() for f in _DEMO_FILES)
        )
        if built:
            return "built-in", f"built at {built[-1]}", False
        return "built-in", f"not built yet (built at first start into {root}, no download)", False
    local = Path(path).expanduser()
    if os.path.isdir(local):  # False where the OS refuses to look, as Path.is_dir is not
        ok = os.path.isfile(local / "config.json")
        return "local folder", ("present" if ok else "folder has no config.json"), not ok
    if path.startswith(("/", "~", ".")) or os.path.exists(local):
        return "local folder", f"missing: {local}", True
    if hubcache.REPO_ID.match(path):
        cached = hubcache.inspect(path)
        if cached is not None and cached.complete:
            return "Hugging Face repo", f"downloaded ({cached.snapshot})", False
        if cached is not None:
            return "Hugging Face repo", (f"partly downloaded ({cached.folder}): "
                                         f"`afmd pull {path}` completes it"), False
        return "Hugging Face repo", (f"not downloaded yet (`afmd pull {path}`, or fetched "
                                     "on first use)"), False
    return "unknown", f"neither a folder nor a Hugging Face repo id: {path}", True


def describe_models(config: Config, health: dict[str, Any] | None) -> list[dict[str, Any]]:
    aliases: dict[str, list[str]] = {}
    for alias, target in config.models.aliases.items():
        aliases.setdefault(target, []).append(alias)
    default = config.resolve_model(None)
    served = (health or {}).get("models", {})
    out = []
    for entry in config.models.model:
        kind, cache, missing = _model_state(entry.path)
        info: dict[str, Any] = {
            "id": entry.id, "path": entry.path, "kind": kind, "cache": cache,
            "default": default is not None and entry.id == default.id,
            "aliases": sorted(aliases.get(entry.id, [])), "missing": missing,
        }
        if entry.id in served:
            info["server_status"] = served[entry.id]
        out.append(info)
    return out


# ---------------------------------------------------------------------------- diagnose


def diagnose(config_flag: str | None = None, *, env: dict[str, str] | None = None,
             timeout: float = 2.0) -> Report:
    env = dict(os.environ if env is None else env)
    report = Report()
    report.config_path, report.config_source = _locate_config(config_flag, env)
    try:
        config = load_config(report.config_path, env=env)
    except ConfigError as exc:
        report.config_error = str(exc)
        report.problems.append(f"configuration error: {exc}")
        # So the rest can still be shown: the defaults under the environment's overrides
        # (the port or socket a server started with them listens on), or bare defaults if
        # the environment's values are what is invalid.
        try:
            config = load_config(None, env=env)
        except ConfigError:
            config = load_config(None, env={})

    server = config.server
    report.api_key_required = bool(server.api_key)
    report.unix_socket = server.unix_socket or None
    if server.host:
        report.endpoint = endpoint.url_of(server.host, server.port) + "/v1"

    # A running server: TCP first, the Unix socket when there is no TCP listener.
    where = endpoint.from_config(config)
    if where is not None:
        report.server = {"url": where.health_label(),
                         **endpoint.probe_health(where.connect(timeout), where.api_key),
                         "key_sent": bool(where.api_key)}
    else:
        report.server = {"answering": False, "error": "port 0: the OS picks a port at start"}
    health = report.server.get("health") if report.server.get("afmd") else None
    if where is not None and health is not None and not report.server.get("limited") \
            and endpoint.refuses_key(where.connect(timeout), where.api_key):
        report.server["key_refused"] = True
        report.api_key_required = True  # the endpoint's clients need it, whatever we read

    if server.host and server.port:
        in_use = port_in_use(server.host, server.port)
        owners, via = port_owners(server.port) if in_use else ([], "")
        report.port = {"host": server.host, "port": server.port, "in_use": in_use,
                       "owners": owners, "found_with": via}

    report.models = describe_models(config, health)
    if health is not None and isinstance(health.get("distributed"), dict):
        report.distributed = health["distributed"]  # every rank, through rank 0
    report.paths = {"cache": str(cache_dir()), "huggingface_cache": str(huggingface_hub_cache())}
    log = _brew_log(report.config_path, env)
    if log is not None:
        report.paths["log"] = str(log)

    _find_problems(report, config)
    return report


def _find_problems(report: Report, config: Config) -> None:
    """Problems make doctor exit 1; notes are worth knowing but normal."""
    srv, port = report.server, report.port
    if srv.get("answering") and not srv.get("afmd"):
        report.problems.append(
            f"something that is not afmd answers at {srv['url']} (HTTP {srv.get('http_status')})"
            + (f": {owner_text(port['owners'])}" if port.get("owners") else "")
        )
    elif srv.get("limited"):
        report.problems.append(f"afmd answers at {srv['url']} but shows its details only "
                               f"with its API key: {endpoint.key_advice(srv['key_sent'])}")
    elif srv.get("key_refused"):
        report.problems.append("the running afmd refuses API requests without its API key, "
                               f"which its clients need: {endpoint.key_advice(srv['key_sent'])}")
    elif srv.get("afmd") and srv.get("http_status") != 200:
        reason = srv["health"].get("reason", "unknown")
        report.problems.append(f"afmd answers but is not ready: /health {srv['http_status']} "
                               f"({reason}); see the server log")
    elif not srv.get("answering") and port.get("in_use"):
        who = owner_text(port["owners"]) or "a process doctor cannot see (another user?)"
        report.problems.append(f"port {port['port']} is taken by {who}, but no HTTP server "
                               "answers there; afmd serve would fail with exit code 1")
    for rank in report.distributed.get("ranks", []):
        if not rank.get("connected"):
            report.problems.append(f"rank {rank['rank']} of the launched group is not "
                                   "connected to rank 0")
    for model in report.models:
        if model["missing"]:
            report.problems.append(f"model {model['id']!r}: {model['cache']}")
        elif model["default"] and model["path"] == BUILTIN_SYSTEM_PATH \
                and not model["cache"].startswith("available"):
            report.problems.append(f"the default model {model['id']!r} (Apple's on-device "
                                   f"model) is {model['cache']}")
    if srv.get("afmd"):
        served = set(srv["health"].get("models", {}))
        configured = set(config.model_ids())
        if served and served != configured:
            report.notes.append(
                f"the running server serves {', '.join(sorted(served))}, this config lists "
                f"{', '.join(sorted(configured))}: it was started with other settings "
                "(another config file, --model or AFMD_* variables)"
            )


def run(config_flag: str | None, *, as_json: bool = False, timeout: float = 2.0) -> int:
    """The ``afmd doctor`` command: print the report, return its exit code."""
    report = diagnose(config_flag, timeout=timeout)
    try:
        print(json.dumps(report.as_dict(), indent=2) if as_json else render(report))
        sys.stdout.flush()
    except BrokenPipeError:  # `afmd doctor | head`: not an error
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return report.exit_code
