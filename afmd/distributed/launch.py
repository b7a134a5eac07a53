"""``afmd launch``: start the ranks through MLX's launcher and own their process contract.

``mlx.launch`` starts one process per rank (over ssh for other hosts) and relays their
output, but it forwards no signal to them and always exits 0. What ``brew services`` and a
terminal need is a single process that stops the group cleanly on SIGTERM/SIGINT and says
how it ended, so this supervisor sits above it:

- it checks its arguments and the serve config first (exit 2, nothing started);
- it runs MLX's launcher in a session of its own, with the ranks' environment naming a
  folder where rank 0 leaves its pid and, when it exits, its outcome;
- a first SIGTERM/SIGINT goes to rank 0 (as SIGINT: rank 0 ignores SIGTERM, which MLX's
  launcher sends to every rank as soon as one dies), which drains like a single server
  and then tells the other ranks to stop; a second signal, or a group still running long
  after, is killed;
- its exit code is rank 0's outcome: 0 clean stop, 1 a rank lost (or rank 0 died without
  saying), 2 bad configuration. A group whose rank 0 has exited is torn down within a few
  seconds even if a rank hangs (a stopped process ignores the launcher's SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from afmd.config.bounds import ConfigError
from afmd.config.load import load_config
from afmd.distributed.env import BACKEND_ENV, LAUNCH_DIR_ENV, OUTCOME_FILE, PID_FILE, SUPERVISOR_ENV
from afmd.ports import free_ports

EXIT_OK, EXIT_LOST, EXIT_CONFIG = 0, 1, 2
BACKENDS = ("ring", "jaccl")
#: After rank 0 has exited, how long the rest of the group may take to follow.
_TEARDOWN_S = 5.0
#: Beyond the serve config's shutdown_grace, how long a stop may take before it is forced.
_STOP_MARGIN_S = 15.0


def add_parser(commands: argparse._SubParsersAction) -> None:
    launch = commands.add_parser(
        "launch",
        help="serve one model over several processes or Macs (MLX distributed)",
        description="Start `afmd serve` as N ranks through MLX's launcher: rank 0 serves "
                    "HTTP, every rank holds a shard of the model. SIGTERM/SIGINT stop the "
                    "whole group; exit 0 clean stop, 1 a rank lost, 2 bad configuration.",
        usage="afmd launch [-n N] [--hostfile FILE] [--backend ring|jaccl] "
              "[--starting-port P] -- serve --config FILE",
    )
    launch.add_argument("-n", type=int, default=None, metavar="N",
                        help="ranks on this machine (default 2; not with --hostfile)")
    launch.add_argument("--hostfile", metavar="FILE",
                        help="MLX hostfile (JSON) naming each rank's host; rank 0 must be "
                             "this machine")
    launch.add_argument("--backend", default="ring",
                        help="MLX distributed backend: ring (TCP, Ethernet or Thunderbolt) "
                             "or jaccl (RDMA over Thunderbolt 5)")
    launch.add_argument("--starting-port", "-p", type=int, default=None, metavar="P",
                        help="the ring's first port (default: free ports on loopback, "
                             "else 32323)")
    launch.add_argument("rank_command", nargs=argparse.REMAINDER,
                        help="-- serve --config FILE: what each rank runs")


def _fail(message: str) -> int:
    print(f"afmd launch: {message}", file=sys.stderr)
    return EXIT_CONFIG


def self_command() -> list[str]:
    """How to run afmd again: the frozen binary itself, or this Python with ``-m afmd``."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "afmd"]


def _serve_config(command: list[str]) -> str | None:
    """The ``--config`` of the ranks' ``serve`` command, if any."""
    for i, arg in enumerate(command):
        if arg == "--config" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def run(args: argparse.Namespace) -> int:
    command = list(args.rank_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if command[:1] != ["serve"]:
        return _fail("give the ranks' command after --: afmd launch -n 2 -- serve --config FILE")
    if args.backend not in BACKENDS:
        return _fail(f"--backend must be one of {', '.join(BACKENDS)}, not {args.backend!r}")
    if args.hostfile and args.n is not None:
        return _fail("give either -n or --hostfile, not both")
    if args.hostfile and not Path(args.hostfile).is_file():
        return _fail(f"--hostfile {args.hostfile}: no such file")
    n = 2 if args.n is None else args.n
    if not args.hostfile and not 1 <= n <= 64:
        return _fail(f"-n must be between 1 and 64, not {n}")
    # Rank i listens on P + i (the ring launcher's rule), so the last rank's port must exist.
    last = 1 if args.hostfile else n
    if args.starting_port is not None and not 1 <= args.starting_port <= 65536 - last:
        return _fail(f"--starting-port must be between 1 and {65536 - last} for {last} "
                     f"rank{'s' if last > 1 else ''}, not {args.starting_port}")
    try:
        config = load_config(_serve_config(command))
    except ConfigError as exc:
        return _fail(f"configuration error: {exc}")
    port = args.starting_port
    if port is None:
        port = 32323 if args.hostfile else free_ports(n)
    folder = Path(tempfile.mkdtemp(prefix="afmd-launch-"))
    try:
        launcher = [
            *self_command(), "_mlx-launch", "--backend", args.backend,
            *(["--hostfile", args.hostfile] if args.hostfile else ["-n", str(n)]),
            "--starting-port", str(port),
            "--env", f"{LAUNCH_DIR_ENV}={folder}", "--env", f"{BACKEND_ENV}={args.backend}",
            "--", *self_command(), *command,
        ]
        return Supervisor(launcher, folder, config.server.shutdown_grace).run()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Supervisor:
    """Runs MLX's launcher and turns signals and rank 0's outcome into the contract."""

    def __init__(self, launcher: Sequence[str], folder: Path, grace: float) -> None:
        self._launcher = list(launcher)
        self._folder = folder
        self._stop_within = grace + _STOP_MARGIN_S
        self._stop_asked: float | None = None
        self._kill = False

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stop_asked is not None:
            self._kill = True  # a second signal: no more waiting
            return
        self._stop_asked = time.monotonic()
        pid = self._rank0_pid()
        if pid is not None:  # rank 0 drains, then stops the others (it ignores SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        else:  # nothing serves yet: nothing to drain
            self._signal_group(signal.SIGTERM)

    def _rank0_pid(self) -> int | None:
        try:
            return int((self._folder / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def _outcome(self) -> int | None:
        try:
            text = (self._folder / OUTCOME_FILE).read_text().split()
        except OSError:
            return None
        try:
            return int(text[0]) if text else None
        except ValueError:
            return None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # MLX's launcher relays its stdin to the ranks, polling it every 100 ms: at EOF
        # (/dev/null) that poll never sleeps. A pipe nobody writes to keeps it idle.
        self._proc = subprocess.Popen(self._launcher, start_new_session=True,
                                      stdin=subprocess.PIPE,
                                      env={**os.environ, SUPERVISOR_ENV: str(os.getpid())})
        rank0_done: float | None = None
        while self._proc.poll() is None:
            time.sleep(0.1)
            now = time.monotonic()
            if self._kill:
                break
            if self._stop_asked is not None and now - self._stop_asked > self._stop_within:
                break
            if rank0_done is None and self._outcome() is not None:
                rank0_done = now
            if rank0_done is not None and now - rank0_done > _TEARDOWN_S:
                break  # rank 0 has gone; a rank still there is hung
        self._signal_group(signal.SIGKILL)  # whatever is left of the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=_TEARDOWN_S)
        outcome = self._outcome()
        if outcome is None:
            # Rank 0 never said: it died, or it was stopped before it started serving.
            started = self._rank0_pid() is not None
            return EXIT_OK if self._stop_asked is not None and not started else EXIT_LOST
        return outcome
