"""What a group of processes sends each other over loopback, and pausing such a group.

Two counters, because each alone misleads on a shared machine. ``/proc/net/dev``'s
``lo`` line counts every loopback byte on the host, headers included: the group's ring
and control traffic, the benchmark's own HTTP, and whatever else runs beside it. The
kernel's per-socket TCP counters (``ss -ti``: ``bytes_received``) count payload only,
socket by socket, so summing them over the sockets that join two of the group's own
processes gives the bytes between ranks and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

_ADDRESS = re.compile(r"^(?:\[[0-9a-fA-F:.%\w]+\]|[\w.*%-]+):(\d+|\*)$")
_PID = re.compile(r"pid=(\d+)")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


def loopback_bytes(text: str | None = None) -> int | None:
    """Bytes received on ``lo`` so far (on loopback every byte sent is received once).

    ``text``: a ``/proc/net/dev`` to read instead of this host's.
    """
    if text is None:
        try:
            text = Path("/proc/net/dev").read_text()
        except OSError:
            return None
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == "lo":
            return int(rest.split()[0])
    return None


def socket_table(text: str) -> list[tuple[str, str, set[int], int]]:
    """``ss -tinpH``'s sockets as (local, peer, owning pids, bytes received).

    Each socket is a line of addresses and owners followed by an indented line of its
    TCP counters; a counter left out (nothing received yet) counts as 0.
    """
    out: list[tuple[str, str, set[int], int]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            addresses = [f for f in line.split() if _ADDRESS.match(f)]
            if len(addresses) >= 2:
                pids = {int(p) for p in _PID.findall(line)}
                out.append((addresses[0], addresses[1], pids, 0))
            continue
        if out:
            got = _RECEIVED.search(line)
            if got:
                local, peer, pids, _ = out[-1]
                out[-1] = (local, peer, pids, int(got.group(1)))
    return out


def between(table: list[tuple[str, str, set[int], int]], pids: Iterable[int]) -> int:
    """Payload bytes received on sockets whose both ends belong to ``pids``: every byte
    one of them sent another, counted once (at the end that received it)."""
    mine = set(pids)
    ends = {local for local, _, owners, _ in table if owners & mine}
    return sum(got for local, peer, owners, got in table
               if owners & mine and local in ends and peer in ends)


def rank_bytes(pids: Iterable[int]) -> int | None:
    """Payload bytes the processes ``pids`` have sent each other over TCP so far (their
    open sockets only: the ring and control channels live as long as the group)."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    try:
        done = subprocess.run([ss, "-tinpH"], capture_output=True, text=True, timeout=10,
                              check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return between(socket_table(done.stdout), pids)


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (``afmd launch`` starts MLX's launcher in a
    session of its own, so a process group would miss the ranks)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def pause(pids: Iterable[int]) -> None:
    """Stop them, so that nothing of theirs takes CPU from the system being measured
    (a group idles in several processes: its supervisor, MLX's launcher, the ranks)."""
    signal_all(pids, signal.SIGSTOP)


def resume(pids: Iterable[int]) -> None:
    signal_all(pids, signal.SIGCONT)
