"""The configuration's rules across settings and tables, beyond each field's own bounds.

They run once every layer (file, env, flags) is merged, so a bad value that a later layer
replaces is not an error; each raises :class:`ConfigError` with the key to fix and, through
:meth:`Merged.where`, the layer that set it.
"""

import dataclasses
import ipaddress
import os
import sys
from pathlib import Path

from afmd.config.bounds import ConfigError, suggest, toml_key
from afmd.config.layers import Merged
from afmd.config.sections import ModelsConfig, ServerConfig
from afmd.config.tables import ModelEntry
from afmd.hub.cache import plain_name

# Slack added on top of one maximal request so that header parsing and framing
# overhead never makes a request that is within both limits unbufferable.
_BUFFER_SLACK = 262144

# sun_path is 104 bytes on macOS/BSD and 108 on Linux, NUL terminator included;
# catching it here gives a clear message instead of an opaque bind() failure.
_UNIX_PATH_MAX = 103 if sys.platform != "linux" else 107


def validate_server(merged: Merged, server: ServerConfig) -> ServerConfig:
    """The server's rules across fields (a listener, the socket path, the instructions
    file, the buffer floor); each field's own bounds are its metadata's."""
    if server.host == "" and server.unix_socket == "":
        raise ConfigError("server.host", "no listener: set host or unix_socket")
    problem = _host_problem(server.host)
    if problem is not None:
        raise ConfigError("server.host", f"{problem}, got {server.host!r}"
                                         f"{merged.where('server.host')}")
    if server.unix_socket.startswith("~"):
        # "~" is the home folder here as in every other path the config names; bound as
        # is, it was a folder named "~" in whatever the working directory was.
        server = dataclasses.replace(server,
                                     unix_socket=os.path.expanduser(server.unix_socket))
    if len(os.fsencode(server.unix_socket)) > _UNIX_PATH_MAX:
        raise ConfigError(
            "server.unix_socket",
            f"path is longer than the OS limit of {_UNIX_PATH_MAX} bytes"
            f"{merged.where('server.unix_socket')}",
        )
    if server.instructions_file:
        try:
            text = Path(server.instructions_file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                "server.instructions_file",
                f"cannot read {server.instructions_file!r}: {getattr(exc, 'strerror', exc)}"
                f"{merged.where('server.instructions_file')}",
            ) from None
        joined = "\n\n".join(part for part in (server.instructions, text.strip()) if part)
        server = dataclasses.replace(server, instructions=joined)
    floor = server.max_request_body_bytes + server.max_header_bytes + _BUFFER_SLACK
    if server.max_buffered_request_bytes < floor:
        # Raised rather than rejected: a buffer smaller than one maximal request is
        # never what was meant, and the other two limits state the intent precisely.
        server = dataclasses.replace(server, max_buffered_request_bytes=floor)
    return server


def _host_problem(host: str) -> str | None:
    """What makes ``host`` no address to listen on, whatever the network says: caught
    here, a URL or a port written into it is exit 2 naming the key, not a bind that
    fails at start (a ":" makes the socket IPv6, so "127.0.0.1:8080" cannot bind)."""
    if not host:
        return None
    if any(c.isspace() for c in host):
        return "an address or host name has no spaces"
    if "/" in host or (":" in host and not _is_ipv6(host)):
        return ("expected an address or host name such as 127.0.0.1, 0.0.0.0 or ::1, "
                "not a URL or an address with a port (the port is server.port)")
    return None


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def validate_aliases(models: ModelsConfig) -> None:
    ids = {entry.id for entry in models.model}
    for name, target in models.aliases.items():
        key = f"models.aliases.{toml_key(name)}"
        if name in ids:
            raise ConfigError(key, f"alias {name!r} is also a model id; pick another alias name")
        if target not in ids:
            raise ConfigError(
                key,
                f"points to unknown model {target!r}{suggest(target, ids)} "
                f"(known: {', '.join(sorted(ids))})",
            )


def validate_drafts(models: ModelsConfig) -> None:
    ids = {entry.id for entry in models.model}
    for i, entry in enumerate(models.model):
        if entry.draft is not None and entry.draft not in ids:
            raise ConfigError(
                f"models.model[{i}].draft",
                f"unknown model {entry.draft!r}{suggest(entry.draft, ids)} "
                f"(known: {', '.join(sorted(ids))})",
            )


def validate_default(merged: Merged, models: ModelsConfig) -> None:
    ids = [entry.id for entry in models.model]
    if models.default not in ids and models.default not in models.aliases:
        raise ConfigError(
            "models.default",
            f"{models.default!r} is neither a model id nor an alias"
            f"{suggest(models.default, [*ids, *models.aliases])}{merged.where('models.default')}",
        )


def apply_model_flag(flag: str, models: ModelsConfig) -> ModelsConfig:
    """``--model``: pick a known model, or serve a path / HF repo id that is not configured."""
    ids = {entry.id for entry in models.model}
    if flag in ids or flag in models.aliases:
        return dataclasses.replace(models, default=flag)
    for entry in models.model:
        # Already configured under another id: reuse it instead of loading it twice.
        if entry.path == flag:
            return dataclasses.replace(models, default=entry.id)
    local = os.path.expanduser(flag)  # the engine expands "~" too, so match it
    plain = plain_name(flag)
    if plain and plain != flag and not os.path.isdir(local):  # `--model hf.co/OWNER/NAME:latest`
        return apply_model_flag(plain, models)
    model_id = flag
    if os.path.isdir(local):
        base = os.path.basename(os.path.abspath(local))
        # The folder name reads better in /v1/models, unless it would collide.
        if base and base not in ids and base not in models.aliases:
            model_id = base
    entry = ModelEntry(id=model_id, path=flag)
    return dataclasses.replace(models, model=(*models.model, entry), default=model_id)
