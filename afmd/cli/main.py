"""The ``afmd`` command.

Exit codes are part of the daemon contract, because launchd's ``keep_alive`` acts on them:
0 clean stop, 1 runtime failure (the server could not start or keep serving), 2 bad
configuration or usage. The heavy stack (MLX, mlx-lm, Sanic) is imported only by the
commands that serve, so ``--help``, ``version`` and ``check-config`` answer instantly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from afmd import __version__
from afmd.cli.endpoint import wait_seconds
from afmd.cli.stdout import guarded
from afmd.config.bounds import ConfigError
from afmd.config.load import default_config_path, load_config
from afmd.config.sections import Config
from afmd.distributed.launch import add_parser as launch_parser

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2

DESCRIPTION = """\
afmd — the local AI daemon for Apple Silicon.

Serves MLX models (through mlx-lm) behind the OpenAI Chat Completions API on
http://127.0.0.1:9999/v1, so OpenAI SDKs, IDE plugins and agents work unchanged.
Run `afmd serve` to start it on the built-in demo model (no download needed)."""

EPILOG = """\
examples:
  afmd serve                                   # demo model on 127.0.0.1:9999
  afmd serve --config ~/.config/afmd.toml      # settings from a TOML file
  afmd serve --model mlx-community/Qwen2.5-0.5B-Instruct-4bit
  afmd serve --host "" --unix-socket /tmp/afmd.sock
  afmd check-config config.toml                # validate a config file
  afmd doctor                                  # config, endpoint, server, port, models
  afmd pull mlx-community/Qwen2.5-0.5B-Instruct-4bit   # download with progress, verified
  afmd list / afmd ps / afmd show MODEL / afmd rm REPO # models on disk, loaded, described

exit codes: 0 clean stop, 1 runtime failure, 2 bad configuration."""



#: Set (unless the user set them) before anything imports mlx-lm or the hub client, which
#: read them at import: transformers prints plain-text warnings that would break the JSON
#: log (afmd reports what matters itself), and the hub client's telemetry asks the hub
#: for things of its own (a registry of coding agents, read to its end, on a pull's first
#: request of the day), where afmd asks it only for the pulls a user asks for.
LIBRARY_ENVIRONMENT = {"TRANSFORMERS_VERBOSITY": "error",
                       "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
                       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afmd",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"afmd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="start the server",
        description="Start the OpenAI-compatible server and serve until SIGINT/SIGTERM/SIGHUP.",
    )
    serve.add_argument("--config", metavar="FILE",
                       help="TOML config file (default: $AFMD_CONFIG, then "
                            "$(brew --prefix)/etc/afmd/config.toml if present)")
    serve.add_argument("--host", metavar="H",
                       help='TCP address to listen on (default 127.0.0.1; "" for none)')
    serve.add_argument("--port", metavar="P", type=int, help="TCP port (default 9999; 0 = any)")
    serve.add_argument("--unix-socket", metavar="PATH", help="also listen on this Unix socket")
    serve.add_argument("--model", metavar="ID_OR_PATH",
                       help="model to serve by default: a configured id or alias, a local "
                            "MLX model folder, or a Hugging Face repo id")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    serve.add_argument("--log-format", choices=("json", "console"))

    check = commands.add_parser(
        "check-config",
        help="validate a config file and exit",
        description="Load a config file exactly as `afmd serve` would and report problems.",
    )
    check.add_argument("file", metavar="FILE")

    launch_parser(commands)
    commands.add_parser("version", help="print the version")

    doctor = commands.add_parser(
        "doctor",
        help="diagnose a setup: config, endpoint, running server, port owner, models",
        description="Report which config file afmd reads, the endpoint to give clients, "
                    "whether a server answers there (and its /health), whether the port is "
                    "taken and by which process, and each model's cache state. Exit code 0: "
                    "no problem found; 1: a problem was found; 2: the config is invalid.",
    )
    doctor.add_argument("--config", metavar="FILE",
                        help="config file to check (default: as `afmd serve` finds it)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--timeout", metavar="S", type=wait_seconds, default=2.0,
                        help="seconds to wait for a running server's /health (default 2)")

    from afmd.cli import model_commands as cli_models

    cli_models.add_parsers(commands)
    return parser


def _load(path: str | None, overrides: dict[str, Any]) -> Config:
    if path is None:
        found = default_config_path()
        path = str(found) if found is not None else None
    return load_config(path, overrides=overrides)


def _config_error(exc: ConfigError) -> int:
    print(f"afmd: configuration error: {exc}", file=sys.stderr)
    return EXIT_CONFIG


def _stop_while_starting(signum: int, frame: Any) -> None:
    raise SystemExit(EXIT_OK)


def _serve(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {
        "server.host": args.host,
        "server.port": args.port,
        "server.unix_socket": args.unix_socket,
        "log.level": args.log_level,
        "log.format": args.log_format,
        "model": args.model,
    }
    try:
        config = _load(args.config, overrides)
    except ConfigError as exc:
        from afmd.distributed.env import write_outcome

        write_outcome(EXIT_CONFIG, "configuration error")  # under `afmd launch`
        return _config_error(exc)

    # Until the server's own handlers are in place (importing MLX takes a second or two), a
    # SIGTERM/SIGINT/SIGHUP is a clean stop: there is nothing in flight to drain yet.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop_while_starting)

    # A Hugging Face model not on disk yet is pulled first, with the progress `afmd pull`
    # shows, so a first start is not a silent download behind a "loading" model.
    from afmd.cli.model_commands import pull_before_serving

    try:
        failed = pull_before_serving(config)
    except SystemExit as exc:
        failed = exc.code if isinstance(exc.code, int) else EXIT_OK
    if failed is not None:
        return failed
    try:
        from afmd import logs

        logs.configure(config.log.level, config.log.format)

        from afmd.distributed.env import launched

        if launched():  # one rank of `afmd launch`
            from afmd.distributed.rank import serve_rank

            code = serve_rank(config)
        else:
            from afmd.server import run

            code = run(config)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else EXIT_OK
    # Skip interpreter teardown: MLX's native threads can abort the process while Python
    # finalises ("terminate called without an active exception"), turning a clean stop
    # into a crash exit code that launchd would treat as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        return _config_error(exc)
    models = ", ".join(config.model_ids())
    print(f"{args.file}: OK (default model {config.models.default}; models: {models})")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if argv is None and os.environ.get("AFMD_GRAMMAR_WORKER_FD"):
        # The frozen binary started as the grammar compile worker (afmd.grammar.sandbox).
        from afmd.grammar.sandbox import serve_from_env

        serve_from_env()
        return 0
    if raw[:1] == ["_mlx-launch"]:  # afmd launch runs MLX's launcher through this
        from afmd.engine.sharded.launcher_compat import mlx_launch

        return mlx_launch(raw[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    for key, value in LIBRARY_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    if args.command == "launch":
        from afmd.distributed.launch import run as launch

        return launch(args)
    if args.command == "serve":
        return _serve(args)
    if args.command is None:
        # No command is a usage error (exit 2, as argparse's own): the help goes to stderr,
        # so that `afmd > file` or a service definition missing `serve` does not pass for
        # output.
        parser.print_help(sys.stderr)
        return EXIT_CONFIG
    return guarded(lambda: _report(args), f"afmd {args.command}")


def _report(args: argparse.Namespace) -> int:
    """The commands that answer and exit (their output guarded by :func:`guarded`)."""
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "doctor":
        from afmd.cli.doctor import run as doctor

        return doctor(args.config, as_json=args.json, timeout=args.timeout)
    if args.command in ("pull", "list", "ps", "rm", "show", "cache"):
        from afmd.cli import model_commands as cli_models

        return cli_models.run(args)
    print(f"afmd {__version__}")  # version
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
