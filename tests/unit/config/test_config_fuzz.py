"""Any TOML a user can write either loads or is a ConfigError naming a key: never another
exception, which the CLI would print as a traceback instead of exit code 2 and the key.

A full config (every section of ``config.example.toml``, a model table with every
per-model key, a server tool) has each key set in turn to each of a list of hostile values
(a NUL character in a path, found this way, was a ``ValueError`` at start), then
hypothesis rewrites several keys at once with values of any TOML type. A config that loads
holds no NaN or infinity where a number is read.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import tomllib
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afmd.config.bounds import ConfigError
from afmd.config.load import load_config

from helpers.paths import REPO_ROOT

BASE: dict[str, Any] = tomllib.loads((REPO_ROOT / "config.example.toml").read_text())
BASE["models"]["model"] = [{
    "id": "coder", "path": "afmd:demo", "context_length": 4096, "kind": "chat",
    "keep_alive": 60, "preload": False, "draft": "demo",
    "fim": {"prefix": "<PRE>", "suffix": "<SUF>", "middle": "<MID>", "stop": ["<EOT>"],
            "suffix_first": False}}]
BASE["tools"]["server"] = [{
    "name": "clock", "description": "The time.", "command": ["date"],
    "parameters": {"type": "object"}, "timeout": 5.0, "cwd": "", "env": {"TZ": "UTC"},
    "max_output_bytes": 4096}]

#: The values every key is set to in turn: strings the OS or a parser chokes on, numbers at
#: the edges of what TOML holds, and each other type.
HOSTILE: list[Any] = [
    "", " ", "\0", "/tmp/x\0y", "\n", "..", "/", "~", "a" * 5000, "\u202e", 0, -1,
    2**63 - 1, -(2**63), 0.5, -0.0, 1e308, math.inf, -math.inf, math.nan, True, False, [],
    [""], [0], {}, {"x": 1}, [{}]]

#: TOML's strings are Unicode scalar values: anything but surrogates.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    [v for v in HOSTILE if isinstance(v, str)] + ["demo", "afmd:demo", "127.0.0.1", "trim"])
SCALARS = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1),
                    st.floats(allow_nan=True, allow_infinity=True), TEXT)
KEYS = st.sampled_from(["id", "path", "name", "kind", "prefix", "x"]) | TEXT
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=6)


@functools.cache  # the same keys and values are written thousands of times
def _toml_string(text: str) -> str:
    # JSON's escapes are TOML's, but TOML also forbids a raw DEL.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(
            value) else repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


def _toml(data: dict[str, Any]) -> str:
    lines: list[str] = []
    tables: list[str] = []
    for section, body in data.items():
        if not isinstance(body, dict):
            lines.append(f"{_toml_string(section)} = {_toml_value(body)}")
            continue
        tables.append(f"[{_toml_string(section)}]")
        for key, value in body.items():
            if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                continue
            tables.append(f"{_toml_string(key)} = {_toml_value(value)}")
        for key, value in body.items():
            if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                for item in value:
                    tables.append(f"[[{_toml_string(section)}.{_toml_string(key)}]]")
                    tables.extend(f"{_toml_string(k)} = {_toml_value(v)}" for k, v in item.items())
    return "\n".join(lines + tables) + "\n"


def _places(data: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Every (table, key) a value sits at: sections' keys and the array tables' keys."""
    places = [(data, section) for section in data]
    for body in data.values():
        if isinstance(body, dict):
            for key, value in body.items():
                places.append((body, key))
                if isinstance(value, list):
                    places.extend((item, k) for item in value if isinstance(item, dict)
                                  for k in item)
    return places


def _loads_or_names_the_key(path: Path, data: dict[str, Any]) -> None:
    # A new file each time: rewriting one in place makes the file system free its blocks
    # first, which costs more than the load itself on some disks (ext4 with discard).
    path.unlink(missing_ok=True)
    path.write_text(_toml(data), encoding="utf-8")
    try:
        config = load_config(path, env={})
    except ConfigError as error:
        assert error.key and error.message
        # The emitter wrote valid TOML: load_config's parse is the one check of it (the
        # file's own key names the file when the TOML or its UTF-8 does not parse).
        assert error.key != str(path), error.message
        return
    for section in dataclasses.fields(config):
        part = getattr(config, section.name)
        if dataclasses.is_dataclass(part):
            for field in dataclasses.fields(part):
                value = getattr(part, field.name)
                if isinstance(value, float):
                    assert math.isfinite(value), (section.name, field.name, value)


def _copy(value: Any) -> Any:
    """A deep copy of parsed TOML (tables and arrays; the rest is immutable), ten times
    faster than ``copy.deepcopy``."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def test_every_key_set_to_every_hostile_value(tmp_path: Path) -> None:
    for index in range(len(_places(BASE))):
        for value in [*HOSTILE, None]:  # None: the key removed
            data = _copy(BASE)
            table, key = _places(data)[index]
            if value is None:
                del table[key]
            else:
                table[key] = value
            try:
                _loads_or_names_the_key(tmp_path / "config.toml", data)
            except BaseException as error:
                raise AssertionError(f"{key} = {value!r}") from error


EDITS = st.lists(st.tuples(st.integers(0, 10_000), VALUES | st.none()), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(edits=EDITS)
def test_any_values_at_any_keys_load_or_name_a_key(tmp_path: Path,
                                                   edits: list[tuple[int, Any]]) -> None:
    data = copy.deepcopy(BASE)
    for index, value in edits:
        places = _places(data)
        table, key = places[index % len(places)]
        if value is None:
            del table[key]
        else:
            table[key] = value
    _loads_or_names_the_key(tmp_path / "config.toml", data)
