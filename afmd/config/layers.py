"""The layers a configuration is merged from: a TOML file, ``AFMD_*`` env vars, CLI flags.

Each layer is read against a :class:`Schema` (the section dataclasses, and the keys only
a file can set with their parsers), coerced to each field's type as it is read, and
remembered with where it came from, so a later check can say ``(from AFMD_SERVER_PORT)``.
Bounds and cross-references are checked only after all layers are merged, so a bad file
value that an env var or flag replaces is not an error.

Part of afmd's lowest layer: it imports nothing above afmd.config.bounds.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from afmd.config.bounds import ConfigError, coerce, describe, kind_of, parse_text, suggest

Key = tuple[str, str]


class Schema:
    """The sections of a configuration, and the structured keys (tables, arrays of
    tables) only a TOML file can express, each with the parser that reads it."""

    def __init__(
        self, sections: Mapping[str, type], structured: Mapping[Key, Callable[[object], object]]
    ) -> None:
        self.sections = dict(sections)
        self.structured = dict(structured)
        #: Per section, the kind (see :func:`kind_of`) of each key a layer may set.
        self.fields: dict[str, dict[str, str]] = {
            section: {
                f.name: kind_of(f.type)
                for f in dataclasses.fields(cls)
                if (section, f.name) not in self.structured
            }
            for section, cls in self.sections.items()
        }
        self.all_keys: dict[str, list[str]] = {
            section: [f.name for f in dataclasses.fields(cls)]
            for section, cls in self.sections.items()
        }

    def section_with(self, name: str, exclude: str | None = None) -> str | None:
        for section, keys in self.all_keys.items():
            if section != exclude and name in keys:
                return section
        return None

    def unknown_key(self, section: str, name: str) -> ConfigError:
        key = f"{section}.{name}"
        elsewhere = self.section_with(name, exclude=section)
        if elsewhere is not None:
            hint = f"; it belongs in [{elsewhere}] ({elsewhere}.{name})"
        else:
            hint = suggest(name, self.all_keys[section])
        return ConfigError(key, f"unknown key {name!r} in [{section}]{hint}")

    def unknown_section(self, name: str, value: object) -> ConfigError:
        what = "section" if isinstance(value, dict) else "top-level key"
        elsewhere = self.section_with(name)
        if elsewhere is not None:
            hint = f"; did you mean {elsewhere}.{name} (under [{elsewhere}])?"
        else:
            hint = suggest(name, self.sections)
        return ConfigError(name, f"unknown {what} {name!r}{hint}")


def env_name(section: str, name: str) -> str:
    return f"AFMD_{section.upper()}_{name.upper()}"


@dataclass
class Merged:
    """Mutable scratch state while layering; ``origin`` feeds "(from X)" in messages."""

    schema: Schema
    values: dict[str, dict[str, object]] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    #: What each structured key's parser made of it (file only).
    structured: dict[Key, object] = field(default_factory=dict)
    model_flag: str | None = None

    def __post_init__(self) -> None:
        self.values = {section: {} for section in self.schema.sections}

    def set(self, section: str, name: str, value: object, origin: str) -> None:
        self.values[section][name] = value
        self.origin[f"{section}.{name}"] = origin

    def where(self, key: str) -> str:
        """`` (from X)`` for a value an env var or flag set; empty for the file's."""
        origin = self.origin.get(key)
        return f" (from {origin})" if origin and origin != "file" else ""


def read_toml(path: str | os.PathLike[str]) -> dict[str, object]:
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


def apply_file(data: Mapping[str, object], merged: Merged) -> None:
    schema = merged.schema
    for section, table in data.items():
        if section not in schema.sections:
            raise schema.unknown_section(section, table)
        if not isinstance(table, dict):
            raise ConfigError(section, f"expected a table [{section}], got {describe(table)}")
        for name, value in table.items():
            key = f"{section}.{name}"
            parser = schema.structured.get((section, name))
            if parser is not None:
                merged.structured[(section, name)] = parser(value)
            elif name in schema.fields[section]:
                merged.set(section, name, coerce(value, schema.fields[section][name], key), "file")
            else:
                raise schema.unknown_key(section, name)


def apply_env(env: Mapping[str, str], merged: Merged) -> None:
    # Iterate known names rather than env itself: unknown AFMD_* vars (including
    # AFMD_CONFIG / AFMD_CACHE_DIR) are simply never looked at.
    for section, fields in merged.schema.fields.items():
        for name, kind in fields.items():
            var = env_name(section, name)
            if var in env:
                value = parse_text(env[var], kind, f"env {var}")
                merged.set(section, name, value, var)


def apply_overrides(overrides: Mapping[str, object], merged: Merged) -> None:
    schema = merged.schema
    every_key = [f"{s}.{n}" for s, names in schema.all_keys.items() for n in names]
    for dotted, value in overrides.items():
        # None = "flag not given", which is what argparse hands over for unset options.
        if value is None:
            continue
        if dotted == "model":
            if not isinstance(value, str) or not value:
                raise ConfigError("model", f"expected a model id or path, got {describe(value)}")
            merged.model_flag = value
            continue
        section, _, name = dotted.partition(".")
        if section not in schema.sections or name not in schema.all_keys[section]:
            raise ConfigError(dotted, f"unknown setting{suggest(dotted, [*every_key, 'model'])}")
        if (section, name) in schema.structured:
            raise ConfigError(dotted, "can only be set in the config file")
        kind = schema.fields[section][name]
        if isinstance(value, str) and kind != "str":
            parsed = parse_text(value, kind, dotted)
        else:
            parsed = coerce(value, kind, dotted)
        merged.set(section, name, parsed, "command line")
