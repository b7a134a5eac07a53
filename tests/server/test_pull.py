"""``afmd pull`` against a hub stand-in on loopback (tests/helpers/hub.py): downloads into
the standard Hugging Face cache with progress, resumes a cut connection, checks every file
against the hub's hashes, refuses what is not an MLX model, and fails clearly offline.
Nothing here touches the network: ``HF_ENDPOINT`` points the real ``huggingface_hub``
client at the stand-in, ``HF_HOME`` at a temporary folder."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from afmd.engine.demo import builtin as demo
from afmd.hub.cache import complete_snapshot, human_bytes
from afmd.hub.download import LISTING_CAP, LISTING_WAITS, PullError, parse_ref
from afmd.hub.progress import bar_class
from afmd.ports import free_ports

from conftest import ROOT
from helpers.hub import FakeHub, safetensors_bytes
from helpers.servers import ServerProcess, run_afmd, start_server

pytestmark = pytest.mark.slow  # the hub stand-in and pulls through huggingface_hub

REPO = "test-org/tiny-mlx"
CHUNK = 10 * 1024 * 1024  # huggingface_hub writes what it received in chunks of this size


def tiny_model(weight_bytes: int = 4096) -> dict[str, bytes]:
    """An MLX-style repo: config, weights, tokenizer files and files a load never reads."""
    rows = max(1, weight_bytes // (4 * 64))
    return {
        "config.json": json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                   "max_position_embeddings": 512}).encode(),
        "model.safetensors": safetensors_bytes({"model.embed_tokens.weight": ("F32", [rows, 64])}),
        "tokenizer_config.json": b'{"model_max_length": 512}',
        "README.md": b"# tiny\n",
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "original/consolidated.pth": b"\0" * 64,
    }


@pytest.fixture()
def hub() -> Iterator[FakeHub]:
    with FakeHub() as running:
        yield running


@pytest.fixture()
def env(tmp_path: Path, hub: FakeHub) -> dict[str, str]:
    """The CLI's environment: the stand-in hub, a private cache, no server to find."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("AFMD_", "HF_", "HUGGINGFACE_"))}
    return {**base, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "AFMD_CACHE_DIR": str(tmp_path / "afmd"),
            "AFMD_SERVER_PORT": str(free_ports()), "PYTHONPATH": str(ROOT)}


def afmd(env: dict[str, str], *args: str, stdin: str | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_afmd(args, env=env, input=stdin, timeout=timeout, cwd=ROOT)


def cache_of(env: dict[str, str]) -> Path:
    return Path(env["HF_HOME"]) / "hub"


def listed(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    result = afmd(env, "list", "--json")
    assert result.returncode == 0, result.stderr
    return {m["id"]: m for m in json.loads(result.stdout)["models"]}


def assert_clean_failure(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


# ---------------------------------------------------------------------------- refs


@pytest.mark.parametrize("ref", [
    "a/b\n", "a/..", "a/b..c", "a--b/c", "\u00e4/b", "a/b.", "a/-b", "a/b/c",
    "a/b@../../x", "a/b@refs/../x", "a/b@/etc", "a/b@x\n", "a/b@", "a/b@x/", "a/b@a b",
])
def test_a_malformed_ref_is_refused(ref: str) -> None:
    """A repo id and a revision both become paths in the cache: the hub's rules, exactly."""
    with pytest.raises(PullError, match="is not a"):
        parse_ref(ref)


def test_a_malformed_ref_is_a_usage_error(hub: FakeHub, env: dict[str, str]) -> None:
    """What was typed wrong is exit 2, as ``afmd rm`` has it for the same repo id and the
    CLI's contract for usage; exit 1 is a pull that failed (hub, network, files)."""
    for ref in ("a/b/c", "", "a/b@../x"):
        result = afmd(env, "pull", ref)
        assert result.returncode == 2, (ref, result.stderr)
        assert "is not a" in result.stderr and "Traceback" not in result.stderr
    assert not hub.log  # refused before asking anything


def test_well_formed_refs() -> None:
    assert parse_ref("mlx-community/Qwen2.5-0.5B-Instruct-4bit") == (
        "mlx-community/Qwen2.5-0.5B-Instruct-4bit", "main")
    assert parse_ref("Org_1/x_@refs/pr/12") == ("Org_1/x_", "refs/pr/12")
    commit = "0123456789abcdef" * 2 + "01234567"
    assert parse_ref(f"a/b@{commit}") == ("a/b", commit)
    assert parse_ref("a/b@v1.0-rc.2") == ("a/b", "v1.0-rc.2")
    # Ollama's name for a hub repo; a repo of an owner called so is still that repo.
    assert parse_ref("hf.co/a/b") == parse_ref("HuggingFace.co/a/b@main") == ("a/b", "main")
    assert parse_ref("hf.co/b") == ("hf.co/b", "main")
    # Ollama's default tag, which its users add (`ollama pull hf.co/OWNER/NAME:latest`).
    assert parse_ref("hf.co/a/b:latest") == parse_ref("a/b:latest") == ("a/b", "main")


# ---------------------------------------------------------------------------- pulling


def test_pull_downloads_verified_files_into_the_hub_cache(hub: FakeHub,
                                                          env: dict[str, str]) -> None:
    files = tiny_model()
    commit = hub.add_repo(REPO, files)
    result = afmd(env, "pull", REPO)
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert f"pulling {REPO}@main (commit {commit[:12]})" in err
    # One progress line per file (not a terminal: plain lines), a file's end with its rate.
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        assert any(line.strip().startswith(f"{name}: ") and "(100%)" in line and "/s" in line
                   for line in err.splitlines()), err
    assert "\r" not in err
    assert "verified 3 files" in err

    snapshot = cache_of(env) / "models--test-org--tiny-mlx" / "snapshots" / commit
    assert (cache_of(env) / "models--test-org--tiny-mlx" / "refs" / "main").read_text() == commit
    on_disk = {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()}
    # exactly what an mlx-lm load fetches (README, .gitattributes, original/ are not)
    assert on_disk == {"config.json", "model.safetensors", "tokenizer_config.json"}
    for name in on_disk:
        assert (snapshot / name).read_bytes() == files[name]
    # config.json came last: until it is there, no reader mistakes the folder for a model
    downloads = [r.path.rsplit("/", 1)[-1] for r in hub.log if r.method == "GET"
                 and "/resolve/" in r.path]
    assert downloads[-1] == "config.json"
    assert all(f"/resolve/{commit}/" in r.path for r in hub.log if "/resolve/" in r.path)

    # The hub client itself (what mlx-lm calls) finds the complete snapshot offline.
    from huggingface_hub import snapshot_download

    from afmd.hub.download import ALLOW_PATTERNS

    found = snapshot_download(REPO, cache_dir=str(cache_of(env)), local_files_only=True,
                              allow_patterns=list(ALLOW_PATTERNS))
    assert Path(found) == snapshot

    # Pulling again downloads nothing and says so.
    fetched = [r for r in hub.log if r.method == "GET" and "/resolve/" in r.path]
    again = afmd(env, "pull", REPO)
    assert again.returncode == 0, again.stderr
    assert "config.json: already downloaded" in again.stderr
    assert [r for r in hub.log if r.method == "GET" and "/resolve/" in r.path] == fetched


def test_pull_at_a_revision(hub: FakeHub, env: dict[str, str]) -> None:
    commit = hub.add_repo(REPO, tiny_model(), tags=("v1.0",))
    result = afmd(env, "pull", f"{REPO}@v1.0")
    assert result.returncode == 0, result.stderr
    refs = cache_of(env) / "models--test-org--tiny-mlx" / "refs"
    assert (refs / "v1.0").read_text() == commit
    assert not (refs / "main").exists()
    assert any(r.path == f"/api/models/{REPO}/revision/v1.0" for r in hub.log)

    missing = afmd(env, "pull", f"{REPO}@v2.0")
    assert_clean_failure(missing, f"{REPO} has no revision 'v2.0'")


def test_a_cut_connection_resumes_with_range(hub: FakeHub, env: dict[str, str]) -> None:
    files = tiny_model(weight_bytes=CHUNK + CHUNK // 4)
    commit = hub.add_repo(REPO, files)
    hub.cut(REPO, "model.safetensors", after=CHUNK + 4096)
    result = afmd(env, "pull", REPO)
    assert result.returncode == 0, result.stderr
    gets = hub.gets("model.safetensors")
    assert len(gets) == 2, gets
    assert gets[0].range is None
    assert gets[1].range == f"bytes={CHUNK}-", gets  # the bytes it had kept were not refetched
    weights = cache_of(env) / "models--test-org--tiny-mlx" / "snapshots" / commit / \
        "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == \
        hashlib.sha256(files["model.safetensors"]).hexdigest()
    assert "verified 3 files" in result.stderr


def test_an_interrupted_pull_is_not_present_and_a_second_pull_finishes_it(
        hub: FakeHub, env: dict[str, str]) -> None:
    hub.add_repo(REPO, tiny_model())
    hub.fail(REPO, "model.safetensors", 500)
    failed = afmd(env, "pull", REPO)
    assert_clean_failure(failed, "downloading model.safetensors", "HTTP 500",
                         "run the pull again to resume")
    # Nothing half-downloaded is reported as present.
    assert REPO not in listed(env)
    shown = afmd(env, "show", REPO)
    assert_clean_failure(shown, f"{REPO} is not downloaded: `afmd pull {REPO}`")
    table = afmd(env, "list")
    assert f"partial download: {REPO}" in table.stderr
    # stdout is the table alone, as `ollama list`'s: `afmd list | awk 'NR > 1 {print $1}'`
    # read "partial", "cache:" and "loaded" (no server) as three more model ids.
    rows = [line.split()[0] for line in table.stdout.splitlines()[1:]]
    assert rows == list(listed(env)), table.stdout

    hub.failures.clear()
    done = afmd(env, "pull", REPO)
    assert done.returncode == 0, done.stderr
    assert "tokenizer_config.json: already downloaded" in done.stderr
    assert len(hub.gets("tokenizer_config.json")) == 1  # kept from the first pull
    assert listed(env)[REPO]["size_bytes"] > 0


@pytest.mark.parametrize(("name", "check"), [("model.safetensors", "sha256"),
                                             ("tokenizer_config.json", "git blob id")])
def test_a_corrupted_file_is_rejected_and_deleted(hub: FakeHub, env: dict[str, str],
                                                  name: str, check: str) -> None:
    commit = hub.add_repo(REPO, tiny_model())
    hub.corrupt(REPO, name)
    result = afmd(env, "pull", REPO)
    assert_clean_failure(result, f"{name} failed verification ({check} ",
                         "the file was deleted, run the pull again")
    snapshot = cache_of(env) / "models--test-org--tiny-mlx" / "snapshots" / commit
    assert not (snapshot / name).exists()
    blobs = cache_of(env) / "models--test-org--tiny-mlx" / "blobs"
    bad = hashlib.sha256(bytes([tiny_model()[name][0] ^ 0xFF]) + tiny_model()[name][1:])
    assert all(hashlib.sha256(b.read_bytes()).digest() != bad.digest() for b in blobs.iterdir())
    assert REPO not in listed(env)

    hub.corrupted.clear()
    assert afmd(env, "pull", REPO).returncode == 0
    assert (snapshot / name).read_bytes() == tiny_model()[name]


def test_a_repo_that_is_not_an_mlx_model_is_refused(hub: FakeHub, env: dict[str, str]) -> None:
    hub.add_repo("test-org/pytorch-only", {"config.json": b"{}",
                                           "pytorch_model.bin": b"\0" * 128})
    hub.add_repo("test-org/no-config", {"model.safetensors": safetensors_bytes({}),
                                        "README.md": b"x"})
    for repo, lacks in (("test-org/pytorch-only", "no model*.safetensors weights"),
                        ("test-org/no-config", "no config.json")):
        result = afmd(env, "pull", repo)
        assert_clean_failure(result, f"{repo} is not an MLX model: it has {lacks}",
                             "mlx-community")
    assert not [r for r in hub.log if "/resolve/" in r.path]  # refused before downloading
    assert not (cache_of(env) / "models--test-org--pytorch-only").exists()


def test_offline_and_unknown_repos_fail_clearly(hub: FakeHub, env: dict[str, str]) -> None:
    offline = afmd({**env, "HF_HUB_OFFLINE": "1"}, "pull", REPO)
    assert_clean_failure(offline, "offline mode is on (HF_HUB_OFFLINE is set)")

    port = free_ports()  # nothing listens there: the hub is unreachable
    unreachable = afmd({**env, "HF_ENDPOINT": f"http://127.0.0.1:{port}"}, "pull", REPO)
    assert_clean_failure(unreachable, f"cannot reach the Hugging Face hub at "
                                      f"http://127.0.0.1:{port}", "check the network")

    unknown = afmd(env, "pull", "test-org/no-such-model")
    assert_clean_failure(unknown, "test-org/no-such-model was not found on")

    bad = afmd(env, "pull", "not a repo")  # exit 2: test_a_malformed_ref_is_a_usage_error
    assert bad.returncode == 2 and "'not a repo' is not a Hugging Face repo id" in bad.stderr
    asked = len(hub.log)
    escape = afmd(env, "pull", f"{REPO}@../../../outside")
    assert escape.returncode == 2 and "'../../../outside' is not a revision" in escape.stderr
    assert len(hub.log) == asked, "a malformed revision reached the hub"
    assert listed(env).keys() == {"demo", "demo-32k", "demo-embedding", "demo-vision", "system"}


def test_progress_on_a_terminal_is_a_bar_per_file(hub: FakeHub, env: dict[str, str]) -> None:
    hub.add_repo(REPO, tiny_model(weight_bytes=256 * 1024))
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "afmd", "pull", REPO], env=env,
                            stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
                            cwd=str(ROOT))
    os.close(terminal)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(controller)
    assert proc.wait(30) == 0, out
    text = out.decode(errors="replace")
    assert "\r" in text  # redrawn in place
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        assert f"{name}: 100%|" in text, text  # tqdm's bar: percentage, bar, bytes, rate
    assert "| 256k/256k [" in text, text  # bytes done / total, then time, ETA and rate
    assert "B/s]" in text, text


# ---------------------------------------------------------------------------- hostile hubs


def test_a_hub_that_never_answers_fails_the_pull(hub: FakeHub, env: dict[str, str]) -> None:
    """The hub client sets no timeout on its API calls (its HTTP client's default is
    none), so a hub that took the connection and never replied held ``afmd pull`` (and a
    server's pull thread) for ever. The listing is bounded by the hub client's own
    setting for metadata requests, ``HF_HUB_ETAG_TIMEOUT``."""
    hub.add_repo(REPO, tiny_model())
    hub.stalled = True
    result = afmd({**env, "HF_HUB_ETAG_TIMEOUT": "1"}, "pull", REPO, timeout=60)
    assert_clean_failure(result, f"the hub at {hub.url} did not answer within 1 s",
                         "HF_HUB_ETAG_TIMEOUT")
    assert REPO not in listed(env)


def test_the_bounded_listing_asks_and_reads_what_the_hub_client_does(
        hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing is read with bounds by afmd itself, through the hub client's HTTP
    session, in place of ``HfApi().model_info(files_metadata=True)``: it must ask the hub
    the same request and build the same ModelInfo, or an upgrade of the hub client that
    changed either would go unnoticed until a pull against the real hub."""
    from huggingface_hub import HfApi, constants

    from afmd.hub import download

    hub.add_repo(REPO, tiny_model(), tags=("v1.0",))
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)  # as `afmd pull` has it
    for revision in ("main", "v1.0"):
        del hub.log[:]
        theirs = HfApi(endpoint=hub.url).model_info(REPO, revision=revision,
                                                    files_metadata=True)
        ours = download._listing(REPO, revision)
        # (the hub client may also ask for its agent registry, for its user agent)
        asked, ours_asked = [r for r in hub.log if r.path.startswith("/api/models/")]
        # (the hub client may also ask for its agent registry, for its user agent)
        asked, ours_asked = [r for r in hub.log if r.path.startswith("/api/models/")]
        assert (ours_asked.method, ours_asked.path, ours_asked.query) == (
            asked.method, asked.path, asked.query)
        assert (ours.id, ours.sha, ours.siblings) == (theirs.id, theirs.sha, theirs.siblings)
        assert ours.siblings and all(s.blob_id and s.size is not None for s in ours.siblings)


def test_a_listing_without_end_fails_the_pull(hub: FakeHub, env: dict[str, str]) -> None:
    """The hub client reads a listing to its end, whatever its size: a hub (or a proxy, or
    an HF_ENDPOINT pointing somewhere wrong) that answered with JSON without end was read
    into memory until the process was killed. The read stops at a cap far past any real
    repo's listing, and the pull fails saying so."""
    hub.add_repo(REPO, tiny_model())
    hub.listing_without_end(REPO)
    result = afmd(env, "pull", REPO, timeout=60)
    assert_clean_failure(result, f"the hub at {hub.url} sent a listing of {REPO}@main longer "
                         f"than {human_bytes(LISTING_CAP)}", "HF_ENDPOINT")
    assert not [r for r in hub.log if "/resolve/" in r.path]
    assert REPO not in listed(env)


def test_a_listing_that_drips_fails_at_its_deadline(hub: FakeHub, env: dict[str, str]) -> None:
    """A byte every few hundredths of a second never trips a timeout between reads, so a
    listing that dripped without end held the pull for ever. The whole listing has a
    deadline, in waits of the hub client's HF_HUB_ETAG_TIMEOUT."""
    hub.add_repo(REPO, tiny_model())
    hub.listing_without_end(REPO, drip=True)
    started = time.monotonic()
    result = afmd({**env, "HF_HUB_ETAG_TIMEOUT": "1"}, "pull", REPO, timeout=60)
    took = time.monotonic() - started
    assert_clean_failure(result, f"the hub at {hub.url} did not finish the listing of "
                         f"{REPO}@main within {LISTING_WAITS} s", "HF_HUB_ETAG_TIMEOUT")
    assert LISTING_WAITS <= took < LISTING_WAITS + 20, took
    assert REPO not in listed(env)


def test_a_file_longer_than_the_hub_listed_is_cut_off(hub: FakeHub,
                                                      env: dict[str, str]) -> None:
    """The hub client writes whatever body it is sent and compares sizes only at the end,
    so a file sent without end filled the disk. The download stops once it passes the
    size the hub's tree listed, and what it wrote is deleted."""
    files = tiny_model()
    commit = hub.add_repo(REPO, files)
    hub.without_end(REPO, "model.safetensors")
    result = afmd(env, "pull", REPO, timeout=60)
    assert_clean_failure(result, "model.safetensors: the hub sent more than the "
                         f"{len(files['model.safetensors'])} bytes it listed")
    folder = cache_of(env) / "models--test-org--tiny-mlx"
    assert not (folder / "snapshots" / commit / "model.safetensors").exists()
    assert all(b.stat().st_size <= len(files["model.safetensors"])
               for b in (folder / "blobs").iterdir())
    hub.endless.clear()
    assert afmd(env, "pull", REPO).returncode == 0
    assert REPO in listed(env)


class MidFile:
    """An ``afmd pull`` of REPO writing its weight file, slowly (the hub throttled to
    ``rate`` bytes a second): the process, the blobs folder and the file's etag."""

    def __init__(self, hub: FakeHub, env: dict[str, str], rate: int) -> None:
        self.files = tiny_model()
        hub.add_repo(REPO, self.files)
        hub.throttle(REPO, "model.safetensors", rate)
        self.etag = hashlib.sha256(self.files["model.safetensors"]).hexdigest()
        self.blobs = cache_of(env) / "models--test-org--tiny-mlx" / "blobs"
        self.proc = subprocess.Popen([sys.executable, "-m", "afmd", "pull", REPO], env=env,
                                     cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.monotonic() + 60
        while not self.partial():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise AssertionError("the pull never began writing its weight file")
            time.sleep(0.05)

    def partial(self) -> list[Path]:
        return list(self.blobs.glob(f"{self.etag}.*.incomplete"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def test_what_a_killed_pull_left_is_deleted_by_the_next(hub: FakeHub,
                                                          env: dict[str, str]) -> None:
    """A pull killed mid-file (or a server stopped mid-pull: its download thread does not
    hold the process) leaves the hub client's ``blobs/<etag>.<8 hex>.incomplete``, which no
    later download reads: the hub client starts the file over under a new name. The next
    pull of the repo deletes it before it fetches the file again."""
    pulling = MidFile(hub, env, 512)  # seconds for its few KiB
    pulling.stop()
    blobs, etag = pulling.blobs, pulling.etag
    left = pulling.partial()
    assert len(left) == 1 and not (blobs / etag).exists(), left
    hub.rates.clear()
    assert afmd(env, "pull", REPO).returncode == 0
    assert not list(blobs.glob("*.incomplete")), list(blobs.iterdir())
    assert (blobs / etag).read_bytes() == pulling.files["model.safetensors"]


def test_a_pull_stopped_by_sigterm_says_so_and_leaves_no_partial_file(
        hub: FakeHub, env: dict[str, str]) -> None:
    """SIGTERM (``timeout``, a service manager) ended a pull mid-file with no word, exit
    by the signal, and the file it was writing left behind; it now ends as Ctrl-C does."""
    pulling = MidFile(hub, env, 512)  # seconds for its few KiB
    try:
        pulling.proc.send_signal(signal.SIGTERM)
        _, err = pulling.proc.communicate(timeout=30)
    finally:
        pulling.stop()
    assert pulling.proc.returncode == 128 + signal.SIGTERM, err
    assert "afmd pull: stopped (SIGTERM)" in err and "Traceback" not in err, err
    assert not list(pulling.blobs.glob("*.incomplete")), list(pulling.blobs.iterdir())


@pytest.mark.parametrize("terminal", [False, True])
def test_a_bar_stopped_inside_its_construction_closes_quietly(terminal: bool) -> None:
    """The SIGTERM above can land inside tqdm's ``__init__``: the half-built bar is closed
    by its ``__del__`` on the way out, and printed a traceback (seen in CI)."""
    shown = io.StringIO()
    cls = bar_class("model.safetensors", shown, terminal=terminal, report=lambda n, t: None)
    half_built = cls.__new__(cls)  # what a signal inside ``__init__`` leaves
    half_built.close()
    half_built.close()
    assert shown.getvalue() == ""


def test_a_second_pull_of_a_file_being_downloaded_says_it_waits(hub: FakeHub,
                                                                env: dict[str, str]) -> None:
    """Two `afmd pull` of one repo at once: the second one's hub client waits, silent, on
    the lock of the file the first is downloading (minutes for a weight file), and then
    had no line at all for that file. It says it waits, and both pulls end verified."""
    pulling = MidFile(hub, env, 2048)  # seconds for its few KiB
    first = pulling.proc
    try:
        second = afmd(env, "pull", REPO)
        _, first_err = first.communicate(timeout=60)
    finally:
        pulling.stop()
    assert first.returncode == 0, first_err
    assert second.returncode == 0, second.stderr
    assert "model.safetensors: another pull is downloading it; waiting for it" in \
        second.stderr
    assert "verified 3 files" in second.stderr
    assert len(hub.gets("model.safetensors")) == 1  # downloaded once, by the first
    assert (pulling.blobs / pulling.etag).read_bytes() == pulling.files["model.safetensors"]


def test_a_file_that_fails_verification_is_deleted_only_inside_the_cache(
        hub: FakeHub, env: dict[str, str], tmp_path: Path) -> None:
    """The cache is shared: a snapshot's file may be a link another tool or its user made
    to a file elsewhere (weights kept on another disk). One that failed verification was
    deleted through the link, the user's own file with it; now only the link goes."""
    commit = hub.add_repo(REPO, tiny_model())
    snapshot = cache_of(env) / "models--test-org--tiny-mlx" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    theirs = tmp_path / "elsewhere" / "weights.safetensors"
    theirs.parent.mkdir()
    theirs.write_bytes(b"someone else's weights")
    (snapshot / "model.safetensors").symlink_to(theirs)
    result = afmd(env, "pull", REPO)
    assert_clean_failure(result, "model.safetensors failed verification")
    assert theirs.read_bytes() == b"someone else's weights"
    assert not (snapshot / "model.safetensors").is_symlink()
    assert afmd(env, "pull", REPO).returncode == 0  # the next pull fetches the hub's file
    assert (snapshot / "model.safetensors").read_bytes() == tiny_model()["model.safetensors"]
    assert theirs.read_bytes() == b"someone else's weights"


# ---------------------------------------------------------------------------- the cache's own


def test_a_weight_header_longer_than_its_file_lists_as_nothing(hub: FakeHub,
                                                               env: dict[str, str]) -> None:
    """A pulled weight file whose first eight bytes claim a header of exabytes (verified:
    it is the hub's own file) made ``afmd list`` a MemoryError traceback, reading that
    many bytes; and with it ``/api/tags`` for every model. Such a file describes as
    nothing, as other odd weight files do (tests/server/test_odd_model_files.py)."""
    files = {**tiny_model(), "model.safetensors": b"x" * 100}
    hub.add_repo(REPO, files)
    assert afmd(env, "pull", REPO).returncode == 0
    result = afmd(env, "list", "--json")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert REPO in {m["id"] for m in json.loads(result.stdout)["models"]}
    shown = afmd(env, "show", REPO, "--json")
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr


def test_rm_of_a_repo_folder_that_links_elsewhere(hub: FakeHub, env: dict[str, str],
                                                  tmp_path: Path) -> None:
    """A repo's folder in the cache may be a link to another disk (moved there to save
    room). ``afmd rm`` and ``/api/delete`` failed on it with a traceback (rmtree refuses a
    link); the link is removed and the files it points to are left, with a note: nothing
    outside the cache is deleted."""
    hub.add_repo(REPO, tiny_model())
    assert afmd(env, "pull", REPO).returncode == 0
    folder = cache_of(env) / "models--test-org--tiny-mlx"
    moved = tmp_path / "other-disk" / folder.name
    moved.parent.mkdir()
    folder.rename(moved)
    folder.symlink_to(moved, target_is_directory=True)
    assert REPO in listed(env)
    result = afmd(env, "rm", REPO, "--yes")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert f"deleted {REPO}" in result.stdout
    assert f"its files in {moved} were left" in result.stdout, result.stdout
    assert not folder.is_symlink() and not folder.exists()
    assert (moved / "refs" / "main").is_file()
    assert REPO not in listed(env)


@pytest.mark.parametrize("sha", ["main", "../../../outside", "", "A" * 40])
def test_a_listing_that_names_no_commit_is_refused(hub: FakeHub, env: dict[str, str],
                                                   sha: str) -> None:
    """The files are fetched at the commit the hub names, and the snapshot folder is named
    after it: a hub that named ``main`` had the files fetched at a branch that can move
    while they come, under a snapshot called ``main``."""
    hub.add_repo(REPO, tiny_model())
    hub.repos[REPO].commit = sha
    hub.repos[REPO].refs = {"main": sha}
    result = afmd(env, "pull", REPO)
    assert_clean_failure(result, f"did not name the commit of {REPO}@main")
    assert not [r for r in hub.log if "/resolve/" in r.path]


def test_a_repo_removed_while_it_is_read_is_not_there(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete renames the repo's folder away while another request reads it (several
    ``/api/delete``s at once, ``afmd rm`` beside the server): walking the snapshot as it
    went raised FileNotFoundError, and that request was a 500."""
    from afmd.hub import cache as hubcache

    commit = "c" * 40
    folder = tmp_path / "models--test-org--racing"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"x")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    assert hubcache.complete_snapshot("test-org/racing", cache=tmp_path) == snapshot

    def removed_meanwhile(path: Path) -> int:
        # What os.scandir raises when the folder goes between rglob's look and its read.
        folder.rename(tmp_path / ".models--test-org--racing.deleting")
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(hubcache, "snapshot_size", removed_meanwhile)
    assert hubcache.inspect("test-org/racing", cache=tmp_path) is None


CONFIGURED = "test-org/configured-chat"
CONFIGURED_VISION = "test-org/configured-vision"


@pytest.fixture(scope="module")
def configured(tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[ServerProcess, FakeHub, Path]]:
    """A server with two configured repos nobody pulled, each a model of its own that only
    its own test loads, the hub holding both, and the server's HF_HOME. Shared: its
    environment names the hub, so it is a fresh interpreter, not a fork."""
    tmp = tmp_path_factory.mktemp("configured")
    hf = tmp / "hf"
    with FakeHub() as hub:
        chat = demo.materialize("demo")
        files = {p.name: p.read_bytes() for p in chat.iterdir() if p.is_file()}
        hub.add_repo(CONFIGURED, {**files, "notes.txt": b"nothing a load reads\n"})
        hub.add_folder(CONFIGURED_VISION, demo.materialize("demo-vision"))
        server = start_server(
            tmp, config=(f'[[models.model]]\nid = "tiny"\npath = "{CONFIGURED}"\n'
                         f'[[models.model]]\nid = "eyes"\npath = "{CONFIGURED_VISION}"\n'),
            env={"HF_ENDPOINT": hub.url, "HF_HOME": str(hf)})
        try:
            yield server, hub, hf
        finally:
            server.stop()


def test_a_configured_repo_not_on_disk_is_pulled_and_verified_by_its_first_load(
        configured: tuple[ServerProcess, FakeHub, Path]) -> None:
    """A ``[[models.model]]`` repo nobody pulled is fetched by afmd's own pull when a
    request first loads it: bounded and verified, a file that fails verification deleted
    and the load refused (mlx-lm's download kept whatever the hub sent, and served it)."""
    server, hub, hf = configured
    hub.corrupt(CONFIGURED, "notes.txt")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4, "temperature": 0}
            refused = http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 500, refused.text
            error = refused.json()["error"]
            assert error["code"] == "model_load_failed" and error["param"] == "model"
            assert "notes.txt failed verification" in error["message"], error["message"]
            assert not list(hf.rglob("notes.txt"))
            hub.corrupted.clear()
            answer = http.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            reference = http.post("/v1/chat/completions", json={**body, "model": "demo"})
            assert (answer.json()["choices"][0]["message"]
                    == reference.json()["choices"][0]["message"])  # the same weights
        snapshot = complete_snapshot(CONFIGURED, hf / "hub")
        assert snapshot is not None and (snapshot / "notes.txt").read_bytes().startswith(b"nothing")
    finally:
        hub.corrupted.clear()


def test_a_configured_repo_pulled_by_its_load_is_what_its_folder_says(
        configured: tuple[ServerProcess, FakeHub, Path]) -> None:
    """The kind of a repo nobody pulled is read once its load has pulled it: a vision
    conversion with no ``kind`` in its entry takes images (it was loaded as a text model,
    which mlx-lm has no architecture for)."""
    server, _, _ = configured
    picture = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(picture, "PNG")
    image = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    with httpx.Client(base_url=server.url, timeout=120) as http:
        answer = http.post("/v1/chat/completions", json={
            "model": "eyes", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": image}}]}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] > 20  # the image's tokens


def test_a_cache_the_disk_refuses_is_said_to_be_the_disk(hub: FakeHub, env: dict[str, str],
                                                         tmp_path: Path) -> None:
    """A cache folder that cannot be made (under a file, on a full or read-only disk) is
    this machine's fault, not the network's: the message says where the cache is and
    how to move it, never "run the pull again to resume"."""
    hub.add_repo(REPO, tiny_model())
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for moved in ({"HF_HOME": str(blocker / "hf")},
                  {"HF_HOME": str(tmp_path / "hf2"), "HF_HUB_CACHE": str(blocker / "cache")}):
        result = afmd({**env, **moved}, "pull", REPO)
        assert_clean_failure(result, "this machine's disk refused it (Not a directory",
                                     str(blocker), "HF_HOME or HF_HUB_CACHE")
        assert "to resume" not in result.stderr, result.stderr
