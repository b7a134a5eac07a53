"""Ports chosen now for a process that binds them later.

A port the OS hands out (``bind(0)``) lies in the range it also takes connections' source
ports from, and a process that binds seconds after the choice can find it taken by any
connection the machine opened meanwhile, or by another ``bind(0)`` (a test run's servers
open thousands of both). Ports below that range are handed out by no one: a random place
there, checked free, stays free unless someone names it on purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: The lowest port looked at (the registered ports below it are left to the services
#: that own them).
PORTS_FROM = 20000

#: Where a machine with nothing free below its source ports gets its ports instead.
_LAST_RESORT = 32323


def first_source_port() -> int:
    """Where the range the OS takes connections' source ports (and ``bind(0)``'s) from
    begins."""
    try:  # Linux
        low, _ = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low)
    except (OSError, ValueError):
        return 49152  # macOS's, IANA's dynamic range


def free_ports(n: int = 1, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive ports free on ``host`` now, below the source ports
    where there is room (one the OS picks otherwise)."""
    low = first_source_port()
    rng = random.SystemRandom()
    for _ in range(50):
        if low - n > PORTS_FROM:
            first = rng.randrange(PORTS_FROM, low - n)
        else:
            with socket.socket() as probe:
                probe.bind((host, 0))
                first = probe.getsockname()[1]
        if first + n > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                held.append(s)
                s.bind((host, port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    return _LAST_RESORT


def host_port(host: str, port: int) -> str:
    """``host:port`` as a person or a URL reads it: an IPv6 address in brackets, since
    ``::1:18091`` could be read as an address ending in ``:18091``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
