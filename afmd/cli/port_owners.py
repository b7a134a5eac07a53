"""Which processes listen on a TCP port: /proc on Linux, lsof elsewhere (macOS).

``afmd doctor`` names them when afmd's port is taken, so that someone whose server will not
start sees what holds it. Standard library only; a process of another user may stay
invisible (then the caller says so).
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["find_lsof", "holder_text", "is_afmd", "lsof_owners", "owner_text", "port_in_use",
           "port_owners"]


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


def find_lsof() -> str | None:
    return shutil.which("lsof") or next(
        (p for p in ("/usr/sbin/lsof", "/usr/bin/lsof") if os.path.exists(p)), None
    )


def lsof_owners(port: int) -> list[dict[str, Any]]:
    lsof = find_lsof()
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
    owners = lsof_owners(port)
    return owners, ("lsof" if owners else "")


def owner_text(owners: list[dict[str, Any]]) -> str:
    """The processes holding a port, as doctor and the bind errors name them."""
    return ", ".join(f"pid {o['pid']} ({o['command'] or '?'})" for o in owners)


def is_afmd(command: str) -> bool:
    """Whether a command line is an afmd's: its binary or script (``afmd serve``,
    ``python …/bin/afmd serve``) or ``python -m afmd``. A guess from the words alone, good
    enough to choose between "another afmd" and a program's name in a message."""
    words = command.split()
    if any(os.path.basename(word) == "afmd" for word in words[:2]):
        return True
    return any(word == "-m" and module.split(".")[0] == "afmd"
               for word, module in itertools.pairwise(words))


def holder_text(port: int) -> str:
    """Who holds a TCP port, for the sentence that says it is taken: another afmd, or the
    program by pid and command line. Only where the holder is not visible (another user's
    process) is another afmd the guess, since a second start of the service is the usual
    cause. This process is left out: a listener rebuilt while its old socket lingers."""
    owners = [o for o in port_owners(port)[0] if o["pid"] != os.getpid()]
    if not owners:
        return "(is another afmd running? `afmd doctor` tells what holds it)"
    if all(is_afmd(o["command"]) for o in owners):
        return f"by another afmd, {owner_text(owners)}: stop it or choose another port"
    return f"by {owner_text(owners)}: stop it or choose another port"
