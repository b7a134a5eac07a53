"""The model commands: ``afmd pull``, ``list``, ``ps``, ``rm``, ``show`` and ``cache clear``.

Models on disk live in the Hugging Face hub cache (:mod:`afmd.hub.cache`), pulled by
:mod:`afmd.hub.download`; what a running server has loaded comes from its ``/health`` (found as
``afmd doctor`` finds it, :mod:`afmd.cli.endpoint`). Output is a table on a terminal and, with
``--json``, objects with fixed keys for tools. Failures are one sentence on stderr and exit
code 1 (2: bad configuration or usage), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from afmd.cli import endpoint
from afmd.config.bounds import ConfigError
from afmd.config.load import default_config_path, load_config
from afmd.config.sections import BUILTIN_SYSTEM_PATH, Config
from afmd.config.tables import ModelEntry
from afmd.engine.models.kinds import BUILTIN_PREFIX
from afmd.hub import cache as hubcache
from afmd.hub.cache import human_bytes
from afmd.paths import huggingface_hub_cache, models_cache_dir

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
SERVING = ("loaded", "loading")
#: ``afmd show --json``'s keys, each in every answer (None: not known, or not for that
#: model): a tool reading ``size_bytes`` of every model ``afmd list`` names meets Apple's
#: model too, which has no files and describes itself with keys of its own besides.
SHOW_KEYS = ("id", "path", "repo", "architecture", "model_type", "parameters", "quantization",
             "context_length", "kind", "chat_template", "tool_format", "reasoning_format",
             "fim", "vocab_size", "size_bytes")


class CommandError(Exception):
    """A failure to report in one sentence; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------- arguments


def add_parsers(commands: Any) -> None:
    """The model commands' subparsers, on ``afmd``'s own."""
    def common(p: argparse.ArgumentParser, *, server: bool, as_json: bool = True) -> None:
        p.add_argument("--config", metavar="FILE",
                       help="config file (default: as `afmd serve` finds it)")
        if server:
            p.add_argument("--url", metavar="URL",
                           help="the running server (http://HOST:PORT or unix:/path); "
                                "default: the config's endpoint, as `afmd doctor` finds it")
            p.add_argument("--timeout", metavar="S", type=endpoint.wait_seconds, default=2.0,
                           help="seconds to wait for the server (default 2)")
        if as_json:
            p.add_argument("--json", action="store_true", help="machine-readable output")

    pull = commands.add_parser(
        "pull", help="download an MLX model from the Hugging Face hub",
        description="Download REPO (at REVISION: a branch, tag or commit; default main) into "
                    "the Hugging Face cache that mlx-lm and LM Studio use, one progress bar "
                    "per file, each file checked against the hub's sha256. Run it again to "
                    "resume an interrupted pull. Exit code 1: the pull failed.")
    pull.add_argument("ref", metavar="REPO[@REVISION]")

    listing = commands.add_parser(
        "list", help="models on disk and configured",
        description="Models in the Hugging Face cache and in the config: size, quantization, "
                    "context length, whether configured, whether the running server has "
                    "them loaded.")
    common(listing, server=True)

    ps = commands.add_parser(
        "ps", help="the running server's loaded models",
        description="The running server's loaded models: memory, active and queued "
                    "requests, idle time, expiry. Exit code 1: no server answers.")
    common(ps, server=True)

    rm = commands.add_parser(
        "rm", help="delete downloaded models",
        description="Delete each REPO (every revision) from the Hugging Face cache, after "
                    "confirmation. Refused while the running server has it loaded.")
    rm.add_argument("repos", metavar="REPO", nargs="+")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask")
    common(rm, server=True, as_json=False)

    show = commands.add_parser(
        "show", help="what a model is: architecture, formats, FIM, kind",
        description="Architecture, parameters, quantization, context length, chat template "
                    "family, tool-call and reasoning formats, FIM support and kind of MODEL "
                    "(a configured id or alias, a downloaded repo or a model folder), read "
                    "from its files without loading the weights.")
    show.add_argument("model", metavar="MODEL")
    common(show, server=False)

    cache = commands.add_parser(
        "cache", help="the prefix KV cache: clear it",
        description="The prefix KV cache's blocks, in the running server's memory and in "
                    "[cache] disk_dir (docs/kv-cache.md).")
    verbs = cache.add_subparsers(dest="cache_command", metavar="VERB", required=True)
    clear = verbs.add_parser(
        "clear", help="empty the KV cache's tiers (RAM and disk)",
        description="Empty the prefix KV cache: the running server's blocks in RAM and on "
                    "disk (asked of the server when one answers), else the block files in "
                    "[cache] disk_dir. --model: only that model's (an id, an alias or a repo "
                    "the server serves).")
    clear.add_argument("--model", metavar="ID", help="only this model's blocks")
    common(clear, server=True)


def run(args: argparse.Namespace) -> int:
    command = {"pull": _pull, "list": _list, "ps": _ps, "rm": _rm, "show": _show,
               "cache": _cache}[args.command]
    try:
        return command(args)
    except CommandError as exc:
        print(f"afmd {args.command}: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"\nafmd {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `afmd list | head`
        return EXIT_OK


# ---------------------------------------------------------------------------- shared


def _config(path: str | None) -> Config:
    if path is None:
        found = default_config_path()
        path = str(found) if found is not None else None
    try:
        return load_config(path)
    except ConfigError as exc:
        raise CommandError(f"configuration error: {exc}", EXIT_USAGE) from None


def _endpoint(args: argparse.Namespace, config: Config) -> endpoint.Endpoint | None:
    if args.url is not None:  # `--url ''` is a malformed URL, not the config's endpoint
        try:
            return endpoint.from_url(args.url, config.server.api_key)
        except ValueError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from None
    return endpoint.from_config(config)


def _details(args: argparse.Namespace, config: Config) -> dict[str, dict[str, Any]]:
    """The running server's per-model detail; raises ServerUnreachable."""
    body = endpoint.health(_endpoint(args, config), args.timeout)
    details = body.get("model_details")
    if not isinstance(details, dict):
        raise endpoint.ServerUnreachable("the running server reports no per-model detail "
                                         "(an older afmd?)")
    return details


def built_demo(variant: str) -> Path | None:
    """The materialised folder of a built-in model, if the server has built it."""
    pattern = re.compile(rf"^{re.escape(variant)}-[0-9a-f]{{12}}$")
    root = models_cache_dir()
    try:
        found = sorted(e for e in root.iterdir() if pattern.match(e.name)
                       and (e / "config.json").is_file())
    except OSError:
        return None
    return found[-1] if found else None


def folder_of(entry: ModelEntry) -> Path | None:
    """Where a model's files are on disk now (a complete snapshot for a repo)."""
    if entry.path.startswith(BUILTIN_PREFIX):
        return built_demo(entry.path[len(BUILTIN_PREFIX):])
    local = Path(entry.path).expanduser()
    if os.path.isdir(local):  # False where the OS refuses to look (a name too long)
        return local
    if hubcache.REPO_ID.match(entry.path):
        return hubcache.complete_snapshot(entry.path)
    return None


def _print_json(payload: Any) -> None:
    print(json.dumps(payload, indent=2))


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in (header, *rows))


# ---------------------------------------------------------------------------- pull


class _Terminated(BaseException):
    """SIGTERM arrived during a pull. Not an Exception: nothing on the way out may take it
    for a failed download (retry it, or report it as the hub's)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _pull(args: argparse.Namespace) -> int:
    """A SIGTERM (``timeout``, a service manager, ``kill``) ends the pull as Ctrl-C does:
    unwound, so the hub client deletes the file it was writing, and said on stderr, where
    the default action killed it mid-file, with no word and a partial file left."""
    from afmd.hub.download import PullError, parse_ref, pull

    try:
        parse_ref(args.ref)
    except PullError as exc:  # typed wrong: usage, as `afmd rm` has it
        raise CommandError(str(exc), EXIT_USAGE) from None
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        pull(args.ref)
    except PullError as exc:
        raise CommandError(str(exc)) from None
    except _Terminated:
        print("afmd pull: stopped (SIGTERM); finished files are kept, and `afmd pull` "
              "again resumes", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    return EXIT_OK


def pull_before_serving(config: Config) -> int | None:
    """``afmd serve``: pull the default model first when it is a repo not on disk yet
    (with the progress ``afmd pull`` shows). None: go on serving; else the exit code."""
    entry = config.resolve_model(None)
    if entry is None or not hubcache.REPO_ID.match(entry.path) or os.path.exists(entry.path):
        return None
    if hubcache.complete_snapshot(entry.path) is not None:
        return None
    from afmd.hub.download import PullError, offline, pull

    if offline():
        return None  # offline on purpose: the server reports the model unavailable itself

    try:
        pull(entry.path)
    except PullError as exc:
        print(f"afmd serve: cannot pull the model {entry.path}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return None


# ---------------------------------------------------------------------------- list


def _list(args: argparse.Namespace) -> int:
    from afmd.engine.models.describe import summary

    config = _config(args.config)
    try:
        details: dict[str, dict[str, Any]] | None = _details(args, config)
        server_note = ""
    except endpoint.ServerUnreachable as exc:
        details, server_note = None, str(exc)
    known = details or {}
    loaded_paths = {d.get("path") for d in known.values() if d.get("state") in SERVING}

    def loaded(entry: ModelEntry) -> bool:
        # An id the server knows is its own answer: two ids may share a path (one repo with
        # two context lengths), and the other one's load says nothing of this one. Only an
        # id the server does not know (a config other than the server's, a cached repo it
        # serves under another id) is matched by its path.
        if entry.id in known:
            return known[entry.id].get("state") in SERVING
        return entry.path in loaded_paths

    rows: list[dict[str, Any]] = []
    extra: list[tuple[str, str]] = []  # (quantization, context) per row, for the table
    entries = [(e, True) for e in config.models.model]
    entries += [(ModelEntry(id=c.repo, path=c.repo), False)
                for c in hubcache.cached_repos() if c.complete
                and c.repo not in {e.path for e in config.models.model}]
    # The running server's own models that this command's config does not name (`afmd
    # serve --model ~/folder`, another config): they are what clients can ask for.
    ids, paths = {e.id for e, _ in entries}, {e.path for e, _ in entries}
    entries += [(ModelEntry(id=model_id, path=d["path"]), True)
                for model_id, d in known.items()
                if model_id not in ids and isinstance(d.get("path"), str)
                and d["path"] not in paths]
    for entry, configured in entries:
        folder = folder_of(entry)
        rows.append({
            "id": entry.id,
            "repo": entry.path if hubcache.REPO_ID.match(entry.path) else None,
            "path": str(folder) if folder is not None else None,
            "size_bytes": hubcache.snapshot_size(folder) if folder is not None else 0,
            "configured": configured,
            "loaded": loaded(entry),
        })
        info = summary(folder, entry) if folder is not None else {}
        if entry.path == BUILTIN_SYSTEM_PATH:  # Apple's model: the system's, on the device
            from afmd.engine.apple.framework import context_length

            info = {"context_length": entry.context_length or context_length()}
        extra.append((str(info.get("quantization", "-")), str(info.get("context_length", "-"))))
    partial = [c for c in hubcache.cached_repos() if not c.complete]

    if args.json:
        _print_json({"models": rows})
        return EXIT_OK
    table = [(r["id"], human_bytes(r["size_bytes"]) if r["path"] else
              "on-device" if e.path == BUILTIN_SYSTEM_PATH else "not on disk", q, c,
              "yes" if r["configured"] else "-", "yes" if r["loaded"] else "-")
             for r, (q, c), (e, _) in zip(rows, extra, entries, strict=True)]
    print(_table(("ID", "SIZE", "QUANTIZATION", "CONTEXT", "CONFIGURED", "LOADED"), table))
    # The notes go beside the table, not under it: `afmd list | awk 'NR > 1 {print $1}'`
    # reads model ids, as with `ollama list`, and took "cache:" and "loaded" for two more.
    sys.stdout.flush()
    for c in partial:
        print(f"partial download: {c.repo} (missing {', '.join(c.missing)}): "
              f"`afmd pull {c.repo}` resumes it", file=sys.stderr)
    print(f"cache: {huggingface_hub_cache()}", file=sys.stderr)
    if server_note:
        print(f"loaded state unknown: {server_note}", file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------------------- ps


def ps_row(model_id: str, detail: dict[str, Any], now: float) -> dict[str, Any]:
    """One ``afmd ps --json`` row from /health's detail (instants become durations)."""
    idle_since, expires_at = detail.get("idle_since"), detail.get("expires_at")
    idle = (round(max(0.0, now - idle_since), 1) if idle_since is not None
            else 0.0 if detail.get("state") == "loaded" else None)
    return {"id": model_id, "state": detail.get("state"),
            "memory_bytes": detail.get("memory_bytes"), "active": detail.get("active", 0),
            "queued": detail.get("queued", 0), "idle_s": idle,
            "expires_in_s": (round(max(0.0, expires_at - now), 1) if expires_at is not None
                             else None),
            "kv_cache": detail.get("kv_cache")}


def _ps(args: argparse.Namespace) -> int:
    config = _config(args.config)
    try:
        details = _details(args, config)
    except endpoint.ServerUnreachable as exc:
        raise CommandError(str(exc)) from None
    rows = [ps_row(model_id, d, time.time()) for model_id, d in details.items()
            if d.get("state") in SERVING]
    if args.json:
        _print_json({"models": rows})
        return EXIT_OK
    if not rows:
        print("no model is loaded")
        return EXIT_OK

    def seconds(value: float | None, none: str) -> str:
        return none if value is None else f"{value:.0f}s"

    def tier(r: dict[str, Any], name: str) -> str:
        kv = r.get("kv_cache")
        return human_bytes(kv[name]) if kv else "-"

    print(_table(("ID", "STATE", "MEMORY", "KV-RAM", "KV-DISK", "ACTIVE", "QUEUED", "IDLE",
                  "EXPIRES"), [
        (r["id"], r["state"], human_bytes(r["memory_bytes"]) if r["memory_bytes"] else "-",
         tier(r, "ram_bytes"), tier(r, "disk_bytes"),
         str(r["active"]), str(r["queued"]), seconds(r["idle_s"], "-"),
         seconds(r["expires_in_s"], "never")) for r in rows]))
    return EXIT_OK


# ---------------------------------------------------------------------------- rm


def _refuse_if_served(args: argparse.Namespace, config: Config, repo: str) -> None:
    """Refuse to delete a repo the running server has loaded or is loading."""
    try:
        details = _details(args, config)
    except endpoint.ServerUnreachable:
        return  # no server: nothing can have it loaded
    serving = [i for i, d in details.items()
               if d.get("state") in SERVING and repo in (i, d.get("path"))]
    if serving:
        raise CommandError(f"{repo} is loaded by the running server (as model "
                           f"'{serving[0]}'); stop the server or serve another model first")


def _remove(args: argparse.Namespace, config: Config, repo: str, folder: Path) -> int | None:
    """Delete ``repo``; the bytes freed, None when it was gone already.

    A running server deletes it itself (Ollama's ``/api/delete``): it refuses a model it
    has loaded, is loading or is pulling in the same step as it deletes, where a look at
    its /health followed by a delete here left a load free to start in between, on files
    about to go (the look before asking stays, for its plainer message). Deleted here
    when no server answers, or when the server's own cache has no such repo (a server
    run with another ``HF_HOME``: nothing of it uses these files)."""
    target = _endpoint(args, config)
    if target is not None:
        size = hubcache.stored_bytes(folder)
        try:
            status, answer = _ask_server(target, "DELETE", "/api/delete", {"model": repo},
                                         args.timeout)
        except endpoint.ServerUnreachable:
            pass
        else:
            if status == 200:
                return size
            if status == 409:  # loaded, loading or pulled: in the server's own words
                error = answer.get("error") if isinstance(answer, dict) else None
                raise CommandError(f"{repo} is in use by the running server: {error}"
                                   if isinstance(error, str) else
                                   f"{repo} is in use by the running server")
            if status != 404:
                raise _refusal(target, status, answer)
    return hubcache.remove(repo)


def _rm(args: argparse.Namespace) -> int:
    """Each repo in turn, as ``ollama rm a b`` takes several: one that cannot go is said
    (and makes the exit code) and the others are still deleted."""
    if len(args.repos) == 1:
        return _rm_one(args, args.repos[0])
    code = EXIT_OK
    for name in args.repos:
        try:
            code = max(code, _rm_one(args, name))
        except CommandError as exc:
            print(f"afmd rm: {exc}", file=sys.stderr)
            code = max(code, exc.code)
    return code


def _rm_one(args: argparse.Namespace, name: str) -> int:
    repo = hubcache.plain_name(name)
    if not hubcache.REPO_ID.match(repo):
        raise CommandError(f"'{name}' is not a Hugging Face repo id (OWNER/NAME)", EXIT_USAGE)
    cached = hubcache.inspect(repo)
    if cached is None:
        raise CommandError(f"{repo} is not in the Hugging Face cache ({huggingface_hub_cache()})")
    config = _config(args.config)
    _refuse_if_served(args, config, repo)
    # What the delete frees (every revision, and the folder's own files), as it reports it.
    size = human_bytes(hubcache.stored_bytes(cached.folder))
    if not args.yes:
        try:
            answer = input(f"Delete {repo} ({size}) from {cached.folder}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print(f"{repo}: nothing deleted")
            return EXIT_FAILURE
    linked = cached.folder.resolve() if cached.folder.is_symlink() else None
    freed = _remove(args, config, repo, cached.folder)
    if freed is None:
        raise CommandError(f"{repo} is no longer in the Hugging Face cache (deleted meanwhile)")
    print(f"deleted {repo} ({human_bytes(freed)} freed)")
    if linked is not None:
        print(f"note: the cache only linked to it: its files in {linked} were left")
    still = [e.id for e in config.models.model if e.path == repo]
    if still:
        print(f"note: the config still lists it as model '{still[0]}': a server would "
              "download it again on first use")
    return EXIT_OK


# ---------------------------------------------------------------------------- show


def _configured(name: str, config: Config) -> ModelEntry | None:
    """The configured model (or alias) ``name`` names, as the server's routes read it:
    Ollama's ``demo:latest`` is ``demo``."""
    return config.resolve_model(name) or config.resolve_model(hubcache.plain_name(name))


def _show_entry(name: str, config: Config) -> ModelEntry:
    entry = _configured(name, config)
    if entry is not None:
        return entry
    local = Path(name).expanduser()
    if name and os.path.isdir(local):  # "" is Path("."): whatever folder the shell is in
        return ModelEntry(id=local.resolve().name, path=str(local))
    repo = hubcache.plain_name(name)
    if hubcache.REPO_ID.match(repo):
        return ModelEntry(id=repo, path=repo)
    raise CommandError(f"'{name}' is neither a configured model, a model folder nor a "
                       "Hugging Face repo id")


def _show(args: argparse.Namespace) -> int:
    config = _config(args.config)
    entry = _show_entry(args.model, config)
    if entry.path == BUILTIN_SYSTEM_PATH:  # Apple's model: no folder, the framework says
        from afmd.engine.apple import framework

        return _print_info(framework.describe(entry), args.json)
    folder = folder_of(entry)
    if folder is None:
        if entry.path.startswith(BUILTIN_PREFIX):
            raise CommandError(f"the built-in model '{entry.id}' is not built yet: `afmd "
                               "serve` builds it at its first start")
        if not hubcache.REPO_ID.match(entry.path):  # a folder: nothing to pull
            raise CommandError(f"model '{entry.id}': its folder {entry.path} does not exist")
        raise CommandError(f"{entry.path} is not downloaded: `afmd pull {entry.path}`")
    if not (folder / "config.json").is_file():
        raise CommandError(f"{folder} has no config.json: not an MLX model folder")
    from afmd.engine.models.describe import describe

    info: dict[str, Any] = {
        "id": entry.id, "path": str(folder),
        "repo": entry.path if hubcache.REPO_ID.match(entry.path) else None,
        **describe(folder, entry),
        "size_bytes": hubcache.snapshot_size(folder),
    }
    return _print_info(info, args.json)


def _print_info(info: dict[str, Any], as_json: bool) -> int:
    if as_json:
        _print_json({**dict.fromkeys(SHOW_KEYS), **info})
        return EXIT_OK
    labels = {"parameters": lambda v: f"{v:,}", "size_bytes": human_bytes}
    for key, value in info.items():
        shown = "-" if value is None else labels.get(key, str)(value)
        print(f"{key.replace('_', ' '):<18}{shown}")
    return EXIT_OK


# ---------------------------------------------------------------------------- cache


def _ask_server(target: endpoint.Endpoint, method: str, path: str, body: dict[str, Any],
                timeout: float) -> tuple[int, Any]:
    """The running server's status and JSON answer (None: not JSON) to one request;
    ``ServerUnreachable`` when none answers."""
    import http.client

    headers = {"Content-Type": "application/json", **endpoint.request_headers(target.api_key)}
    conn = target.connect(timeout)
    try:
        conn.request(method, path, body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        raw = response.read(1 << 20)
    except (OSError, http.client.HTTPException) as exc:
        raise endpoint.ServerUnreachable(f"no afmd server answers at {target.label}: "
                                         f"{exc}") from None
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw) if raw else None
    except ValueError:
        return response.status, None


def _refusal(target: endpoint.Endpoint, status: int, answer: Any) -> CommandError:
    """A server's refusal, in its words (OpenAI's envelope or Ollama's)."""
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    # The server's own 401 tells an HTTP client which header to send; someone at this
    # command needs to know where the command reads the key from.
    advice = f"; {endpoint.key_advice(bool(target.api_key))}" if status == 401 else ""
    return CommandError(f"the server at {target.label} refused: HTTP {status}"
                        + (f": {message}" if isinstance(message, str) and message else "")
                        + advice)


def _post_clear(target: endpoint.Endpoint, model: str | None, timeout: float) -> dict[str, Any]:
    """Ask the running server to clear (``ServerUnreachable`` when none answers)."""
    from afmd.engine.kvcache.folder import CLEAR_PATH

    status, answer = _ask_server(target, "POST", CLEAR_PATH, {"model": model} if model else {},
                                 timeout)
    if status != 200 or not isinstance(answer, dict):
        raise _refusal(target, status, answer)
    return answer


def _cache_model(name: str, config: Config) -> str:
    """The model id whose blocks ``--model`` names, as the server resolves it: a
    configured id or alias, else a repo id, served under its configured id when one has
    that path and else under its own (a download, or `afmd serve --model REPO`, which
    this command's config does not list); the server says whether it knows it."""
    entry = _configured(name, config)
    if entry is not None:
        return entry.id
    repo = hubcache.plain_name(name)
    if not hubcache.REPO_ID.match(repo):
        raise CommandError(f"'{name}' is neither a configured model, an alias nor a Hugging "
                           "Face repo id", EXIT_USAGE)
    return next((e.id for e in config.models.model if e.path == repo), repo)


def _cache(args: argparse.Namespace) -> int:
    from afmd.engine.kvcache import folder as kv_folder

    config = _config(args.config)
    model = args.model
    if model is not None:
        model = _cache_model(model, config)
    try:
        target = _endpoint(args, config)
        if target is None:
            raise endpoint.ServerUnreachable("no endpoint")
        answer = _post_clear(target, model, args.timeout)
        ram = sum(c.get("ram_bytes", 0) for c in answer.get("cleared", []))
        disk, where = answer.get("disk_bytes", 0), f"the server at {target.label}"
    except endpoint.ServerUnreachable:
        root = kv_folder.resolve(config.cache.disk_dir)
        ram, (_, disk), where = 0, kv_folder.clear(root, model), str(root)
    if args.json:
        _print_json({"model": model, "ram_bytes": ram, "disk_bytes": disk, "where": where})
    else:
        print(f"cleared {human_bytes(ram)} in RAM and {human_bytes(disk)} on disk "
              f"({'model ' + model if model else 'every model'}; {where})")
    return EXIT_OK

