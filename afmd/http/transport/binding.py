"""Binding the configured listeners, each with the protocol its place calls for."""

from __future__ import annotations

import socket

from afmd.cli.port_owners import owner_text, port_in_use, port_owners
from afmd.config.sections import ServerConfig
from afmd.http.transport.connection import AfmdProtocol, make_protocol
from afmd.http.transport.connection_limits import GateContext
from afmd.http.transport.listeners import Listeners, StartupError, bind_tcp, bind_unix, is_loopback
from afmd.ports import host_port

#: Where ``[ollama] port`` listens: this machine only, as Ollama does by default.
OLLAMA_HOST = "127.0.0.1"


def protocol_for(
    server: ServerConfig, gate: GateContext, kind: str, host: str = ""
) -> type[AfmdProtocol]:
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


def bind_ollama(port: int) -> socket.socket:
    """``[ollama] port``'s socket on loopback; a port already taken stops the start with a
    sentence naming what holds it (as ``afmd doctor`` finds it)."""
    if port_in_use(OLLAMA_HOST, port):
        owners, _ = port_owners(port)
        # Named, the holder needs no guess; unseen, Ollama's own app is the likely one.
        who = owner_text(owners) or ("a process afmd cannot see (another user's? an Ollama "
                                     "app or `ollama serve`?)")
        raise StartupError(
            f"cannot listen on {host_port(OLLAMA_HOST, port)} for [ollama] port: the port is "
            f"in use by {who}. Stop it or set another [ollama] port (0 turns the listener "
            "off)")
    return bind_tcp(OLLAMA_HOST, port)


def bind_listeners(server: ServerConfig, gate: GateContext, listeners: Listeners,
                   ollama_port: int = 0) -> None:
    """Bind the TCP listener and the Unix socket the config names (either may be off), and
    ``[ollama] port``'s loopback listener when set."""
    if server.host:
        sock = bind_tcp(server.host, server.port)
        listeners.add("tcp", sock.getsockname(), sock, protocol_for(server, gate, "tcp",
                                                                    server.host))
    if server.unix_socket:
        sock = bind_unix(server.unix_socket)
        listeners.add("unix", server.unix_socket, sock, protocol_for(server, gate, "unix"))
    if ollama_port:
        if server.host and server.port == ollama_port and is_loopback(server.host):
            raise StartupError(f"[ollama] port {ollama_port} is [server] port too: choose "
                               "another (Ollama's own is 11434), or 0 for no second listener")
        sock = bind_ollama(ollama_port)
        listeners.add("tcp", sock.getsockname(), sock,
                      protocol_for(server, gate, "tcp", OLLAMA_HOST))
