"""Typed afmd configuration: one TOML file, then ``AFMD_*`` env vars, then CLI flags.

Everything the server can be told lives here as frozen dataclasses so the rest of
the code reads plain attributes and never re-parses or re-validates input. All
problems surface as :class:`ConfigError` with a dotted key (``server.port``,
``models.model[1].path``, ``env AFMD_SERVER_PORT``) so the CLI can point the user
at the exact setting to fix. Ranges and cross-references are checked only after
all layers are merged, so a bad file value that an env var or flag replaces is
not an error.

A setting's bounds and choices are its field's metadata (``at_least``, ``between``,
``one_of``), checked by one walker (afmd.config_fields); afmd.config_layers merges the
file, env and flags, and afmd.config_tables reads the arrays of tables. This module and
those three are afmd's lowest layer and import nothing else from it.
"""

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from afmd.config_fields import (
    ConfigError,
    at_least,
    between,
    check_fields,
    one_of,
    suggest,
    toml_key,
)
from afmd.config_layers import Merged, Schema, apply_env, apply_file, apply_overrides, read_toml
from afmd.config_tables import (
    MODEL_KINDS,
    FimSetting,
    ModelEntry,
    ServerTool,
    parse_aliases,
    parse_entries,
    parse_server_tools,
)

__all__ = [
    "BREW_PREFIXES",
    "BUILTIN_DEMO_32K_PATH",
    "BUILTIN_DEMO_EMBEDDING_PATH",
    "BUILTIN_DEMO_PATH",
    "BUILTIN_MODELS",
    "DEMO_32K_MODEL_ID",
    "DEMO_EMBEDDING_MODEL_ID",
    "DEMO_MODEL_ID",
    "MODEL_KINDS",
    "ApiConfig",
    "CacheConfig",
    "Config",
    "ConfigError",
    "ContextConfig",
    "EngineConfig",
    "FimSetting",
    "LogConfig",
    "ModelEntry",
    "ModelsConfig",
    "QueueConfig",
    "ResponsesConfig",
    "ServerConfig",
    "default_config_path",
    "load_config",
]

DEMO_MODEL_ID = "demo"
BUILTIN_DEMO_PATH = "afmd:demo"
DEMO_32K_MODEL_ID = "demo-32k"
BUILTIN_DEMO_32K_PATH = "afmd:demo-32k"
DEMO_EMBEDDING_MODEL_ID = "demo-embedding"
BUILTIN_DEMO_EMBEDDING_PATH = "afmd:demo-embedding"
DEMO_VISION_MODEL_ID = "demo-vision"
BUILTIN_DEMO_VISION_PATH = "afmd:demo-vision"

#: Homebrew prefixes searched (in order, after ``$HOMEBREW_PREFIX``) for
#: ``etc/afmd/config.toml``; module-level so tests can point it elsewhere.
BREW_PREFIXES: tuple[str, ...] = ("/opt/homebrew", "/usr/local", "/home/linuxbrew/.linuxbrew")

# Slack added on top of one maximal request so that header parsing and framing
# overhead never makes a request that is within both limits unbufferable.
_BUFFER_SLACK = 262144

# sun_path is 104 bytes on macOS/BSD and 108 on Linux, NUL terminator included;
# catching it here gives a clear message instead of an opaque bind() failure.
_UNIX_PATH_MAX = 103 if sys.platform != "linux" else 107

_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("json", "console")
_CONTEXT_POLICIES = ("fail", "trim")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP listener and request limits; the limits bound memory per client."""

    host: str = "127.0.0.1"  # "" = no TCP listener
    port: int = field(default=9999, metadata=between(0, 65535))  # 0: the OS picks a port
    unix_socket: str = ""
    api_key: str = ""
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    # At least 1 where 0 would leave the server unable to serve anything at all.
    max_request_body_bytes: int = field(default=16777216, metadata=at_least(1))
    max_header_bytes: int = field(default=65536, metadata=at_least(1))
    max_connections: int = field(default=64, metadata=at_least(1))
    max_buffered_request_bytes: int = field(default=67108864, metadata=at_least(0))
    idle_timeout: float = field(default=30.0, metadata=at_least(0))
    request_timeout: float = field(default=120.0, metadata=at_least(0))
    shutdown_grace: float = field(default=10.0, metadata=at_least(0))
    instructions: str = ""
    instructions_file: str = ""  # read at startup; joined after `instructions`


@dataclass(frozen=True)
class QueueConfig:
    """Admission control: the GPU runs a few generations, the rest wait or are refused."""

    max_concurrent_requests: int = field(default=4, metadata=at_least(1))
    max_queued_requests: int = field(default=64, metadata=at_least(0))


#: Always served, so a fresh install answers requests without downloading anything.
BUILTIN_MODELS: tuple[ModelEntry, ...] = (
    ModelEntry(id=DEMO_MODEL_ID, path=BUILTIN_DEMO_PATH),
    ModelEntry(id=DEMO_32K_MODEL_ID, path=BUILTIN_DEMO_32K_PATH),
    ModelEntry(id=DEMO_EMBEDDING_MODEL_ID, path=BUILTIN_DEMO_EMBEDDING_PATH, kind="embedding"),
    ModelEntry(id=DEMO_VISION_MODEL_ID, path=BUILTIN_DEMO_VISION_PATH, kind="vision"),
)


@dataclass(frozen=True)
class ModelsConfig:
    """Served models; the default includes the builtins so ``ModelsConfig()`` is usable as is."""

    default: str = DEMO_MODEL_ID
    # Bytes the loaded models may take together (weights and KV caches, measured); 0: a
    # share of physical memory, 60 % on macOS and 50 % on Linux (afmd/engine/budget.py).
    memory_budget_bytes: int = field(default=0, metadata=at_least(0))
    # Models loaded at once; one more unloads the least recently used idle one first.
    max_loaded: int = field(default=3, metadata=at_least(1))
    # Seconds an idle model stays loaded: -1 forever, 0 unloaded after each request.
    keep_alive: float = field(default=300.0, metadata=at_least(-1))
    # Pixels (width x height) an image part may have, checked before it is decoded: a
    # decoded picture takes three bytes a pixel, however small its file.
    max_image_pixels: int = field(default=33554432, metadata=at_least(1))
    aliases: dict[str, str] = field(default_factory=dict)
    model: tuple[ModelEntry, ...] = BUILTIN_MODELS

    def keep_alive_of(self, entry: ModelEntry) -> float:
        """The model's own keep-alive, else ``[models] keep_alive``."""
        return self.keep_alive if entry.keep_alive is None else entry.keep_alive

    def preloads(self, entry: ModelEntry) -> bool:
        """Whether ``entry`` loads at start: its ``preload``, else whether it is the
        default model (the built-in demo unless another is configured)."""
        if entry.preload is not None:
            return entry.preload
        return self.aliases.get(self.default, self.default) == entry.id


@dataclass(frozen=True)
class LogConfig:
    """Logging; json is the default because logs are usually read by tools."""

    level: str = field(default="info", metadata=one_of(*_LOG_LEVELS))
    format: str = field(default="json", metadata=one_of(*_LOG_FORMATS))
    access_log: bool = True


@dataclass(frozen=True)
class CacheConfig:
    """Memory bounds of the prefix KV cache and of MLX's buffer pool (memory, not entry
    count, is what runs out first)."""

    prompt_cache_bytes: int = field(default=1073741824, metadata=at_least(0))  # 0: no cache
    prompt_cache_entries: int = field(default=16, metadata=at_least(0))
    # MLX's pool of freed buffers kept for reuse (mx.set_cache_limit); 0 keeps none.
    mlx_buffer_cache_bytes: int = field(default=268435456, metadata=at_least(0))


@dataclass(frozen=True)
class EngineConfig:
    """Engine resilience knobs."""

    retries: int = field(default=2, metadata=at_least(0))
    # Seconds before the first retry; doubles each time.
    retry_backoff: float = field(default=0.2, metadata=at_least(0))
    # Speculate with n-grams of the prompt (and the output so far) for a request decoding
    # alone: verified, so it changes no token; it stops itself where it does not pay.
    prompt_lookup: bool = True


@dataclass(frozen=True)
class ToolsConfig:
    """Budgets for server tools, and the tools themselves."""

    # Generation rounds per request that run server tools, and server tool calls.
    max_rounds: int = field(default=4, metadata=at_least(1))
    max_calls: int = field(default=16, metadata=at_least(1))
    server: tuple[ServerTool, ...] = ()


@dataclass(frozen=True)
class ContextConfig:
    """What to do when a prompt does not fit the model's context window."""

    policy: str = field(default="fail", metadata=one_of(*_CONTEXT_POLICIES))


@dataclass(frozen=True)
class ResponsesConfig:
    """The Responses API's store of responses (``store``, ``previous_response_id``)."""

    # Responses kept, the oldest leaving first; 0 keeps none.
    max_stored: int = field(default=1000, metadata=at_least(0))
    # Seconds a response is kept after it was made; 0: no limit.
    ttl: float = field(default=86400.0, metadata=at_least(0))
    persist: bool = False  # also under the cache folder, so a restart keeps them


@dataclass(frozen=True)
class ApiConfig:
    """How request bodies are read."""

    # Unknown top-level fields: False ignores them (listed in X-AFM-Ignored-Fields), as
    # IDE plugins sending other servers' fields need; True refuses them, as OpenAI does.
    strict: bool = False


@dataclass(frozen=True)
class Config:
    """The whole, validated configuration; ``source`` says which file (if any) fed it."""

    server: ServerConfig = field(default_factory=ServerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    source: str | None = None

    def model_ids(self) -> tuple[str, ...]:
        """Model ids in configuration order (aliases excluded: they are not distinct models)."""
        return tuple(entry.id for entry in self.models.model)

    def resolve_model(self, name: str | None = None) -> ModelEntry | None:
        """Map a request's ``model`` field to an entry; None means "use the default"."""
        target = self.models.default if name is None else name
        target = self.models.aliases.get(target, target)
        for entry in self.models.model:
            if entry.id == target:
                return entry
        return None


# --------------------------------------------------------------------------- schema

_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "queue": QueueConfig,
    "models": ModelsConfig,
    "log": LogConfig,
    "cache": CacheConfig,
    "engine": EngineConfig,
    "context": ContextConfig,
    "tools": ToolsConfig,
    "responses": ResponsesConfig,
    "api": ApiConfig,
}


# Structured fields: only a TOML file can express them sensibly.
_SCHEMA = Schema(
    _SECTIONS,
    {
        ("models", "aliases"): parse_aliases,
        ("models", "model"): parse_entries,
        ("tools", "server"): parse_server_tools,
    },
)


# --------------------------------------------------------------------------- validation


def _validate_server(merged: Merged, server: ServerConfig) -> ServerConfig:
    """The server's rules across fields (a listener, the socket path, the instructions
    file, the buffer floor); each field's own bounds are its metadata's."""
    if server.host == "" and server.unix_socket == "":
        raise ConfigError("server.host", "no listener: set host or unix_socket")
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


def _validate_aliases(models: ModelsConfig) -> None:
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


def _validate_drafts(models: ModelsConfig) -> None:
    ids = {entry.id for entry in models.model}
    for i, entry in enumerate(models.model):
        if entry.draft is not None and entry.draft not in ids:
            raise ConfigError(
                f"models.model[{i}].draft",
                f"unknown model {entry.draft!r}{suggest(entry.draft, ids)} "
                f"(known: {', '.join(sorted(ids))})",
            )


def _validate_default(merged: Merged, models: ModelsConfig) -> None:
    ids = [entry.id for entry in models.model]
    if models.default not in ids and models.default not in models.aliases:
        raise ConfigError(
            "models.default",
            f"{models.default!r} is neither a model id nor an alias"
            f"{suggest(models.default, [*ids, *models.aliases])}{merged.where('models.default')}",
        )


def _apply_model_flag(flag: str, models: ModelsConfig) -> ModelsConfig:
    """``--model``: pick a known model, or serve a path / HF repo id that is not configured."""
    ids = {entry.id for entry in models.model}
    if flag in ids or flag in models.aliases:
        return dataclasses.replace(models, default=flag)
    for entry in models.model:
        # Already configured under another id: reuse it instead of loading it twice.
        if entry.path == flag:
            return dataclasses.replace(models, default=entry.id)
    model_id = flag
    local = os.path.expanduser(flag)  # the engine expands "~" too, so match it
    if os.path.isdir(local):
        base = os.path.basename(os.path.abspath(local))
        # The folder name reads better in /v1/models, unless it would collide.
        if base and base not in ids and base not in models.aliases:
            model_id = base
    entry = ModelEntry(id=model_id, path=flag)
    return dataclasses.replace(models, model=(*models.model, entry), default=model_id)


# --------------------------------------------------------------------------- public API


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Build the effective config: defaults < file < ``AFMD_*`` env < ``overrides``.

    ``path`` None means "no file" (the caller decides whether to consult
    :func:`default_config_path`). ``env`` None means ``os.environ``; tests pass a
    dict so the developer's shell cannot leak in. ``overrides`` takes dotted keys
    plus ``"model"`` for ``--model``; None values are skipped so argparse results
    can be passed straight through. Raises :class:`ConfigError`.
    """
    merged = Merged(_SCHEMA)
    if path is not None:
        apply_file(read_toml(path), merged)
    apply_env(os.environ if env is None else env, merged)
    if overrides:
        apply_overrides(overrides, merged)

    cfg = Config(
        **{section: cls(**merged.values[section]) for section, cls in _SECTIONS.items()},
        source=None if path is None else os.fspath(path),
    )
    tables = cast(dict[tuple[str, str], Any], merged.structured)
    server_tools = tables.get(("tools", "server"), [])
    cfg = dataclasses.replace(cfg, tools=dataclasses.replace(cfg.tools, server=tuple(server_tools)))

    file_entries = tables.get(("models", "model"), [])
    file_ids = {entry.id for entry in file_entries}
    entries = (*file_entries, *(b for b in BUILTIN_MODELS if b.id not in file_ids))
    aliases = dict(tables.get(("models", "aliases"), {}))
    models = dataclasses.replace(cfg.models, aliases=aliases, model=entries)
    # Aliases are checked before --model so that a flag naming an alias can be trusted,
    # and the default after it because --model replaces whatever default was set.
    _validate_aliases(models)
    _validate_drafts(models)
    if merged.model_flag is not None:
        models = _apply_model_flag(merged.model_flag, models)
    _validate_default(merged, models)

    # Every field's bounds and choices (its metadata), section by section, then the rules
    # across fields.
    checked = {
        section: check_fields(getattr(cfg, section), section, merged.where)
        for section in _SECTIONS
    }
    cfg = dataclasses.replace(cfg, **checked)
    return dataclasses.replace(cfg, server=_validate_server(merged, cfg.server), models=models)


def default_config_path(*, env: Mapping[str, str] | None = None) -> Path | None:
    """Where ``afmd`` looks when no ``--config`` is given.

    ``$AFMD_CONFIG`` is returned even if the file is missing, so a typo in it is
    reported by :func:`load_config` rather than silently ignored. Otherwise the
    Homebrew ``etc`` locations are probed, ``$HOMEBREW_PREFIX`` first, because
    that is where the formula installs the config users are told to edit.
    """
    env = os.environ if env is None else env
    explicit = env.get("AFMD_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    prefixes = list(BREW_PREFIXES)
    if env.get("HOMEBREW_PREFIX"):
        prefixes.insert(0, env["HOMEBREW_PREFIX"])
    for prefix in prefixes:
        candidate = Path(prefix) / "etc" / "afmd" / "config.toml"
        if candidate.is_file():
            return candidate
    return None
