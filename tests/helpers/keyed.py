"""A real ``afmd serve`` with ``[server] api_key`` on every interface, and the address of
this machine's own that reaches it as another machine would.

afmd shows /health's details to a loopback client without the key, so what a client
command gets from a keyed LAN listener is only seen through a non-loopback address: the
one this machine's default route leaves from (a UDP socket "connected" to a documentation
address sends nothing and needs no network, only a route).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from helpers.servers import start_server

KEY = "the-servers-key"


def own_address() -> str:
    """This machine's non-loopback IPv4 address (the test fails without one: it needs it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        address = str(probe.getsockname()[0])
    assert not address.startswith("127."), address
    return address


@contextmanager
def keyed_afmd(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """The keyed server's non-loopback host and port while the block runs."""
    host = own_address()
    server = start_server(tmp_path, config=f'[server]\nhost = "0.0.0.0"\napi_key = "{KEY}"\n')
    try:
        yield host, server.port
    finally:
        server.stop()
