"""Debian's Chromium driven by Playwright, for the dashboard's tests.

Playwright cannot download its own browsers here (no network), so it launches the system's
``chromium`` (``apt-get install chromium``; ``.ci/run`` installs it). Where either is
missing the tests skip and say which. One browser per test module: a launch is the
expensive part, a fresh context per test is cheap and shares nothing (storage, cookies).

:class:`Watched` is a page with what a test asserts on every page it opens: the console
errors and uncaught exceptions it logged, and every request it made, so that a request
leaving the server's origin (a CDN, a font, a beacon) fails the test.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
#: No sandbox (root in a container), no GPU, and none of Chromium's own traffic (updates,
#: sync, field trials), which would be requests off the origin in a machine without network.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-default-apps", "--disable-extensions"]


def chromium_path() -> str:
    """The browser to launch; skips the test where it or Playwright is missing."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("Playwright's Python package is not installed (pip install playwright: "
                    "it is in the test extra)")
    path = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if path is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run "
                    "installs it): Playwright cannot download its own browsers here")
    return path


@contextmanager
def launched() -> Iterator[Any]:
    """One Chromium for a module's tests."""
    path = chromium_path()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=path, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class Watched:
    """A page in a fresh context, with its console errors and its requests."""

    page: Any
    origin: str
    errors: list[str] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)
    #: Console errors a test found it may provoke (checked at the fixture's teardown).
    expected_errors: list[str] = field(default_factory=list)

    def off_origin(self) -> list[str]:
        return [r.url for r in self.requests
                if not (r.url == self.origin or r.url.startswith(self.origin + "/"))
                and not r.url.startswith(("data:", "about:"))]

    def check(self, *, allowed_errors: tuple[str, ...] = ()) -> None:
        """No console error (beyond those a test provokes on purpose) and no request off
        the origin."""
        allowed = (*allowed_errors, *self.expected_errors)
        unexpected = [e for e in self.errors if not any(a in e for a in allowed)]
        assert not unexpected, f"console errors: {unexpected}"
        assert not self.off_origin(), f"requests off the origin: {self.off_origin()}"


@contextmanager
def watched_page(browser: Any, origin: str, **context_options: Any) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, **context_options)
    page = context.new_page()
    page.set_default_timeout(15_000)
    watched = Watched(page, origin)
    page.on("console", lambda m: m.type == "error" and watched.errors.append(m.text))
    page.on("pageerror", lambda e: watched.errors.append(f"uncaught: {e}"))
    page.on("request", lambda r: watched.requests.append(r))
    try:
        yield watched
    finally:
        context.close()
