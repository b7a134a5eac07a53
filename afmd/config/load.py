"""Typed afmd configuration: one TOML file, then ``AFMD_*`` env vars, then CLI flags.

Everything the server can be told lives here as frozen dataclasses so the rest of
the code reads plain attributes and never re-parses or re-validates input. All
problems surface as :class:`ConfigError` with a dotted key (``server.port``,
``models.model[1].path``, ``env AFMD_SERVER_PORT``) so the CLI can point the user
at the exact setting to fix. Ranges and cross-references are checked only after
all layers are merged, so a bad file value that an env var or flag replaces is
not an error.

The tables themselves are afmd.config.sections' dataclasses; a setting's bounds and
choices are its field's metadata (``at_least``, ``between``, ``one_of``), checked by one
walker (afmd.config.bounds); afmd.config.layers merges the file, env and flags,
afmd.config.tables reads the arrays of tables, afmd.config.rules checks the rules
across settings and afmd.config.locate finds the line of the file a bad key is on. This
module builds the result from them (each name is imported from the module that defines
it); it and those six are afmd's lowest layer and import nothing else from it.
"""

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from afmd.config.bounds import ConfigError, check_fields
from afmd.config.layers import Merged, Schema, apply_env, apply_file, apply_overrides, read_toml
from afmd.config.locate import line_of
from afmd.config.rules import (
    apply_model_flag,
    validate_aliases,
    validate_default,
    validate_drafts,
    validate_server,
)
from afmd.config.sections import (
    BUILTIN_MODELS,
    SECTIONS,
    Config,
)
from afmd.config.tables import (
    parse_aliases,
    parse_entries,
    parse_server_tools,
)

__all__ = ["BREW_PREFIXES", "default_config_path", "load_config"]

#: Homebrew prefixes searched (in order, after ``$HOMEBREW_PREFIX``) for
#: ``etc/afmd/config.toml``; module-level so tests can point it elsewhere.
BREW_PREFIXES: tuple[str, ...] = ("/opt/homebrew", "/usr/local", "/home/linuxbrew/.linuxbrew")


# Structured fields: only a TOML file can express them sensibly.
_SCHEMA = Schema(
    SECTIONS,
    {
        ("models", "aliases"): parse_aliases,
        ("models", "model"): parse_entries,
        ("tools", "server"): parse_server_tools,
    },
)


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
        # As the shell would: a launchd plist or ``--config=~/...`` hands "~" over as is.
        path = os.path.expanduser(os.fspath(path))
    try:
        return _build(path, env, overrides, merged)
    except ConfigError as exc:
        raise _placed(exc, path, merged) from None


def _placed(exc: ConfigError, path: str | None, merged: Merged) -> ConfigError:
    """``exc`` naming the file and line that set its key, where the file set it: a key
    alone sent an operator searching a long file (or one they did not know was read)."""
    if path is None or exc.key == path or merged.origin.get(exc.key, "file") != "file":
        return exc
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return exc
    line = line_of(text, exc.key)
    if line is None:
        return exc
    return ConfigError(exc.key, f"{exc.message} ({path}, line {line})")


def _build(
    path: str | None,
    env: Mapping[str, str] | None,
    overrides: Mapping[str, object] | None,
    merged: Merged,
) -> Config:
    if path is not None:
        apply_file(read_toml(path), merged)
    apply_env(os.environ if env is None else env, merged)
    if overrides:
        apply_overrides(overrides, merged)

    cfg = Config(
        **{section: cls(**merged.values[section]) for section, cls in SECTIONS.items()},
        source=path,
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
    validate_aliases(models)
    validate_drafts(models)
    if merged.model_flag is not None:
        models = apply_model_flag(merged.model_flag, models)
    validate_default(merged, models)

    # Every field's bounds and choices (its metadata), section by section, then the rules
    # across fields.
    checked = {
        section: check_fields(getattr(cfg, section), section, merged.where)
        for section in SECTIONS
    }
    cfg = dataclasses.replace(cfg, **checked)
    return dataclasses.replace(cfg, server=validate_server(merged, cfg.server), models=models)


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
