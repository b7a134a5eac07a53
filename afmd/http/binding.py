"""Binding the configured listeners, each with the protocol its place calls for."""

from __future__ import annotations

from typing import Any

from afmd.config import ServerConfig
from afmd.http.connections import GateContext
from afmd.http.listeners import Listeners, bind_tcp, bind_unix, is_loopback
from afmd.http.protocol import make_protocol


def protocol_for(server: ServerConfig, gate: GateContext, kind: str, host: str = "") -> Any:
    """One protocol class per listener: whether it checks Host depends on where it is.

    The Unix socket and loopback TCP are what a DNS-rebinding page would reach, so they
    always check; a listener on another interface checks only when allowed_hosts says
    which names are valid. ``"*"`` in allowed_hosts turns the check off. Only this
    machine reaches those two, so they serve ``/metrics`` without the API key.
    """
    loopback = kind == "tcp" and is_loopback(host)
    check = kind == "unix" or loopback or bool(server.allowed_hosts)
    extra = (host,) if loopback else ()
    policy = gate.policy(check_host=check, extra_hosts=extra, local=kind == "unix" or loopback)
    return make_protocol(gate, policy, kind)


def bind_listeners(server: ServerConfig, gate: GateContext, listeners: Listeners) -> None:
    """Bind the TCP listener and the Unix socket the config names (either may be off)."""
    if server.host:
        sock = bind_tcp(server.host, server.port)
        listeners.add("tcp", sock.getsockname(), sock, protocol_for(server, gate, "tcp",
                                                                    server.host))
    if server.unix_socket:
        sock = bind_unix(server.unix_socket)
        listeners.add("unix", server.unix_socket, sock, protocol_for(server, gate, "unix"))
