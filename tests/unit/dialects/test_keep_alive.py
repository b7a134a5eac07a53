"""keep_alive as a request field (Ollama's forms) and as settings ([models] and per model),
and the other keys of the memory budget: parsed, bounded, each problem naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from afmd.config.bounds import ConfigError
from afmd.config.load import load_config
from afmd.dialects.fields.keep_alive import parse_keep_alive
from afmd.errors import InvalidRequestError


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), (300, 300.0), (0, 0.0), (0.5, 0.5), (-1, -1.0), (-30, -1.0),
    ("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0), ("500ms", 0.5), ("1.5h", 5400.0),
    ("-1m", -1.0), ("300", 300.0), ("-1", -1.0), ("0", 0.0), ("2us", 2e-6),
])
def test_keep_alive_forms(value: object, seconds: float | None) -> None:
    expected = None if seconds is None else pytest.approx(seconds)
    assert parse_keep_alive(value) == expected


@pytest.mark.parametrize(("value", "code"), [
    (True, "invalid_type"), ([], "invalid_type"), ({}, "invalid_type"),
    ("", "invalid_value"), ("5x", "invalid_value"), ("m", "invalid_value"),
    ("5m3", "invalid_value"), ("1e3", "invalid_value"), ("five minutes", "invalid_value"),
    (10**400, "invalid_value"),
])
def test_keep_alive_errors_name_the_param(value: object, code: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_keep_alive(value)
    assert (info.value.status, info.value.code, info.value.param) == (400, code, "keep_alive")


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> object:
    path = tmp_path / "afmd.toml"
    path.write_text(text)
    return load_config(path, env=env or {})


def test_memory_settings_defaults_and_layers(tmp_path: Path) -> None:
    models = load_config(None, env={}).models
    assert (models.memory_budget_bytes, models.max_loaded, models.keep_alive) == (0, 3, 300.0)
    config = load(tmp_path, "[models]\nkeep_alive = -1\nmax_loaded = 2\n"
                            '[[models.model]]\nid = "x"\npath = "afmd:demo"\n'
                            "keep_alive = 0\npreload = true\n",
                  env={"AFMD_MODELS_MEMORY_BUDGET_BYTES": "1000"})
    models = config.models  # type: ignore[attr-defined]
    assert (models.memory_budget_bytes, models.max_loaded, models.keep_alive) == (1000, 2, -1.0)
    x, demo, demo_32k = (config.resolve_model(i)  # type: ignore[attr-defined]
                         for i in ("x", "demo", "demo-32k"))
    assert (models.keep_alive_of(x), models.keep_alive_of(demo)) == (0.0, -1.0)
    # preload: explicit, else the default model only.
    assert [models.preloads(e) for e in (x, demo, demo_32k)] == [True, True, False]


@pytest.mark.parametrize(("text", "key", "message"), [
    ("[models]\nkeep_alive = -2\n", "models.keep_alive", "must be >= -1"),
    ("[models]\nmax_loaded = 0\n", "models.max_loaded", "must be >= 1"),
    ("[models]\nmemory_budget_bytes = -1\n", "models.memory_budget_bytes", "must be >= 0"),
    ('[[models.model]]\nid = "a"\npath = "b"\nkeep_alive = "5m"\n',
     "models.model[0].keep_alive", "expected number"),
    ('[[models.model]]\nid = "a"\npath = "b"\nkeep_alive = -3\n',
     "models.model[0].keep_alive", "must be >= -1"),
    ('[[models.model]]\nid = "a"\npath = "b"\npreload = 1\n',
     "models.model[0].preload", "expected boolean"),
])
def test_memory_settings_errors_name_the_key(tmp_path: Path, text: str, key: str,
                                              message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert info.value.key == key and message in info.value.message
