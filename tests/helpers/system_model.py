"""Apple's on-device model (``system``) in tests: the SDK stand-in, and servers serving it.

The stand-in (``tests/helpers/fm_standin/apple_fm_sdk``) is importable only inside
:func:`standin` (or for a server process given :data:`STANDIN` on ``PYTHONPATH``): outside
it, ``import apple_fm_sdk`` fails as on any machine without Apple's framework, which is the
real behaviour of this Linux box (``device_not_eligible``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from afmd.config.load import load_config
from afmd.engine.apple import framework
from afmd.server import Server

STANDIN = Path(__file__).resolve().parent / "fm_standin"


def _forget_sdk() -> None:
    for name in [n for n in sys.modules if n == "apple_fm_sdk" or n.startswith("apple_fm_sdk.")]:
        del sys.modules[name]
    framework.forget()


@contextlib.contextmanager
def standin() -> Iterator[ModuleType]:
    """``apple_fm_sdk`` is the stand-in while the block runs; its ``native`` module (the
    scripted framework and its ``STATE``) is what the block gets."""
    _forget_sdk()
    sys.path.insert(0, str(STANDIN))
    try:
        native = importlib.import_module("apple_fm_sdk.native")
        native.STATE.log.clear()
        yield native
    finally:
        sys.path.remove(str(STANDIN))
        _forget_sdk()


def set_availability(native: ModuleType, reason: str | None) -> None:
    """What the stand-in's ``is_available()`` says from now on (afmd asks again at once)."""
    native.STATE.availability = reason
    framework.forget()


class SystemServer:
    """afmd's Server in this process on its own loop, serving ``system`` by default."""

    def __init__(self, config_text: str | None = None, tmp: Path | None = None,
                 **overrides: Any) -> None:
        path = None
        if config_text is not None:
            assert tmp is not None
            path = tmp / f"afmd-{time.monotonic_ns()}.toml"
            path.write_text(config_text)
        self.config = load_config(path, env={}, overrides={
            "server.port": 0, "model": "system", "log.level": "warning", **overrides})
        self.server = Server(self.config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not (self.server.listeners and self.server.listeners[0].address):
            assert time.monotonic() < deadline and self.thread.is_alive(), "server never bound"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.listeners[0].address[1]}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(install_signal_handlers=False))
        finally:
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def registry(self) -> Any:
        return self.server.registry

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.request_stop, "test")
            self.thread.join(30)
