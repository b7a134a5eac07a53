"""Measure a frozen afmd the way docs/distribution.md reports it (Linux: memory is read from /proc).

    .venv/bin/python build/measure.py build/dist/afmd-0.1.0-linux-x86_64/afmd
    .venv/bin/python build/measure.py build/dist/afmd-0.1.0-linux-x86_64 --runs 5

For the executable (or the folder holding it) it prints: size on disk, the time of
``afmd version`` (launch cost alone), the time from spawning ``afmd serve`` to the first
``/health`` 200 (the default demo model loaded) with an empty model cache and with a warm
one, and the idle VmRSS of every process of the server (a onefile binary runs as a small
bootloader parent plus the Python child) read from /proc/<pid>/status two seconds after
/health first answered 200. Medians over ``--runs``; stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _children(pid: int) -> list[int]:
    tree, todo = [], [pid]
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, []))
    return tree


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def time_version(exe: Path) -> float:
    started = time.monotonic()
    subprocess.run([str(exe), "version"], check=True, capture_output=True)
    return time.monotonic() - started


def serve_once(exe: Path, cache: Path, cwd: Path) -> tuple[float, list[int]]:
    """(seconds to /health 200, idle VmRSS KiB of each process)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFMD_")}
    env.update(AFMD_CACHE_DIR=str(cache), HOMEBREW_PREFIX="/nonexistent")
    url = f"http://127.0.0.1:{port}/health"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    urllib.request.install_opener(opener)
    started = time.monotonic()
    proc = subprocess.Popen([str(exe), "serve", "--port", str(port)], cwd=str(cwd), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not _healthy(url):
            if proc.poll() is not None:
                raise SystemExit(f"measure.py: afmd exited with {proc.returncode}")
            if time.monotonic() - started > 300:
                raise SystemExit("measure.py: no /health 200 within 300 s")
            time.sleep(0.02)
        ready = time.monotonic() - started
        time.sleep(2.0)
        rss = [_rss_kib(pid) for pid in _children(proc.pid)]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    if code != 0:
        raise SystemExit(f"measure.py: SIGTERM gave exit code {code}, expected 0")
    return ready, rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="the afmd executable or its onedir folder")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    path = args.path.resolve()
    exe = path / "afmd" if path.is_dir() else path
    if not Path("/proc").is_dir():
        raise SystemExit("measure.py: reads memory from /proc (Linux)")
    size = _size(path)
    versions = [time_version(exe) for _ in range(args.runs + 1)][1:]  # first run warms caches
    cold, warm, rss = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            cache = Path(tmp) / f"cache-{i}"
            cwd = Path(tmp) / f"cwd-{i}"
            cwd.mkdir()
            seconds, _ = serve_once(exe, cache, cwd)
            cold.append(seconds)
            seconds, kib = serve_once(exe, cache, cwd)
            warm.append(seconds)
            rss.append(kib)
            if any(cwd.iterdir()):
                raise SystemExit(f"measure.py: afmd wrote into its working directory {cwd}")
            shutil.rmtree(cache)
    result = {
        "executable": str(exe),
        "size_mb": round(size / 1e6, 1),
        "version_s": round(statistics.median(versions), 2),
        "cold_start_s": round(statistics.median(cold), 2),
        "warm_start_s": round(statistics.median(warm), 2),
        "idle_rss_mib": [round(statistics.median(k[i] for k in rss) / 1024)
                         for i in range(len(rss[0]))],
        "runs": args.runs,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
