"""The arrays of tables in a config file: ``[models.aliases]``, ``[[models.model]]`` (with
its ``fim`` table) and ``[[tools.server]]``.

Only a TOML file can express these, so they are read as the file is, each entry checked as
a whole (required keys, duplicates, rules across its keys) with the dotted key of the exact
value at fault (``models.model[1].path``). Part of afmd's lowest layer, under afmd.config.load.
"""

import dataclasses
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from afmd.config.bounds import ConfigError, coerce, describe, suggest, toml_key
from afmd.hub.cache import plain_name

__all__ = [
    "MODEL_KINDS",
    "FimSetting",
    "ModelEntry",
    "ServerTool",
    "parse_aliases",
    "parse_entries",
    "parse_server_tools",
]

#: What a model serves: chat (chat completions), embedding (/v1/embeddings) or vision (chat
#: with images, loaded through mlx-vlm).
MODEL_KINDS = ("chat", "embedding", "vision")
_ENTRY_KEYS = ("id", "path", "context_length", "kind", "fim", "keep_alive", "preload",
               "draft")
_FIM_KEYS = ("prefix", "suffix", "middle", "suffix_first", "stop")


@dataclass(frozen=True)
class FimSetting:
    """A model's fill-in-the-middle markers, named by the operator where afmd cannot read
    them from the tokenizer (see afmd/service/fim.py for the families it detects)."""

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
    keep_alive: float | None = None  # idle seconds before unloading; None: [models] keep_alive
    preload: bool | None = None  # load at start; None: only the default model does
    draft: str | None = None  # id of a smaller model (same tokenizer) proposing its tokens


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


def parse_aliases(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError("models.aliases", f"expected a table, got {describe(value)}")
    aliases: dict[str, str] = {}
    for name, target in value.items():
        key = f"models.aliases.{toml_key(name)}"
        if not isinstance(target, str):
            raise ConfigError(key, f"expected string (a model id), got {describe(target)}")
        coerce(name, "str", key)
        coerce(target, "str", key)
        if not name.strip():
            # A model id may not be empty; an alias that is listed a nameless model in
            # /v1/models and answered requests whose model is "".
            raise ConfigError(key, "an alias needs a name, got an empty one")
        if not target:
            raise ConfigError(key, "must name a model id, got an empty string")
        aliases[name] = target
    return aliases


def _table_array(
    value: object, key: str, allowed: tuple[str, ...]
) -> Iterator[tuple[int, str, dict[str, object]]]:
    """The tables of a ``[[key]]`` array, each checked to hold only ``allowed`` keys."""
    if not isinstance(value, list):
        raise ConfigError(key, f"expected an array of [[{key}]] tables, got {describe(value)}")
    for i, item in enumerate(value):
        base = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(base, f"expected a table, got {describe(item)}")
        for name in item:
            if name not in allowed:
                raise ConfigError(
                    f"{base}.{name}",
                    f"unknown key {name!r} in [[{key}]]{suggest(name, allowed)}",
                )
        yield i, base, item


def _model_path(path: str) -> str:
    """A model's ``path`` as the server's routes read a model's name: a repo written as
    Ollama's users write it (``hf.co/OWNER/NAME``, ``OWNER/NAME:latest``) is that repo,
    unless a folder has that name. It passed the config's check and then failed to load,
    as neither a folder nor a repo id."""
    if path.startswith("afmd:") or os.path.isdir(os.path.expanduser(path)):
        return path
    return plain_name(path)


def parse_entries(value: object) -> list[ModelEntry]:
    entries: list[ModelEntry] = []
    first_index: dict[str, int] = {}
    for i, base, item in _table_array(value, "models.model", _ENTRY_KEYS):
        for required in ("id", "path"):
            if required not in item:
                raise ConfigError(f"{base}.{required}", f"missing: every model needs {required!r}")
            if coerce(item[required], "str", f"{base}.{required}") == "":
                raise ConfigError(f"{base}.{required}", "must not be empty")
        ctx = coerce(item.get("context_length"), "optint", f"{base}.context_length")
        if isinstance(ctx, int) and ctx < 1:
            raise ConfigError(f"{base}.context_length", f"must be >= 1, got {ctx}")
        model_id = str(item["id"])  # both strings: coerced above
        path = _model_path(str(item["path"]))
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
            kind = str(coerce(item["kind"], "str", f"{base}.kind"))
            if kind not in MODEL_KINDS:
                raise ConfigError(
                    f"{base}.kind",
                    f"must be one of {'|'.join(MODEL_KINDS)}, got {kind!r}"
                    f"{suggest(kind, MODEL_KINDS)}",
                )
        fim = _parse_fim(item["fim"], f"{base}.fim") if "fim" in item else None
        keep_alive: float | None = None
        if "keep_alive" in item:
            seconds = coerce(item["keep_alive"], "float", f"{base}.keep_alive")
            assert isinstance(seconds, float)
            keep_alive = seconds
            if not keep_alive >= -1:  # NaN too
                raise ConfigError(f"{base}.keep_alive",
                                  f"must be >= -1 (-1 keeps the model loaded), got {keep_alive!r}")
        preload = None
        if "preload" in item:
            preload = bool(coerce(item["preload"], "bool", f"{base}.preload"))
        draft = None
        if "draft" in item:
            draft = str(coerce(item["draft"], "str", f"{base}.draft"))
            if draft in ("", model_id):
                raise ConfigError(f"{base}.draft", "must name another model's id")
        entries.append(ModelEntry(id=model_id, path=path, context_length=context_length,
                                  kind=kind, fim=fim, keep_alive=keep_alive, preload=preload,
                                  draft=draft))
    return entries


def _parse_fim(value: object, key: str) -> FimSetting:
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a table {{prefix, suffix, middle}}, got "
                               f"{describe(value)}")
    for name in value:
        if name not in _FIM_KEYS:
            raise ConfigError(f"{key}.{name}", f"unknown key {name!r} in fim"
                                               f"{suggest(name, _FIM_KEYS)}")
    markers: dict[str, str] = {}
    for name in ("prefix", "suffix", "middle"):
        if name not in value and name != "middle":
            raise ConfigError(f"{key}.{name}", f"missing: a fim setting needs {name!r}")
        markers[name] = str(coerce(value.get(name, ""), "str", f"{key}.{name}"))
        if name != "middle" and not markers[name]:
            raise ConfigError(f"{key}.{name}", "must not be empty")
    suffix_first = bool(coerce(value.get("suffix_first", False), "bool",
                               f"{key}.suffix_first"))
    if not markers["middle"] and not suffix_first:
        raise ConfigError(f"{key}.middle", "missing: needed unless suffix_first = true")
    stop = coerce(value.get("stop", []), "strlist", f"{key}.stop")
    assert isinstance(stop, tuple | list)
    return FimSetting(prefix=markers["prefix"], suffix=markers["suffix"],
                      middle=markers["middle"], suffix_first=suffix_first,
                      stop=tuple(str(s) for s in stop if s))


_SERVER_TOOL_KEYS = tuple(f.name for f in dataclasses.fields(ServerTool))
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_server_tools(value: object) -> list[ServerTool]:
    tools: list[ServerTool] = []
    names: set[str] = set()
    for _, base, item in _table_array(value, "tools.server", _SERVER_TOOL_KEYS):
        if "name" not in item:
            raise ConfigError(f"{base}.name", "missing: every server tool needs 'name'")
        name = coerce(item["name"], "str", f"{base}.name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ConfigError(f"{base}.name", "must be 1-64 characters among A-Z a-z 0-9 _ -")
        if name in names:
            raise ConfigError(f"{base}.name", f"duplicate server tool name {name!r}")
        names.add(name)
        command = coerce(item.get("command", []), "strlist", f"{base}.command")
        assert isinstance(command, tuple)  # of strings, as coerce checked
        python = coerce(item.get("python", ""), "str", f"{base}.python")
        if bool(command) == bool(python):
            raise ConfigError(base, "set exactly one of 'command' (an argv array) or 'python'")
        if python and ":" not in str(python):
            raise ConfigError(f"{base}.python", "expected 'path/to/file.py:function'")
        if python:  # "~" as in every path the config names (the OS takes it literally)
            file, _, function = str(python).rpartition(":")
            file = os.path.expanduser(file)
            if not os.path.isfile(file):
                # Found at start, not at the model's first call of it (where it could only
                # be told to the model, as the tool's error output).
                raise ConfigError(f"{base}.python", f"no such file: {file!r}")
            python = f"{file}:{function}"
        parameters = item.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ConfigError(f"{base}.parameters", "expected a table (a JSON Schema)")
        env = item.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ConfigError(f"{base}.env", "expected a table of strings")
        for env_name, env_value in env.items():
            coerce(env_name, "str", f"{base}.env")
            coerce(env_value, "str", f"{base}.env.{toml_key(env_name)}")
        timeout = coerce(item.get("timeout", 5.0), "float", f"{base}.timeout")
        if not isinstance(timeout, float) or not 0 < timeout <= 3600:
            raise ConfigError(f"{base}.timeout", "must be > 0 and <= 3600 seconds")
        max_out = coerce(item.get("max_output_bytes", 65536), "int", f"{base}.max_output_bytes")
        if not isinstance(max_out, int) or max_out < 1:
            raise ConfigError(f"{base}.max_output_bytes", "must be >= 1")
        tools.append(
            ServerTool(
                name=name,
                description=str(coerce(item.get("description", ""), "str",
                                       f"{base}.description")),
                parameters=dict(parameters),
                command=tuple(command),
                python=str(python),
                timeout=timeout,
                cwd=os.path.expanduser(str(coerce(item.get("cwd", ""), "str", f"{base}.cwd"))),
                env=dict(env),
                max_output_bytes=max_out,
            )
        )
    return tools
