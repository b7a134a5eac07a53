"""``afmd doctor``: what someone debugging an IDE plugin's connection needs, on one screen.

Which config file afmd reads (and whether it is valid), the endpoint to put in the plugin,
whether a server answers there and what its /health says, whether the port is taken and by
which process, and the models with their cache state. Standard library only, no MLX or
Sanic: it answers instantly, also from the frozen binary, also while afmd is down.

Exit codes follow the other commands: 0 nothing wrong found, 1 a problem was found (listed
under "problems"), 2 the configuration is invalid.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afmd import __version__, endpoint, hubcache
from afmd.config import (
    BREW_PREFIXES,
    Config,
    ConfigError,
    default_config_path,
    load_config,
)
from afmd.paths import cache_dir, huggingface_hub_cache, models_cache_dir

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_CONFIG = 2

_DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass
class Report:
    """Everything doctor found; ``as_dict`` is the ``--json`` output."""

    version: str = __version__
    executable: str = sys.executable
    frozen: bool = bool(getattr(sys, "frozen", False))
    config_path: str | None = None
    config_source: str = ""
    config_error: str | None = None
    endpoint: str | None = None
    unix_socket: str | None = None
    api_key_required: bool = False
    server: dict[str, Any] = field(default_factory=dict)
    port: dict[str, Any] = field(default_factory=dict)
    models: list[dict[str, Any]] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.config_error is not None:
            return EXIT_CONFIG
        return EXIT_PROBLEM if self.problems else EXIT_OK

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "executable": self.executable,
            "frozen": self.frozen,
            "config": {"path": self.config_path, "source": self.config_source,
                       "error": self.config_error},
            "endpoint": self.endpoint,
            "unix_socket": self.unix_socket,
            "api_key_required": self.api_key_required,
            "server": self.server,
            "port": self.port,
            "models": self.models,
            "paths": self.paths,
            "problems": self.problems,
            "notes": self.notes,
            "exit_code": self.exit_code,
        }


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


# ---------------------------------------------------------------------------- port owner


def port_in_use(host: str, port: int) -> bool | None:
    """True if binding ``host:port`` fails with "address in use" (None: cannot tell)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return True if exc.errno == errno.EADDRINUSE else None
    return False


def _proc_listeners(port: int) -> set[int]:
    """Socket inodes listening on ``port``, from /proc/net/tcp{,6} (Linux)."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A = LISTEN
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def _proc_owners(port: int) -> list[dict[str, Any]]:
    inodes = _proc_listeners(port)
    if not inodes:
        return []
    wanted = {f"socket:[{inode}]" for inode in inodes}
    owners: list[dict[str, Any]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
        except OSError:
            continue  # another user's process, or gone
        if links & wanted:
            pid = int(entry.name)
            owners.append({"pid": pid, "command": _proc_cmdline(pid)})
    return owners


def _proc_cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def _lsof() -> str | None:
    return shutil.which("lsof") or next(
        (p for p in ("/usr/sbin/lsof", "/usr/bin/lsof") if os.path.exists(p)), None
    )


def _lsof_owners(port: int) -> list[dict[str, Any]]:
    lsof = _lsof()
    if lsof is None:
        return []
    try:
        out = subprocess.run(
            [lsof, "-nP", f"-iTCP:{port}", "-sTCP:LISTEN", "-Fpc"],
            capture_output=True, text=True, timeout=5, check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    owners: list[dict[str, Any]] = []
    for line in out.splitlines():
        if line.startswith("p") and line[1:].isdigit():
            owners.append({"pid": int(line[1:]), "command": ""})
        elif line.startswith("c") and owners:
            owners[-1]["command"] = line[1:]
    for owner in owners:
        full = _ps_command(owner["pid"])
        if full:
            owner["command"] = full
    return owners


def _ps_command(pid: int) -> str:
    if os.path.exists(f"/proc/{pid}/cmdline"):
        return _proc_cmdline(pid)
    try:
        return subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)],
            capture_output=True, text=True, timeout=5, check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def port_owners(port: int) -> tuple[list[dict[str, Any]], str]:
    """Processes listening on ``port`` and how they were found ("/proc", "lsof" or "")."""
    if os.path.isdir("/proc/net"):
        owners = _proc_owners(port)
        if owners:
            return owners, "/proc"
    owners = _lsof_owners(port)
    return owners, ("lsof" if owners else "")


# ---------------------------------------------------------------------------- models


def _model_state(path: str) -> tuple[str, str | None, bool]:
    """(kind, cache state, missing) of a configured model path."""
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
    if local.is_dir():
        ok = (local / "config.json").is_file()
        return "local folder", ("present" if ok else "folder has no config.json"), not ok
    if path.startswith(("/", "~", ".")) or local.exists():
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
        config = load_config(None, env={})  # so the rest can still be shown (defaults)

    server = config.server
    report.api_key_required = bool(server.api_key)
    report.unix_socket = server.unix_socket or None
    if server.host:
        report.endpoint = endpoint.url_of(server.host, server.port) + "/v1"

    # A running server: TCP first, the Unix socket when there is no TCP listener.
    where = endpoint.from_config(config)
    if where is not None:
        report.server = {"url": where.health_label(),
                         **endpoint.probe_health(where.connect(timeout), where.api_key)}
    else:
        report.server = {"answering": False, "error": "port 0: the OS picks a port at start"}
    health = report.server.get("health") if report.server.get("afmd") else None

    if server.host and server.port:
        in_use = port_in_use(server.host, server.port)
        owners, via = port_owners(server.port) if in_use else ([], "")
        report.port = {"host": server.host, "port": server.port, "in_use": in_use,
                       "owners": owners, "found_with": via}

    report.models = describe_models(config, health)
    report.paths = {"cache": str(cache_dir()), "huggingface_cache": str(huggingface_hub_cache())}
    log = _brew_log(report.config_path, env)
    if log is not None:
        report.paths["log"] = str(log)

    _find_problems(report, config)
    return report


def _owner_text(owners: list[dict[str, Any]]) -> str:
    return ", ".join(f"pid {o['pid']} ({o['command'] or '?'})" for o in owners)


def _find_problems(report: Report, config: Config) -> None:
    """Problems make doctor exit 1; notes are worth knowing but normal."""
    srv, port = report.server, report.port
    if srv.get("answering") and not srv.get("afmd"):
        report.problems.append(
            f"something that is not afmd answers at {srv['url']} (HTTP {srv.get('http_status')})"
            + (f": {_owner_text(port['owners'])}" if port.get("owners") else "")
        )
    elif srv.get("afmd") and srv.get("http_status") != 200:
        reason = srv["health"].get("reason", "unknown")
        report.problems.append(f"afmd answers but is not ready: /health {srv['http_status']} "
                               f"({reason}); see the server log")
    elif not srv.get("answering") and port.get("in_use"):
        who = _owner_text(port["owners"]) or "a process doctor cannot see (another user?)"
        report.problems.append(f"port {port['port']} is taken by {who}, but no HTTP server "
                               "answers there; afmd serve would fail with exit code 1")
    for model in report.models:
        if model["missing"]:
            report.problems.append(f"model {model['id']!r}: {model['cache']}")
    if srv.get("afmd"):
        served = set(srv["health"].get("models", {}))
        configured = set(config.model_ids())
        if served and served != configured:
            report.notes.append(
                f"the running server serves {', '.join(sorted(served))}, this config lists "
                f"{', '.join(sorted(configured))}: it was started with other settings "
                "(another config file, --model or AFMD_* variables)"
            )


# ---------------------------------------------------------------------------- output


def render(report: Report) -> str:
    lines = [f"afmd {report.version}  ({'frozen binary' if report.frozen else 'Python'}: "
             f"{report.executable})", ""]
    lines.append(f"config     {report.config_path or '-'}")
    lines.append(f"           from: {report.config_source}")
    if report.config_error:
        lines.append(f"           INVALID: {report.config_error} (showing defaults below)")
    elif report.config_path:
        lines.append("           valid")
    lines.append(f"endpoint   {report.endpoint or '(no TCP listener)'}"
                 + ("   (needs Authorization: Bearer <server.api_key>)"
                    if report.api_key_required else "   (no API key needed)"))
    if report.unix_socket:
        lines.append(f"           unix socket {report.unix_socket}")

    srv = report.server
    if srv.get("afmd"):
        health = srv["health"]
        lines.append(f"server     running: {srv['url']} -> HTTP {srv['http_status']} "
                     f"{health.get('status')}"
                     f"{' (' + health['reason'] + ')' if health.get('reason') else ''}; "
                     f"active {health.get('active_requests')}, "
                     f"queued {health.get('queued_requests')}")
    elif srv.get("answering"):
        lines.append(f"server     {srv['url']} answers HTTP {srv.get('http_status')}, "
                     "but not as afmd")
    else:
        lines.append(f"server     not answering at {srv.get('url', '-')} ({srv.get('error')})")

    port = report.port
    if port:
        where = f"{port['host']}:{port['port']}"
        if port["in_use"] is None:
            lines.append(f"port       {where}: cannot tell (bind refused for another reason)")
        elif not port["in_use"]:
            lines.append(f"port       {where} is free")
        elif port["owners"]:
            lines.append(f"port       {where} is in use by {_owner_text(port['owners'])} "
                         f"(via {port['found_with']})")
        else:
            lines.append(f"port       {where} is in use (owner not visible: try "
                         f"`sudo lsof -nP -iTCP:{port['port']} -sTCP:LISTEN`)")

    lines.append("models")
    for model in report.models:
        tags = [t for t in ("default" if model["default"] else "",
                            ("aliases: " + ", ".join(model["aliases"])) if model["aliases"]
                            else "") if t]
        status = f"; server: {model['server_status']}" if "server_status" in model else ""
        lines.append(f"  {model['id']:<14} {model['kind']}: {model['path']}"
                     f"{' (' + '; '.join(tags) + ')' if tags else ''}")
        lines.append(f"  {'':<14} {model['cache']}{status}")
    lines.append("paths")
    for name, value in report.paths.items():
        lines.append(f"  {name:<18} {value}")
    lines.append("")
    lines.extend(f"note: {note}" for note in report.notes)
    if report.problems:
        lines.append("problems")
        lines.extend(f"  - {problem}" for problem in report.problems)
    else:
        lines.append("no problems found")
    return "\n".join(lines)


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
