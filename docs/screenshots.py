"""Take the dashboard's screenshots in docs/img/ (docs/dashboard.md shows them).

    .venv/bin/python docs/screenshots.py

It starts ``afmd serve`` on the built-in demo model (and a second one with an API key), sends
it some traffic for half a minute so the charts and the last requests have something to
show, then photographs the page in Debian's Chromium (``apt-get install chromium``) through
Playwright, as the browser tests drive it. Nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "img"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
TRAFFIC_S = 30.0


@contextmanager
def serve(folder: Path, config: str) -> Iterator[str]:
    """``afmd serve`` on a free port with ``config``; its URL, once its model is loaded."""
    path = folder / f"config-{time.monotonic_ns()}.toml"
    path.write_text(config)
    proc = subprocess.Popen(
        [sys.executable, "-m", "afmd", "serve", "--config", str(path), "--port", "0",
         "--log-format", "json"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, cwd=folder, env={**os.environ, "AFMD_CACHE_DIR": str(folder / "cache")})
    try:
        url = ""
        assert proc.stderr is not None
        for line in proc.stderr:
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("event") == "listening":
                url = next(a for a in event["addresses"] if a.startswith("http://"))
            if event.get("event") == "model ready":
                break
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep it drained
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def traffic(url: str, stop: threading.Event, headers: dict[str, str] | None = None) -> None:
    """A few clients' worth of chat requests of varying length, some streamed."""
    def client(n: int) -> None:
        with httpx.Client(base_url=url, timeout=120, headers=headers) as http:
            i = 0
            while not stop.is_set():
                i += 1
                http.post("/v1/chat/completions", json={
                    "model": "demo", "max_tokens": 40 + (i * 37 + n * 53) % 300,
                    "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"Request {i} of client {n}."}]})
                stop.wait(0.3 + (i % 4) * 0.4)

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(3)]
    for thread in threads:
        thread.start()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="afmd-shots-") as tmp, sync_playwright() as p:
        folder = Path(tmp)
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        with serve(folder, '[models.aliases]\n"gpt-4o-mini" = "demo"\n') as url:
            stop = threading.Event()
            traffic(url, stop)
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(url + "/")
            page.wait_for_timeout(TRAFFIC_S * 1000)
            page.get_by_test_id("system").fill("You are a helpful assistant.")
            page.get_by_test_id("temperature").fill("0")
            page.get_by_test_id("max-tokens").fill("120")
            page.get_by_test_id("prompt").fill("Write a haiku about a quiet server.")
            page.get_by_test_id("send").click()
            page.get_by_test_id("finish-reason").filter(has_text="length").wait_for()
            page.wait_for_timeout(1500)  # the last poll shows the playground's request
            page.screenshot(path=str(OUT / "dashboard.png"), full_page=True)
            stop.set()
            page.locator("section.playground").screenshot(path=str(OUT / "playground.png"))
        with serve(folder, '[server]\napi_key = "sk-example"\n') as url:
            page = browser.new_page(viewport={"width": 1000, "height": 420})
            page.goto(url + "/")
            page.get_by_test_id("api-key").wait_for()
            page.screenshot(path=str(OUT / "api-key.png"))
        browser.close()
    for name in ("dashboard.png", "playground.png", "api-key.png"):
        print(OUT / name, (OUT / name).stat().st_size, "bytes")


if __name__ == "__main__":
    main()
