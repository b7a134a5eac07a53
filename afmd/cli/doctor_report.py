"""What ``afmd doctor`` found, and its two forms: the ``--json`` object and the screen text.

Exit codes follow the other commands: 0 nothing wrong found, 1 a problem was found (listed
under "problems"), 2 the configuration is invalid.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from afmd import __version__
from afmd.cli.port_owners import owner_text
from afmd.ports import host_port

__all__ = ["EXIT_CONFIG", "EXIT_OK", "EXIT_PROBLEM", "Report", "owner_text", "render"]

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_CONFIG = 2


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
    #: A launched group's ranks as rank 0's /health reports them (empty: one process).
    distributed: dict[str, Any] = field(default_factory=dict)
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
            "distributed": self.distributed,
            "paths": self.paths,
            "problems": self.problems,
            "notes": self.notes,
            "exit_code": self.exit_code,
        }


def render(report: Report) -> str:
    """The report for a person: one section a line, aligned, the problems last."""
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
    if srv.get("limited"):  # its status alone: the counts are the key's to see
        lines.append(f"server     running: {srv['url']} -> HTTP {srv['http_status']} "
                     f"{srv['health'].get('status')}; details only with its API key")
    elif srv.get("afmd"):
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
        where = host_port(port["host"], port["port"])
        if port["in_use"] is None:
            lines.append(f"port       {where}: cannot tell (bind refused for another reason)")
        elif not port["in_use"]:
            lines.append(f"port       {where} is free")
        elif port["owners"]:
            lines.append(f"port       {where} is in use by {owner_text(port['owners'])} "
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
    if report.distributed:
        group = report.distributed
        lines.append(f"ranks      {group.get('size')} ({group.get('strategy')})"
                     + (f": {group['lost']} ({group.get('detail')})" if group.get("lost") else ""))
        for rank in group.get("ranks", []):
            memory = ", ".join(f"{k.removesuffix('_bytes')} {v / 2**20:.1f} MiB"
                               for k, v in rank.get("memory", {}).items())
            state = "" if rank.get("connected") else "  NOT CONNECTED"
            lines.append(f"  rank {rank['rank']:<3} {rank.get('host')} pid {rank.get('pid')}: "
                         f"{rank.get('shard')}; {memory or 'memory unknown'}{state}")
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
