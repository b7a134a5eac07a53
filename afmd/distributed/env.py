"""What a rank learns from its environment: that it was launched, and where rank 0 is.

``mlx.launch`` sets ``MLX_RANK`` and, per backend, a hostfile (ring) or a coordinator
address (JACCL); ``afmd launch`` adds its own variables (named here) for the backend and
the folder where rank 0 leaves its pid and outcome.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

BACKEND_ENV = "AFMD_DISTRIBUTED_BACKEND"
LAUNCH_DIR_ENV = "AFMD_LAUNCH_DIR"
SUPERVISOR_ENV = "AFMD_LAUNCH_PID"
PID_FILE = "rank0.pid"
OUTCOME_FILE = "outcome"


def launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one rank of a group started by ``afmd launch``."""
    env = os.environ if env is None else env
    return "MLX_RANK" in env and BACKEND_ENV in env


def backend(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get(BACKEND_ENV, "any")


def leader_host(env: Mapping[str, str] | None = None) -> str:
    """Rank 0's address as the other ranks reach it (its first ring address, or the
    JACCL coordinator's host); loopback when the launcher says nothing."""
    env = os.environ if env is None else env
    coordinator = env.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    hostfile = env.get("MLX_HOSTFILE")
    if hostfile:
        try:
            hosts = json.loads(Path(hostfile).read_text() or "[]")
            return str(hosts[0][0]).rsplit(":", 1)[0]
        except (OSError, ValueError, IndexError, TypeError):
            pass
    return "127.0.0.1"


def launch_dir(env: Mapping[str, str] | None = None) -> Path | None:
    env = os.environ if env is None else env
    value = env.get(LAUNCH_DIR_ENV)
    return Path(value) if value else None


def write_outcome(code: int, reason: str = "") -> None:
    """Rank 0's exit, for ``afmd launch``: the launcher under it reports none."""
    folder = launch_dir()
    if folder is not None and folder.is_dir():
        (folder / OUTCOME_FILE).write_text(f"{code} {reason}".strip() + "\n")


def write_pid() -> None:
    folder = launch_dir()
    if folder is not None and folder.is_dir():
        (folder / PID_FILE).write_text(f"{os.getpid()}\n")


def supervisor_gone(env: Mapping[str, str] | None = None) -> bool:
    """Whether the ``afmd launch`` that started this group has exited (killed, say): the
    group then stops, rather than serve on with nobody to stop it or report its end."""
    env = os.environ if env is None else env
    try:
        pid = int(env.get(SUPERVISOR_ENV, ""))
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
