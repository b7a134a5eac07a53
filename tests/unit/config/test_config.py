"""Tests for afmd.config.load: layering, validation keys, --model semantics, file discovery."""

import dataclasses
import pickle
from pathlib import Path

import pytest

from afmd.config import load as config_mod
from afmd.config.bounds import ConfigError
from afmd.config.load import default_config_path, load_config
from afmd.config.sections import BUILTIN_DEMO_PATH, DEMO_MODEL_ID, SECTIONS, Config, ModelsConfig
from afmd.config.tables import ModelEntry

from helpers.paths import REPO_ROOT

EXAMPLE = REPO_ROOT / "config.example.toml"


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_text(tmp_path: Path, text: str, **kwargs: object) -> Config:
    kwargs.setdefault("env", {})
    return load_config(write(tmp_path, text), **kwargs)  # type: ignore[arg-type]


def error_for(tmp_path: Path, text: str, **kwargs: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text, **kwargs)
    return info.value


# --------------------------------------------------------------------------- defaults


def test_defaults_without_file() -> None:
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.source is None
    assert cfg.server.host == "127.0.0.1"
    assert cfg.server.port == 9999
    assert cfg.model_ids() == ("demo", "demo-32k", "demo-embedding", "demo-vision",
                               "system")
    assert cfg.resolve_model(None) == ModelEntry("demo", BUILTIN_DEMO_PATH)
    assert cfg.resolve_model("demo-32k") == ModelEntry("demo-32k", "afmd:demo-32k")
    assert cfg.resolve_model("nope") is None


def test_example_file_equals_defaults_except_alias() -> None:
    cfg = load_config(EXAMPLE, env={})
    assert cfg.source == str(EXAMPLE)
    assert cfg.models.aliases == {"gpt-4o-mini": "demo"}
    expected = Config(models=ModelsConfig(aliases={"gpt-4o-mini": "demo"}), source=str(EXAMPLE))
    assert cfg == expected
    assert cfg.resolve_model("gpt-4o-mini") == cfg.resolve_model("demo")


def test_example_file_model_tables_parse(tmp_path: Path) -> None:
    """The commented [[models.model]] examples, uncommented, are a valid config (the
    per-model keys, fim's inline table included), and every per-model key is described."""
    import re

    from afmd.config.tables import FimSetting

    text = EXAMPLE.read_text()
    for f in dataclasses.fields(ModelEntry):
        assert re.search(rf"^#   {f.name} ", text, re.M), f"models.model {f.name} missing"
    tables: list[str] = []
    in_table = False
    for line in text.splitlines():
        in_table = line == "# [[models.model]]" or (
            in_table and re.fullmatch(r"# \w+ = .+", line) is not None)
        if in_table:
            tables.append(line[2:])
    cfg = load_text(tmp_path, "\n".join(tables))
    coder = cfg.resolve_model("coder")
    assert cfg.resolve_model("qwen2.5-0.5b") is not None and coder is not None
    assert coder.fim == FimSetting(prefix="<PRE>", suffix="<SUF>", middle="<MID>",
                                   stop=("<EOT>",))


def test_example_file_covers_every_key() -> None:
    text = EXAMPLE.read_text()
    for section, cls in SECTIONS.items():
        assert f"[{section}]" in text
        for f in dataclasses.fields(cls):
            if (section, f.name) == ("models", "model"):
                assert "[[models.model]]" in text
            elif (section, f.name) == ("models", "aliases"):
                assert "[models.aliases]" in text
            elif (section, f.name) == ("tools", "server"):
                assert "[[tools.server]]" in text
            elif f.default is None:  # no TOML value says "not set": shown commented out
                assert f"\n# {f.name} = " in text, f"{section}.{f.name} missing"
            else:
                assert f"\n{f.name} = " in text, f"{section}.{f.name} missing"
                assert f"AFMD_{section.upper()}_{f.name.upper()}" in text


def test_empty_file(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, "")
    assert dataclasses.replace(cfg, source=None) == Config()


def test_config_error_str_and_pickle() -> None:
    err = ConfigError("server.port", "bad")
    assert (err.key, err.message, str(err)) == ("server.port", "bad", "server.port: bad")
    again = pickle.loads(pickle.dumps(err))
    assert (again.key, again.message) == ("server.port", "bad")


# --------------------------------------------------------------------------- layering


def test_file_overrides_defaults(tmp_path: Path) -> None:
    cfg = load_text(
        tmp_path,
        """
        [server]
        port = 8080
        allowed_origins = ["http://a"]
        idle_timeout = 5
        [log]
        format = "console"
        """,
    )
    assert cfg.server.port == 8080
    assert cfg.server.allowed_origins == ("http://a",)
    assert cfg.server.idle_timeout == 5.0
    assert isinstance(cfg.server.idle_timeout, float)
    assert cfg.log.format == "console"
    assert cfg.server.host == "127.0.0.1"  # untouched keys keep defaults


def test_env_overrides_file(tmp_path: Path) -> None:
    env = {
        "AFMD_SERVER_PORT": "7000",
        "AFMD_QUEUE_MAX_CONCURRENT_REQUESTS": "2",
        "AFMD_LOG_FORMAT": "console",
        "AFMD_LOG_ACCESS_LOG": "no",
        "AFMD_SERVER_ALLOWED_ORIGINS": "http://a, http://b,",
        "AFMD_SERVER_REQUEST_TIMEOUT": "2.5",
        "AFMD_MODELS_DEFAULT": "demo-32k",
        "AFMD_CONFIG": "/ignored.toml",
        "AFMD_CACHE_DIR": "/ignored",
        "AFMD_SOMETHING_ELSE": "whatever",
        "AFMD_MODELS_MODEL": "ignored",
    }
    cfg = load_text(tmp_path, "[server]\nport = 8080\n[log]\nformat = 'json'\n", env=env)
    assert cfg.server.port == 7000
    assert cfg.queue.max_concurrent_requests == 2
    assert cfg.log.format == "console"
    assert cfg.log.access_log is False
    assert cfg.server.allowed_origins == ("http://a", "http://b")
    assert cfg.server.request_timeout == 2.5
    assert cfg.models.default == "demo-32k"


def test_env_empty_string_sets_empty_host() -> None:
    cfg = load_config(env={"AFMD_SERVER_HOST": "", "AFMD_SERVER_UNIX_SOCKET": "/tmp/a.sock"})
    assert cfg.server.host == ""
    assert cfg.server.unix_socket == "/tmp/a.sock"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("1", True), ("YES", True), ("false", False), ("0", False), ("No", False)],
)
def test_env_bools(text: str, expected: bool) -> None:
    cfg = load_config(env={"AFMD_LOG_ACCESS_LOG": text})
    assert cfg.log.access_log is expected


@pytest.mark.parametrize(("name", "text"), [
    ("AFMD_SERVER_PORT", "\u0661\u0662\u0663"),  # Arabic-Indic 123: int() reads it
    ("AFMD_SERVER_REQUEST_TIMEOUT", "\uff13\uff10"),  # fullwidth 30: float() too
])
def test_env_numbers_are_ascii_digits(name: str, text: str) -> None:
    """An operator reading the value back sees no port 123 in it."""
    with pytest.raises(ConfigError, match=f"{name}: .* in ASCII digits"):
        load_config(env={name: text})


def test_overrides_beat_env_and_file(tmp_path: Path) -> None:
    cfg = load_text(
        tmp_path,
        "[server]\nport = 8080\nhost = 'localhost'\n",
        env={"AFMD_SERVER_PORT": "7000"},
        overrides={
            "server.port": 0,
            "server.host": "",
            "server.unix_socket": "/tmp/a.sock",
            "models.default": "demo-32k",
            "log.level": None,  # "flag not given"
        },
    )
    assert cfg.server.port == 0
    assert cfg.server.host == ""
    assert cfg.server.unix_socket == "/tmp/a.sock"
    assert cfg.models.default == "demo-32k"
    assert cfg.log.level == "info"


def test_override_strings_are_parsed_by_type() -> None:
    cfg = load_config(env={}, overrides={"server.port": "1234", "log.access_log": "false"})
    assert cfg.server.port == 1234
    assert cfg.log.access_log is False


def test_validity_checked_after_merge(tmp_path: Path) -> None:
    # An invalid file value is fine if a higher layer replaces it.
    cfg = load_text(tmp_path, "[server]\nport = 70000\n", env={"AFMD_SERVER_PORT": "80"})
    assert cfg.server.port == 80
    cfg = load_text(tmp_path, "[models]\ndefault = 'nope'\n", overrides={"model": "demo"})
    assert cfg.models.default == "demo"
    cfg = load_text(tmp_path, "[server]\nhost = ''\n", overrides={"server.unix_socket": "/t/s"})
    assert cfg.server.unix_socket == "/t/s"


def test_log_values_are_case_insensitive() -> None:
    cfg = load_config(env={"AFMD_LOG_LEVEL": "DEBUG", "AFMD_CONTEXT_POLICY": "Trim"})
    assert cfg.log.level == "debug"
    assert cfg.context.policy == "trim"


def test_env_none_means_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AFMD_SERVER_PORT", "4321")
    assert load_config().server.port == 4321


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nport = 70000", "server.port"),
        ("[server]\nport = -1", "server.port"),
        ("[server]\nmax_request_body_bytes = -1", "server.max_request_body_bytes"),
        ("[server]\nmax_header_bytes = -5", "server.max_header_bytes"),
        ("[server]\nmax_connections = 0", "server.max_connections"),
        ("[server]\nidle_timeout = -0.5", "server.idle_timeout"),
        ("[server]\nrequest_timeout = nan", "server.request_timeout"),
        ("[server]\nshutdown_grace = -1", "server.shutdown_grace"),
        ("[server]\nhost = ''", "server.host"),
        ("[server]\nunix_socket = '" + "x" * 200 + "'", "server.unix_socket"),
        ("[queue]\nmax_concurrent_requests = 0", "queue.max_concurrent_requests"),
        ("[queue]\nmax_queued_requests = -1", "queue.max_queued_requests"),
        ("[cache]\nprompt_cache_bytes = -1", "cache.prompt_cache_bytes"),
        ("[cache]\nprompt_cache_entries = -1", "cache.prompt_cache_entries"),
        ("[cache]\ndisk_min_free = -1", "cache.disk_min_free"),
        ("[cache]\ndisk_min_free = 1.5", "cache.disk_min_free"),
        ("[cache]\ndisk_min_free = '2G'", "cache.disk_min_free"),
        ("[engine]\nretries = -1", "engine.retries"),
        ("[log]\nlevel = 'verbose'", "log.level"),
        ("[log]\nformat = 'xml'", "log.format"),
        ("[context]\npolicy = 'drop'", "context.policy"),
        # wrong types
        ("[server]\nport = '8080'", "server.port"),
        ("[server]\nport = true", "server.port"),
        ("[server]\nidle_timeout = false", "server.idle_timeout"),
        ("[server]\nhost = 1", "server.host"),
        ("[server]\nallowed_origins = 'http://a'", "server.allowed_origins"),
        ("[server]\nallowed_origins = ['a', 1]", "server.allowed_origins[1]"),
        ("[log]\naccess_log = 1", "log.access_log"),
        ("server = 1", "server"),
        # unknown names
        ("[sever]\nport = 1", "sever"),
        ("[server]\nprot = 1", "server.prot"),
        ("port = 1", "port"),
        # models
        ("[[models.model]]\npath = '/m'", "models.model[0].id"),
        ("[[models.model]]\nid = 'a'", "models.model[0].path"),
        ("[[models.model]]\nid = ''\npath = '/m'", "models.model[0].id"),
        (
            "[[models.model]]\nid = 'a'\npath = '/m'\ncontext_length = 0",
            "models.model[0].context_length",
        ),
        (
            "[[models.model]]\nid = 'a'\npath = '/m'\ncontext_length = 1.5",
            "models.model[0].context_length",
        ),
        ("[[models.model]]\nid = 'a'\npath = '/m'\nctx = 1", "models.model[0].ctx"),
        ("[[models.model]]\nid = 'a'\npath = '/m'\nkind = 'embed'", "models.model[0].kind"),
        ("[[models.model]]\nid = 'a'\npath = '/m'\nkind = 1", "models.model[0].kind"),
        (
            "[[models.model]]\nid = 'a'\npath = '/m'\n[[models.model]]\nid = 'a'\npath = '/n'",
            "models.model[1].id",
        ),
        ("[models]\nmodel = 'x'", "models.model"),
        ("[models.aliases]\nfast = 'nope'", "models.aliases.fast"),
        ("[models.aliases]\ndemo = 'demo-32k'", "models.aliases.demo"),
        ('[models.aliases]\n"a.b" = 3', 'models.aliases."a.b"'),
        ("[models]\ndefault = 'nope'", "models.default"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    assert error_for(tmp_path, text).key == key


@pytest.mark.parametrize(
    ("text", "key"),
    [
        # The OS refused these only later: a path with a NUL was a ValueError traceback
        # from reading the instructions file, a socket path or a model path at start.
        ('[server]\ninstructions_file = "/tmp/a\\u0000b"', "server.instructions_file"),
        ('[server]\nunix_socket = "/tmp/s\\u0000"', "server.unix_socket"),
        ('[server]\nhost = "127.0.0.1\\u0000"', "server.host"),
        ('[cache]\ndisk_dir = "\\u0000"', "cache.disk_dir"),
        ('[server]\nallowed_origins = ["http://a", "http://b\\u0000"]',
         "server.allowed_origins[1]"),
        ('[[models.model]]\nid = "a"\npath = "/m\\u0000"', "models.model[0].path"),
        ('[models.aliases]\nfast = "demo\\u0000"', "models.aliases.fast"),
        ('[[tools.server]]\nname = "t"\ncommand = ["echo", "\\u0000"]',
         "tools.server[0].command[1]"),
        ('[[tools.server]]\nname = "t"\ncommand = ["env"]\nenv = {A = "\\u0000"}',
         "tools.server[0].env.A"),
    ],
)
def test_a_nul_character_in_any_string_is_refused(tmp_path: Path, text: str, key: str) -> None:
    error = error_for(tmp_path, text)
    assert error.key == key and "NUL character" in error.message


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"AFMD_SERVER_PORT": "eighty"}, "env AFMD_SERVER_PORT"),
        ({"AFMD_SERVER_PORT": ""}, "env AFMD_SERVER_PORT"),
        ({"AFMD_SERVER_IDLE_TIMEOUT": "soon"}, "env AFMD_SERVER_IDLE_TIMEOUT"),
        ({"AFMD_LOG_ACCESS_LOG": "maybe"}, "env AFMD_LOG_ACCESS_LOG"),
        ({"AFMD_SERVER_PORT": "99999"}, "server.port"),
        ({"AFMD_CACHE_DISK_MIN_FREE": "-1"}, "cache.disk_min_free"),
        ({"AFMD_CACHE_DISK_MIN_FREE": "2G"}, "env AFMD_CACHE_DISK_MIN_FREE"),
        ({"AFMD_MODELS_DEFAULT": "nope"}, "models.default"),
    ],
)
def test_env_errors(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    assert info.value.key == key


def test_the_disk_tiers_free_space_margin_is_bytes_automatic_unless_set(
        tmp_path: Path) -> None:
    """``None`` (not set, or set empty in the environment) is the automatic margin; 0 turns
    it off."""
    assert load_config(env={}).cache.disk_min_free is None
    assert load_config(env={"AFMD_CACHE_DISK_MIN_FREE": ""}).cache.disk_min_free is None
    assert load_config(env={"AFMD_CACHE_DISK_MIN_FREE": "0"}).cache.disk_min_free == 0
    path = tmp_path / "afmd.toml"
    path.write_text("[cache]\ndisk_min_free = 5368709120\n")
    assert load_config(path, env={}).cache.disk_min_free == 5 << 30


def test_range_error_mentions_env_origin() -> None:
    with pytest.raises(ConfigError, match="AFMD_SERVER_PORT"):
        load_config(env={"AFMD_SERVER_PORT": "99999"})


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"server.prot": 1}, "server.prot"),
        ({"nope.port": 1}, "nope.port"),
        ({"server.port": True}, "server.port"),
        ({"server.port": "x"}, "server.port"),
        ({"models.aliases": {}}, "models.aliases"),
        ({"model": ""}, "model"),
    ],
)
def test_override_errors(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    assert info.value.key == key


def test_bool_is_not_int_but_int_is_float(tmp_path: Path) -> None:
    err = error_for(tmp_path, "[queue]\nmax_concurrent_requests = true")
    assert err.key == "queue.max_concurrent_requests"
    assert "expected integer" in err.message and "boolean" in err.message
    cfg = load_text(tmp_path, "[server]\nrequest_timeout = 60")
    assert cfg.server.request_timeout == 60.0


def test_unknown_key_suggestions(tmp_path: Path) -> None:
    assert "did you mean 'port'" in error_for(tmp_path, "[server]\nprot = 1").message
    assert "did you mean 'server'" in error_for(tmp_path, "[sever]\nport = 1").message
    assert "queue.max_concurrent_requests" in str(
        error_for(tmp_path, "[server]\nmax_concurrent_requests = 1")
    )
    assert "server.port" in str(error_for(tmp_path, "port = 1"))
    assert "'context_length'" in str(
        error_for(tmp_path, "[[models.model]]\nid='a'\npath='b'\ncontext_lenght=1")
    )
    with pytest.raises(ConfigError, match=r"did you mean 'server\.port'"):
        load_config(env={}, overrides={"server.prot": 1})


@pytest.mark.parametrize(("text", "key", "line"), [
    ("# afmd\n[server]\nhost = '127.0.0.1'\nprot = 1\n", "server.prot", 4),
    ("[log]\nlevel = 'info'\n[models]\ndefault = 'nope'\n", "models.default", 4),
    ("[server]\nport = 1\n[queue]\nmax_concurrent_requests = 0\n",
     "queue.max_concurrent_requests", 4),
    ("server.port = 70000\n", "server.port", 1),
    ("[server]\nallowed_hosts = [\n  'a',\n  3,\n]\n", "server.allowed_hosts[1]", 2),
    ("[sever]\nport = 1\n", "sever", 1),
    ("[[models.model]]\nid = 'a'\npath = 'x/y'\n[[models.model]]\nid = 'b'\npath = 3\n",
     "models.model[1].path", 6),
    ("[[models.model]]\nid = 'a'\npath = 'x/y'\n\n[[models.model]]\nid = 'b'\n",
     "models.model[1].path", 5),
    ("[[models.model]]\nid = 'a'\npath = 'x/y'\nfim = { prefix = 1, suffix = 'b' }\n",
     "models.model[0].fim.prefix", 4),
    ("[models.aliases]\n'gpt-4o' = 'zzz'\n", "models.aliases.gpt-4o", 2),
    ("[server]\ninstructions = \"\"\"\n[sever]\nprot = 1\n\"\"\"\nprot = 2\n", "server.prot", 6),
])
def test_an_error_names_the_file_and_line_that_set_its_key(
        tmp_path: Path, text: str, key: str, line: int) -> None:
    err = error_for(tmp_path, text)
    assert err.key == key
    assert err.message.endswith(f"({tmp_path / 'config.toml'}, line {line})"), err.message


def test_an_error_the_file_did_not_cause_names_no_line(tmp_path: Path) -> None:
    """A bad value from the environment is its variable's; a default the file does not
    name is no line's (``[server]`` is not where a missing listener is)."""
    err = error_for(tmp_path, "[server]\nport = 8000\n", env={"AFMD_SERVER_PORT": "70000"})
    assert err.message.endswith("(from AFMD_SERVER_PORT)"), err.message
    err = error_for(tmp_path, "[server]\nport = 8000\n", env={"AFMD_SERVER_HOST": ""})
    assert "line" not in err.message, err.message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == str(path)
    assert "not found" in info.value.message


def test_toml_syntax_error_has_position(tmp_path: Path) -> None:
    err = error_for(tmp_path, "[server]\nport = = 1\n")
    assert err.key == str(tmp_path / "config.toml")
    assert "line 2" in err.message and "column" in err.message


# --------------------------------------------------------------------------- models


def test_file_models_and_builtins(tmp_path: Path) -> None:
    cfg = load_text(
        tmp_path,
        """
        [models]
        default = "fast"
        [models.aliases]
        fast = "qwen"
        [[models.model]]
        id = "qwen"
        path = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
        context_length = 32768
        """,
    )
    assert cfg.model_ids() == ("qwen", "demo", "demo-32k", "demo-embedding", "demo-vision",
                               "system")
    assert cfg.resolve_model(None) == ModelEntry(
        "qwen", "mlx-community/Qwen2.5-0.5B-Instruct-4bit", 32768
    )
    assert cfg.resolve_model("fast") == cfg.resolve_model("qwen")


def test_file_can_redefine_builtin_id(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, "[[models.model]]\nid = 'demo'\npath = '/my/demo'\n")
    assert cfg.model_ids() == ("demo", "demo-32k", "demo-embedding", "demo-vision", "system")
    assert cfg.resolve_model("demo") == ModelEntry("demo", "/my/demo")


def test_model_kind(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, "[[models.model]]\nid = 'e'\npath = '/m'\nkind = 'embedding'\n")
    assert cfg.resolve_model("e") == ModelEntry("e", "/m", kind="embedding")
    assert cfg.resolve_model("demo-embedding") == ModelEntry(
        "demo-embedding", "afmd:demo-embedding", kind="embedding"
    )
    assert cfg.resolve_model("demo").kind is None  # read from the model's own config


@pytest.mark.parametrize("name", ["demo", "demo-32k", "demo-embedding", "demo-vision",
                                  "system"])
def test_model_flag_builtin_id(name: str) -> None:
    cfg = load_config(env={}, overrides={"model": name})
    assert cfg.models.default == name
    assert cfg.model_ids() == ("demo", "demo-32k", "demo-embedding", "demo-vision", "system")


def test_model_flag_alias_and_configured_id(tmp_path: Path) -> None:
    text = "[models.aliases]\nfast = 'q'\n[[models.model]]\nid = 'q'\npath = 'org/q'\n"
    cfg = load_text(tmp_path, text, overrides={"model": "fast"})
    assert cfg.models.default == "fast"
    assert cfg.resolve_model(None) == ModelEntry("q", "org/q")
    cfg = load_text(tmp_path, text, overrides={"model": "q"})
    assert cfg.models.default == "q"
    # A configured path picks the existing entry instead of adding a duplicate.
    cfg = load_text(tmp_path, text, overrides={"model": "org/q"})
    assert cfg.models.default == "q"
    assert cfg.model_ids() == ("q", "demo", "demo-32k", "demo-embedding", "demo-vision",
                               "system")


def test_model_flag_hf_repo_id(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    repo = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    cfg = load_config(env={}, overrides={"model": repo, "models.default": "demo-32k"})
    assert cfg.models.default == repo
    assert cfg.resolve_model(None) == ModelEntry(repo, repo)
    assert cfg.model_ids() == ("demo", "demo-32k", "demo-embedding", "demo-vision", "system",
                               repo)


def test_model_flag_takes_ollamas_names(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    """`--model hf.co/OWNER/NAME:latest`, as Ollama's users name a hub repo, served a
    model of that path, which no folder and no repo id is: every request failed with
    "does not exist" and nothing was pulled first. It is the repo, as on every route."""
    monkeypatch.chdir(tmp_path)
    repo = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    for flag in (f"hf.co/{repo}", f"hf.co/{repo}:latest", f"{repo}:latest"):
        cfg = load_config(env={}, overrides={"model": flag})
        assert cfg.resolve_model(None) == ModelEntry(repo, repo), flag
    assert load_config(env={}, overrides={"model": "demo-32k:latest"}).models.default == (
        "demo-32k")
    # A folder of that name is that folder.
    (tmp_path / "hf.co" / "a" / "b").mkdir(parents=True)
    cfg = load_config(env={}, overrides={"model": "hf.co/a/b"})
    assert cfg.resolve_model(None) == ModelEntry("b", "hf.co/a/b")


def test_a_configured_path_takes_ollamas_names(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """A ``path`` written as Ollama names a hub repo passed the check and failed its load
    (neither a folder nor a repo id): it is the repo, unless a folder has that name."""
    monkeypatch.chdir(tmp_path)
    repo = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    (tmp_path / "hf.co" / "a" / "b").mkdir(parents=True)
    config = tmp_path / "afmd.toml"
    config.write_text("".join(f'[[models.model]]\nid = "m{i}"\npath = "{path}"\n'
                              for i, path in enumerate((f"hf.co/{repo}", f"{repo}:latest",
                                                        "hf.co/a/b", "afmd:demo"))))
    cfg = load_config(config, env={})
    assert [cfg.resolve_model(f"m{i}").path for i in range(4)] == [  # type: ignore[union-attr]
        repo, repo, "hf.co/a/b", "afmd:demo"]


def test_model_flag_local_dir_uses_basename(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "my-qwen"
    folder.mkdir(parents=True)
    cfg = load_config(env={}, overrides={"model": str(folder) + "/"})
    assert cfg.models.default == "my-qwen"
    assert cfg.resolve_model(None) == ModelEntry("my-qwen", str(folder) + "/")


def test_model_flag_local_dir_basename_collision(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    folder.mkdir()
    cfg = load_config(env={}, overrides={"model": str(folder)})
    assert cfg.models.default == str(folder)
    assert cfg.resolve_model("demo") == ModelEntry(DEMO_MODEL_ID, BUILTIN_DEMO_PATH)
    assert cfg.resolve_model(None) == ModelEntry(str(folder), str(folder))


def test_model_flag_builtin_path_reuses_builtin() -> None:
    cfg = load_config(env={}, overrides={"model": "afmd:demo-32k"})
    assert cfg.models.default == "demo-32k"


# --------------------------------------------------------------------------- server rules


def test_buffered_bytes_raised_not_rejected(tmp_path: Path) -> None:
    cfg = load_text(
        tmp_path,
        "[server]\nmax_request_body_bytes = 1000\nmax_header_bytes = 100\n"
        "max_buffered_request_bytes = 10\n",
    )
    assert cfg.server.max_buffered_request_bytes == 1000 + 100 + 262144
    cfg = load_text(tmp_path, "[server]\nmax_request_body_bytes = 100000000\n")
    assert cfg.server.max_buffered_request_bytes == 100000000 + 65536 + 262144
    # Already large enough: left alone.
    assert load_config(env={}).server.max_buffered_request_bytes == 67108864


def test_unix_socket_only_listener() -> None:
    cfg = load_config(env={}, overrides={"server.host": "", "server.unix_socket": "/tmp/a"})
    assert (cfg.server.host, cfg.server.unix_socket) == ("", "/tmp/a")
    with pytest.raises(ConfigError, match="no listener") as info:
        load_config(env={}, overrides={"server.host": ""})
    assert info.value.key == "server.host"


# --------------------------------------------------------------------------- discovery


@pytest.fixture
def no_brew(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_mod, "BREW_PREFIXES", ())
    monkeypatch.delenv("AFMD_CONFIG", raising=False)
    monkeypatch.delenv("HOMEBREW_PREFIX", raising=False)


@pytest.mark.usefixtures("no_brew")
def test_default_config_path_none() -> None:
    assert default_config_path() is None


@pytest.mark.usefixtures("no_brew")
def test_default_config_path_afmd_config_wins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    prefix = tmp_path / "brew"
    (prefix / "etc" / "afmd").mkdir(parents=True)
    (prefix / "etc" / "afmd" / "config.toml").write_text("")
    monkeypatch.setenv("HOMEBREW_PREFIX", str(prefix))
    explicit = tmp_path / "does-not-exist.toml"  # returned anyway: load_config reports it
    monkeypatch.setenv("AFMD_CONFIG", str(explicit))
    assert default_config_path() == explicit


@pytest.mark.usefixtures("no_brew")
def test_default_config_path_homebrew_prefix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for prefix in (first, second):
        (prefix / "etc" / "afmd").mkdir(parents=True)
        (prefix / "etc" / "afmd" / "config.toml").write_text("")
    monkeypatch.setattr(config_mod, "BREW_PREFIXES", (str(tmp_path / "missing"), str(second)))
    assert default_config_path() == second / "etc" / "afmd" / "config.toml"
    monkeypatch.setenv("HOMEBREW_PREFIX", str(first))
    assert default_config_path() == first / "etc" / "afmd" / "config.toml"
    assert default_config_path(env={}) == second / "etc" / "afmd" / "config.toml"


def test_tilde_is_the_home_folder_in_every_path(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A path the config names means the same with "~" as the shell's, as the instructions
    file, the cache folder and a model's path already did. A Unix socket at "~/afmd.sock"
    was bound under a folder named "~" in the working directory (a start that failed with
    "No such file or directory" under launchd); a server tool's file and folder were looked
    for the same way, and failed at the model's first call; ``--config ~/x.toml`` written
    where no shell expands it (a launchd plist, ``--config=~/...``) was not found."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tools.py").write_text("def add(a, b):\n    return a + b\n")
    text = ('[server]\nunix_socket = "~/afmd.sock"\n'
            '[[tools.server]]\nname = "add"\npython = "~/tools.py:add"\n'
            '[[tools.server]]\nname = "ls"\ncommand = ["ls"]\ncwd = "~"\n')
    write(tmp_path, text)
    cfg = load_config("~/config.toml", env={})
    assert cfg.server.unix_socket == f"{tmp_path}/afmd.sock"
    assert [(t.python, t.cwd) for t in cfg.tools.server] == [
        (f"{tmp_path}/tools.py:add", ""), ("", str(tmp_path))]
    assert cfg.source == f"{tmp_path}/config.toml"
    overridden = load_config(env={"AFMD_SERVER_UNIX_SOCKET": "~/env.sock"})
    assert overridden.server.unix_socket == f"{tmp_path}/env.sock"


@pytest.mark.parametrize("host", ["http://127.0.0.1", "127.0.0.1:8080", " 127.0.0.1",
                                  "localhost/", "[::1]", "0.0.0.0 "])
def test_a_host_that_cannot_be_one_names_the_key(host: str) -> None:
    """A URL, a port or a space in the host passed the config and failed the bind at start
    (exit 1, "Name or service not known", the key unnamed)."""
    with pytest.raises(ConfigError) as info:
        load_config(env={"AFMD_SERVER_HOST": host})
    assert info.value.key == "server.host"
    assert "(from AFMD_SERVER_HOST)" in info.value.message


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "fe80::1%lo",
                                  "localhost", "my-mac.local"])
def test_addresses_and_names_are_hosts(host: str) -> None:
    assert load_config(env={"AFMD_SERVER_HOST": host}).server.host == host


@pytest.mark.parametrize("name", ["", " "])
def test_an_alias_needs_a_name(tmp_path: Path, name: str) -> None:
    """Served, a nameless alias was listed in /v1/models with id "" and answered requests
    whose model is "", as no model id may be."""
    error = error_for(tmp_path, f'[models.aliases]\n"{name}" = "demo"\n')
    assert error.key == f'models.aliases."{name}"'
    assert "alias needs a name" in error.message
