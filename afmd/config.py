"""Typed afmd configuration: one TOML file, then ``AFMD_*`` env vars, then CLI flags.

Everything the server can be told lives here as frozen dataclasses so the rest of
the code reads plain attributes and never re-parses or re-validates input. All
problems surface as :class:`ConfigError` with a dotted key (``server.port``,
``models.model[1].path``, ``env AFMD_SERVER_PORT``) so the CLI can point the user
at the exact setting to fix. Ranges and cross-references are checked only after
all layers are merged, so a bad file value that an env var or flag replaces is
not an error.

This module is the lowest layer of afmd and imports nothing else from it.
"""

import dataclasses
import difflib
import json
import math
import os
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

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
#: What a model serves: chat (chat completions) or embedding (/v1/embeddings).
MODEL_KINDS = ("chat", "embedding")

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
_ENV_TRUE = ("true", "1", "yes")
_ENV_FALSE = ("false", "0", "no")


class ConfigError(Exception):
    """Any configuration problem; ``key`` names the setting so callers need not parse prose."""

    def __init__(self, key: str, message: str) -> None:
        # Both go to Exception so the error survives pickling (e.g. across processes).
        super().__init__(key, message)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


@dataclass(frozen=True)
class ServerConfig:
    """HTTP listener and request limits; the limits bound memory per client."""

    host: str = "127.0.0.1"  # "" = no TCP listener
    port: int = 9999  # 0 = let the OS pick a free port
    unix_socket: str = ""
    api_key: str = ""
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_request_body_bytes: int = 16777216
    max_header_bytes: int = 65536
    max_connections: int = 64
    max_buffered_request_bytes: int = 67108864
    idle_timeout: float = 30.0
    request_timeout: float = 120.0
    shutdown_grace: float = 10.0
    instructions: str = ""
    instructions_file: str = ""  # read at startup; joined after `instructions`


@dataclass(frozen=True)
class QueueConfig:
    """Admission control: the GPU runs a few generations, the rest wait or are refused."""

    max_concurrent_requests: int = 4
    max_queued_requests: int = 64


@dataclass(frozen=True)
class FimSetting:
    """A model's fill-in-the-middle markers, named by the operator where afmd cannot read
    them from the tokenizer (see afmd/fim.py for the families it detects)."""

    prefix: str
    suffix: str
    middle: str = ""  # "": none, the middle follows the prefix (as Codestral's)
    suffix_first: bool = False  # suffix, then prefix (Codestral's order)
    stop: tuple[str, ...] = ()  # markers that end the middle, besides end-of-sequence


@dataclass(frozen=True)
class ModelEntry:
    """One servable model; ``path`` is a local MLX folder, a HF repo id or a builtin ``afmd:``."""

    id: str
    path: str
    context_length: int | None = None
    kind: str | None = None  # one of MODEL_KINDS; None: read from the model's own config
    fim: FimSetting | None = None  # None: detected from the tokenizer, if it has markers


#: Always served, so a fresh install answers requests without downloading anything.
BUILTIN_MODELS: tuple[ModelEntry, ...] = (
    ModelEntry(id=DEMO_MODEL_ID, path=BUILTIN_DEMO_PATH),
    ModelEntry(id=DEMO_32K_MODEL_ID, path=BUILTIN_DEMO_32K_PATH),
    ModelEntry(id=DEMO_EMBEDDING_MODEL_ID, path=BUILTIN_DEMO_EMBEDDING_PATH, kind="embedding"),
)


@dataclass(frozen=True)
class ModelsConfig:
    """Served models; the default includes the builtins so ``ModelsConfig()`` is usable as is."""

    default: str = DEMO_MODEL_ID
    aliases: dict[str, str] = field(default_factory=dict)
    model: tuple[ModelEntry, ...] = BUILTIN_MODELS


@dataclass(frozen=True)
class LogConfig:
    """Logging; json is the default because logs are usually read by tools."""

    level: str = "info"
    format: str = "json"
    access_log: bool = True


@dataclass(frozen=True)
class CacheConfig:
    """Memory bounds of the prefix KV cache and of MLX's buffer pool (memory, not entry
    count, is what runs out first)."""

    prompt_cache_bytes: int = 1073741824  # 0 disables the cache
    prompt_cache_entries: int = 16
    # MLX's pool of freed buffers kept for reuse (mx.set_cache_limit); 0 keeps none.
    mlx_buffer_cache_bytes: int = 268435456


@dataclass(frozen=True)
class EngineConfig:
    """Engine resilience knobs."""

    retries: int = 2
    retry_backoff: float = 0.2  # seconds before the first retry; doubles each time


@dataclass(frozen=True)
class ServerTool:
    """A tool afmd runs itself: a command (JSON arguments on stdin, JSON on stdout)."""

    name: str
    description: str = ""
    parameters: dict[str, object] = field(default_factory=lambda: {"type": "object"})
    command: tuple[str, ...] = ()
    python: str = ""  # "path/to/file.py:function", loaded by path
    timeout: float = 5.0
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    max_output_bytes: int = 65536


@dataclass(frozen=True)
class ToolsConfig:
    """Budgets for server tools, and the tools themselves."""

    max_rounds: int = 4  # generation rounds per request that run server tools
    max_calls: int = 16  # server tool calls per request
    server: tuple[ServerTool, ...] = ()


@dataclass(frozen=True)
class ContextConfig:
    """What to do when a prompt does not fit the model's context window."""

    policy: str = "fail"


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
}
# Structured fields: only a TOML file can express them sensibly.
_STRUCTURED = {("models", "aliases"), ("models", "model"), ("tools", "server")}
_ENTRY_KEYS = ("id", "path", "context_length", "kind", "fim")
_FIM_KEYS = ("prefix", "suffix", "middle", "suffix_first", "stop")

_KIND_NAMES = {
    "bool": "boolean",
    "int": "integer",
    "float": "number",
    "str": "string",
    "strlist": "array of strings",
    "optint": "integer",
}


def _kind_of(tp: object) -> str:
    """Reduce a field annotation to the handful of shapes config values can take."""
    simple = {bool: "bool", int: "int", float: "float", str: "str"}
    if isinstance(tp, type) and tp in simple:
        return simple[tp]
    if tp == tuple[str, ...]:
        return "strlist"
    if tp == (int | None):
        return "optint"
    raise TypeError(f"unsupported config field type {tp!r}")


_FIELDS: dict[str, dict[str, str]] = {
    section: {
        f.name: _kind_of(f.type)
        for f in dataclasses.fields(cls)
        if (section, f.name) not in _STRUCTURED
    }
    for section, cls in _SECTIONS.items()
}
_ALL_KEYS: dict[str, list[str]] = {
    section: [f.name for f in dataclasses.fields(cls)] for section, cls in _SECTIONS.items()
}


def _env_name(section: str, name: str) -> str:
    return f"AFMD_{section.upper()}_{name.upper()}"


# --------------------------------------------------------------------------- helpers


def _describe(value: object) -> str:
    """Render a bad value the way the user wrote it (TOML-ish), clipped for long input."""
    if isinstance(value, bool):
        text, kind = ("true" if value else "false"), "boolean"
    elif isinstance(value, int):
        text, kind = str(value), "integer"
    elif isinstance(value, float):
        text, kind = repr(value), "float"
    elif isinstance(value, str):
        text, kind = json.dumps(value, ensure_ascii=False), "string"
    elif isinstance(value, list | tuple):
        text, kind = "[...]", "array"
    elif isinstance(value, dict):
        text, kind = "{...}", "table"
    else:
        text, kind = str(value), type(value).__name__
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


def _suggest(name: str, candidates: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _toml_key(name: str) -> str:
    """Quote a table key only when TOML would need it, so error keys can be pasted back."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _other_section_with(name: str, exclude: str | None = None) -> str | None:
    for section, keys in _ALL_KEYS.items():
        if section != exclude and name in keys:
            return section
    return None


def _unknown_key(section: str, name: str) -> ConfigError:
    key = f"{section}.{name}"
    elsewhere = _other_section_with(name, exclude=section)
    if elsewhere is not None:
        hint = f"; it belongs in [{elsewhere}] ({elsewhere}.{name})"
    else:
        hint = _suggest(name, _ALL_KEYS[section])
    return ConfigError(key, f"unknown key {name!r} in [{section}]{hint}")


def _unknown_section(name: str, value: object) -> ConfigError:
    what = "section" if isinstance(value, dict) else "top-level key"
    elsewhere = _other_section_with(name)
    if elsewhere is not None:
        hint = f"; did you mean {elsewhere}.{name} (under [{elsewhere}])?"
    else:
        hint = _suggest(name, _SECTIONS)
    return ConfigError(name, f"unknown {what} {name!r}{hint}")


def _coerce(value: object, kind: str, key: str) -> object:
    """Accept a typed value (TOML or programmatic) strictly: bool is never an int."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and is_int:
        return value
    if kind == "float" and (is_int or isinstance(value, float)):
        return float(value)  # type: ignore[arg-type]  # int or float, checked above
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "optint" and (value is None or is_int):
        return value
    if kind == "strlist" and isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{key}[{i}]", f"expected string, got {_describe(item)}")
        return tuple(value)
    raise ConfigError(key, f"expected {_KIND_NAMES[kind]}, got {_describe(value)}")


def _parse_text(text: str, kind: str, key: str) -> object:
    """Parse an env var / CLI string by the field's type, since those only carry text."""
    stripped = text.strip()
    if kind == "str":
        return text
    if kind == "bool":
        lowered = stripped.lower()
        if lowered in _ENV_TRUE:
            return True
        if lowered in _ENV_FALSE:
            return False
        raise ConfigError(key, f"expected a boolean (true/false/1/0/yes/no), got {text!r}")
    if kind == "strlist":
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if kind == "optint" and stripped == "":
        return None
    try:
        return float(stripped) if kind == "float" else int(stripped)
    except ValueError:
        raise ConfigError(key, f"expected {_KIND_NAMES[kind]}, got {text!r}") from None


# --------------------------------------------------------------------------- layers


@dataclass
class _Merged:
    """Mutable scratch state while layering; ``origin`` feeds "(from X)" in messages."""

    values: dict[str, dict[str, object]] = field(
        default_factory=lambda: {section: {} for section in _SECTIONS}
    )
    origin: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    entries: list[ModelEntry] = field(default_factory=list)
    server_tools: list[ServerTool] = field(default_factory=list)
    model_flag: str | None = None

    def set(self, section: str, name: str, value: object, origin: str) -> None:
        self.values[section][name] = value
        self.origin[f"{section}.{name}"] = origin


def _read_toml(path: str | os.PathLike[str]) -> dict[str, object]:
    where = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(where, "config file not found") from None
    except IsADirectoryError:
        raise ConfigError(where, "config path is a directory, not a file") from None
    except OSError as exc:
        raise ConfigError(where, f"cannot read config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(where, f"config file is not valid UTF-8: {exc.reason}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(where, f"invalid TOML: {exc}") from None


def _apply_file(data: Mapping[str, object], merged: _Merged) -> None:
    for section, table in data.items():
        if section not in _SECTIONS:
            raise _unknown_section(section, table)
        if not isinstance(table, dict):
            raise ConfigError(section, f"expected a table [{section}], got {_describe(table)}")
        for name, value in table.items():
            key = f"{section}.{name}"
            if (section, name) == ("models", "aliases"):
                merged.aliases = _parse_aliases(value)
            elif (section, name) == ("models", "model"):
                merged.entries = _parse_entries(value)
            elif (section, name) == ("tools", "server"):
                merged.server_tools = _parse_server_tools(value)
            elif name in _FIELDS[section]:
                merged.set(section, name, _coerce(value, _FIELDS[section][name], key), "file")
            else:
                raise _unknown_key(section, name)


def _parse_aliases(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError("models.aliases", f"expected a table, got {_describe(value)}")
    aliases: dict[str, str] = {}
    for name, target in value.items():
        key = f"models.aliases.{_toml_key(name)}"
        if not isinstance(target, str):
            raise ConfigError(key, f"expected string (a model id), got {_describe(target)}")
        if not target:
            raise ConfigError(key, "must name a model id, got an empty string")
        aliases[name] = target
    return aliases


def _table_array(
    value: object, key: str, allowed: tuple[str, ...]
) -> Iterator[tuple[int, str, dict[str, object]]]:
    """The tables of a ``[[key]]`` array, each checked to hold only ``allowed`` keys."""
    if not isinstance(value, list):
        raise ConfigError(key, f"expected an array of [[{key}]] tables, got {_describe(value)}")
    for i, item in enumerate(value):
        base = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(base, f"expected a table, got {_describe(item)}")
        for name in item:
            if name not in allowed:
                raise ConfigError(
                    f"{base}.{name}",
                    f"unknown key {name!r} in [[{key}]]{_suggest(name, allowed)}",
                )
        yield i, base, item


def _parse_entries(value: object) -> list[ModelEntry]:
    entries: list[ModelEntry] = []
    first_index: dict[str, int] = {}
    for i, base, item in _table_array(value, "models.model", _ENTRY_KEYS):
        for required in ("id", "path"):
            if required not in item:
                raise ConfigError(f"{base}.{required}", f"missing: every model needs {required!r}")
            if _coerce(item[required], "str", f"{base}.{required}") == "":
                raise ConfigError(f"{base}.{required}", "must not be empty")
        ctx = _coerce(item.get("context_length"), "optint", f"{base}.context_length")
        if isinstance(ctx, int) and ctx < 1:
            raise ConfigError(f"{base}.context_length", f"must be >= 1, got {ctx}")
        model_id: str = item["id"]
        path: str = item["path"]
        if model_id in first_index:
            raise ConfigError(
                f"{base}.id",
                f"duplicate model id {model_id!r} (already used by models.model"
                f"[{first_index[model_id]}])",
            )
        first_index[model_id] = i
        context_length = ctx if isinstance(ctx, int) else None
        kind: str | None = None
        if "kind" in item:
            kind = str(_coerce(item["kind"], "str", f"{base}.kind"))
            if kind not in MODEL_KINDS:
                raise ConfigError(
                    f"{base}.kind",
                    f"must be one of {'|'.join(MODEL_KINDS)}, got {kind!r}"
                    f"{_suggest(kind, MODEL_KINDS)}",
                )
        fim = _parse_fim(item["fim"], f"{base}.fim") if "fim" in item else None
        entries.append(ModelEntry(id=model_id, path=path, context_length=context_length,
                                  kind=kind, fim=fim))
    return entries


def _parse_fim(value: object, key: str) -> FimSetting:
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a table {{prefix, suffix, middle}}, got "
                               f"{_describe(value)}")
    for name in value:
        if name not in _FIM_KEYS:
            raise ConfigError(f"{key}.{name}", f"unknown key {name!r} in fim"
                                               f"{_suggest(name, _FIM_KEYS)}")
    markers: dict[str, str] = {}
    for name in ("prefix", "suffix", "middle"):
        if name not in value and name != "middle":
            raise ConfigError(f"{key}.{name}", f"missing: a fim setting needs {name!r}")
        markers[name] = str(_coerce(value.get(name, ""), "str", f"{key}.{name}"))
        if name != "middle" and not markers[name]:
            raise ConfigError(f"{key}.{name}", "must not be empty")
    suffix_first = bool(_coerce(value.get("suffix_first", False), "bool",
                                f"{key}.suffix_first"))
    if not markers["middle"] and not suffix_first:
        raise ConfigError(f"{key}.middle", "missing: needed unless suffix_first = true")
    stop = _coerce(value.get("stop", []), "strlist", f"{key}.stop")
    assert isinstance(stop, tuple | list)
    return FimSetting(prefix=markers["prefix"], suffix=markers["suffix"],
                      middle=markers["middle"], suffix_first=suffix_first,
                      stop=tuple(str(s) for s in stop if s))


_SERVER_TOOL_KEYS = tuple(f.name for f in dataclasses.fields(ServerTool))
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _parse_server_tools(value: object) -> list[ServerTool]:
    tools: list[ServerTool] = []
    names: set[str] = set()
    for _, base, item in _table_array(value, "tools.server", _SERVER_TOOL_KEYS):
        if "name" not in item:
            raise ConfigError(f"{base}.name", "missing: every server tool needs 'name'")
        name = _coerce(item["name"], "str", f"{base}.name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ConfigError(f"{base}.name", "must be 1-64 characters among A-Z a-z 0-9 _ -")
        if name in names:
            raise ConfigError(f"{base}.name", f"duplicate server tool name {name!r}")
        names.add(name)
        command = _coerce(item.get("command", []), "strlist", f"{base}.command")
        python = _coerce(item.get("python", ""), "str", f"{base}.python")
        if bool(command) == bool(python):
            raise ConfigError(base, "set exactly one of 'command' (an argv array) or 'python'")
        if python and ":" not in str(python):
            raise ConfigError(f"{base}.python", "expected 'path/to/file.py:function'")
        parameters = item.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ConfigError(f"{base}.parameters", "expected a table (a JSON Schema)")
        env = item.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ConfigError(f"{base}.env", "expected a table of strings")
        timeout = _coerce(item.get("timeout", 5.0), "float", f"{base}.timeout")
        if not isinstance(timeout, float) or not 0 < timeout <= 3600:
            raise ConfigError(f"{base}.timeout", "must be > 0 and <= 3600 seconds")
        max_out = _coerce(item.get("max_output_bytes", 65536), "int", f"{base}.max_output_bytes")
        if not isinstance(max_out, int) or max_out < 1:
            raise ConfigError(f"{base}.max_output_bytes", "must be >= 1")
        tools.append(
            ServerTool(
                name=name,
                description=str(_coerce(item.get("description", ""), "str",
                                        f"{base}.description")),
                parameters=dict(parameters),
                command=tuple(command),  # type: ignore[arg-type]
                python=str(python),
                timeout=timeout,
                cwd=str(_coerce(item.get("cwd", ""), "str", f"{base}.cwd")),
                env=dict(env),
                max_output_bytes=max_out,
            )
        )
    return tools


def _apply_env(env: Mapping[str, str], merged: _Merged) -> None:
    # Iterate known names rather than env itself: unknown AFMD_* vars (including
    # AFMD_CONFIG / AFMD_CACHE_DIR) are simply never looked at.
    for section, fields in _FIELDS.items():
        for name, kind in fields.items():
            var = _env_name(section, name)
            if var in env:
                value = _parse_text(env[var], kind, f"env {var}")
                merged.set(section, name, value, var)


def _apply_overrides(overrides: Mapping[str, object], merged: _Merged) -> None:
    every_key = [f"{s}.{n}" for s, names in _ALL_KEYS.items() for n in names]
    for dotted, value in overrides.items():
        # None = "flag not given", which is what argparse hands over for unset options.
        if value is None:
            continue
        if dotted == "model":
            if not isinstance(value, str) or not value:
                raise ConfigError("model", f"expected a model id or path, got {_describe(value)}")
            merged.model_flag = value
            continue
        section, _, name = dotted.partition(".")
        if section not in _SECTIONS or name not in _ALL_KEYS[section]:
            raise ConfigError(dotted, f"unknown setting{_suggest(dotted, [*every_key, 'model'])}")
        if (section, name) in _STRUCTURED:
            raise ConfigError(dotted, "can only be set in the config file")
        kind = _FIELDS[section][name]
        if isinstance(value, str) and kind != "str":
            parsed = _parse_text(value, kind, dotted)
        else:
            parsed = _coerce(value, kind, dotted)
        merged.set(section, name, parsed, "command line")


# --------------------------------------------------------------------------- validation


def _from(merged: _Merged, key: str) -> str:
    origin = merged.origin.get(key)
    return f" (from {origin})" if origin and origin != "file" else ""


def _check_min(merged: _Merged, section: str, name: str, value: float, minimum: float) -> None:
    key = f"{section}.{name}"
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}{_from(merged, key)}")
    if value < minimum:
        raise ConfigError(key, f"must be >= {minimum:g}, got {value!r}{_from(merged, key)}")


def _check_choice(
    merged: _Merged, section: str, name: str, value: str, choices: tuple[str, ...]
) -> str:
    key = f"{section}.{name}"
    normalized = value.strip().lower()
    if normalized not in choices:
        allowed = "|".join(choices)
        raise ConfigError(
            key,
            f"must be one of {allowed}, got {value!r}{_suggest(normalized, choices)}"
            f"{_from(merged, key)}",
        )
    return normalized


# Lower bounds; 1 where 0 would make the server unable to serve anything at all.
_MINIMUMS: dict[str, dict[str, float]] = {
    "server": {
        "max_request_body_bytes": 1,
        "max_header_bytes": 1,
        "max_connections": 1,
        "max_buffered_request_bytes": 0,
        "idle_timeout": 0,
        "request_timeout": 0,
        "shutdown_grace": 0,
    },
    "queue": {"max_concurrent_requests": 1, "max_queued_requests": 0},
    "cache": {"prompt_cache_bytes": 0, "prompt_cache_entries": 0, "mlx_buffer_cache_bytes": 0},
    "engine": {"retries": 0, "retry_backoff": 0},
    "tools": {"max_rounds": 1, "max_calls": 1},
}


def _validate_server(merged: _Merged, server: ServerConfig) -> ServerConfig:
    if not 0 <= server.port <= 65535:
        raise ConfigError(
            "server.port",
            f"must be between 0 and 65535, got {server.port}{_from(merged, 'server.port')}",
        )
    if server.host == "" and server.unix_socket == "":
        raise ConfigError("server.host", "no listener: set host or unix_socket")
    if len(os.fsencode(server.unix_socket)) > _UNIX_PATH_MAX:
        raise ConfigError(
            "server.unix_socket",
            f"path is longer than the OS limit of {_UNIX_PATH_MAX} bytes"
            f"{_from(merged, 'server.unix_socket')}",
        )
    if server.instructions_file:
        try:
            text = Path(server.instructions_file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                "server.instructions_file",
                f"cannot read {server.instructions_file!r}: {getattr(exc, 'strerror', exc)}"
                f"{_from(merged, 'server.instructions_file')}",
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
        key = f"models.aliases.{_toml_key(name)}"
        if name in ids:
            raise ConfigError(key, f"alias {name!r} is also a model id; pick another alias name")
        if target not in ids:
            raise ConfigError(
                key,
                f"points to unknown model {target!r}{_suggest(target, ids)} "
                f"(known: {', '.join(sorted(ids))})",
            )


def _validate_default(merged: _Merged, models: ModelsConfig) -> None:
    ids = [entry.id for entry in models.model]
    if models.default not in ids and models.default not in models.aliases:
        raise ConfigError(
            "models.default",
            f"{models.default!r} is neither a model id nor an alias"
            f"{_suggest(models.default, [*ids, *models.aliases])}{_from(merged, 'models.default')}",
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
    merged = _Merged()
    if path is not None:
        _apply_file(_read_toml(path), merged)
    _apply_env(os.environ if env is None else env, merged)
    if overrides:
        _apply_overrides(overrides, merged)

    cfg = Config(
        **{section: cls(**merged.values[section]) for section, cls in _SECTIONS.items()},
        source=None if path is None else os.fspath(path),
    )
    cfg = dataclasses.replace(
        cfg, tools=dataclasses.replace(cfg.tools, server=tuple(merged.server_tools))
    )

    file_ids = {entry.id for entry in merged.entries}
    entries = (*merged.entries, *(b for b in BUILTIN_MODELS if b.id not in file_ids))
    models = dataclasses.replace(cfg.models, aliases=dict(merged.aliases), model=entries)
    # Aliases are checked before --model so that a flag naming an alias can be trusted,
    # and the default after it because --model replaces whatever default was set.
    _validate_aliases(models)
    if merged.model_flag is not None:
        models = _apply_model_flag(merged.model_flag, models)
    _validate_default(merged, models)

    for section, minimums in _MINIMUMS.items():
        for name, minimum in minimums.items():
            _check_min(merged, section, name, getattr(getattr(cfg, section), name), minimum)

    return dataclasses.replace(
        cfg,
        server=_validate_server(merged, cfg.server),
        models=models,
        log=dataclasses.replace(
            cfg.log,
            level=_check_choice(merged, "log", "level", cfg.log.level, _LOG_LEVELS),
            format=_check_choice(merged, "log", "format", cfg.log.format, _LOG_FORMATS),
        ),
        context=dataclasses.replace(
            cfg.context,
            policy=_check_choice(
                merged, "context", "policy", cfg.context.policy, _CONTEXT_POLICIES
            ),
        ),
    )


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
