"""afmd's :class:`~afmd.server.Server` on its own event loop in a thread of the test
process: its listeners' sockets and states are reachable (to break a listener underneath
it), and starting one costs no interpreter start or imports. Kept apart from
:mod:`helpers.servers` so that the conftest, which imports that, does not load MLX and Sanic.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import afmd.http.transport.listeners as listeners_module
from afmd.config.load import load_config
from afmd.http.transport.supervisor import ListenerState
from afmd.server import Server


class InProcessServer:
    """afmd's Server on its own loop in a thread, with its listener states observable."""

    def __init__(self, **overrides: Any) -> None:
        config = load_config(None, env={}, overrides={"server.port": 0, **overrides})
        self.server = Server(config)
        self.states: list[ListenerState] = []
        self.cond = threading.Condition()
        self.server.supervisor.callbacks.append(self._on_state)
        self.loop = asyncio.new_event_loop()
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.wait_state("running", timeout=30)
        # The streams need the model; and a load still running at exit can abort a process.
        deadline = time.monotonic() + 60
        registry = self.server.registry
        while not registry.is_ready("demo") and registry.failure("demo") is None:
            assert time.monotonic() < deadline, "the demo model never loaded"
            time.sleep(0.02)

    def _on_state(self, state: ListenerState) -> None:
        with self.cond:
            self.states.append(state)
            self.cond.notify_all()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.exit_code = self.loop.run_until_complete(
                self.server.serve(install_signal_handlers=False))
        except BaseException as exc:
            self.error = exc
        finally:
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            with self.cond:
                self.cond.notify_all()

    @property
    def listener(self) -> listeners_module.Listener:
        return self.server.listeners[0]

    @property
    def port(self) -> int:
        return int(self.listener.address[1])

    def wait_state(self, state: str, *, after: int = 0, timeout: float = 5.0,
                   **match: Any) -> ListenerState:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for item in self.states[after:]:
                    if item.state == state and all(getattr(item, k) == v
                                                   for k, v in match.items()):
                        return item
                left = deadline - time.monotonic()
                if left <= 0 or not self.thread.is_alive():
                    raise AssertionError(f"no {state!r} state; got {self.states}, "
                                         f"error {self.error!r}")
                self.cond.wait(min(left, 0.05))

    def stop(self) -> int | None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.request_stop, "test")
            self.thread.join(30)
        return self.exit_code
