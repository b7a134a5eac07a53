"""Running afmd: Sanic inside our own event loop, on sockets we bind, with a clean shutdown.

Sanic's runner would fork workers, install its own signal handlers and bind Unix sockets
world-writable; afmd instead binds each listener itself (:mod:`afmd.http.transport.listeners`),
hands the socket to ``create_server`` and keeps the lifecycle: start, serve, drain on
SIGTERM within a grace period, remove the socket file, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

from sanic import Sanic

from afmd.config.sections import BUILTIN_SYSTEM_PATH, Config
from afmd.distributed.lead import GroupLead
from afmd.distributed.loss import GroupLoss
from afmd.engine.models.model_registry import ModelRegistry
from afmd.http.app import create_app
from afmd.http.app_state import AppState
from afmd.http.routes.embedding_routes import interrupt_embeddings
from afmd.http.routes.handlers import interrupt_requests, server_stopping_error
from afmd.http.routes.ollama_routes import interrupt_pulls
from afmd.http.routes.state_routes import CLIENT_STYLES
from afmd.http.transport.binding import bind_listeners
from afmd.http.transport.connection import direct_routes, route_checker
from afmd.http.transport.connection_limits import GateContext
from afmd.http.transport.listeners import Listener, Listeners, StartupError
from afmd.http.transport.supervisor import ListenerState, ListenerSupervisor
from afmd.logs import get_logger
from afmd.service.pipeline import ChatPipeline
from afmd.service.scheduler import Scheduler

__all__ = ["FINAL_WRITE_SECONDS", "Server", "run"]

log = get_logger("afmd.server")


#: After shutdown_grace, how long the requests still running get to write their ending
#: (an error) before their connections are closed regardless.
FINAL_WRITE_SECONDS = 1.0


DEMO_WARNING = (
    "serving the built-in demo model: it has random weights and answers with nonsense "
    "text; configure a real model in [[models.model]] or pass --model"
)


async def _end_what_runs(state: AppState, app: Sanic, gate: GateContext) -> None:
    """After the grace period, what still runs ends the way any failure does (an error
    event, [DONE] and the body's last chunk for a stream), then goes idle and closes;
    only what cannot even do that in time is cut. A background response still running
    ends ``failed`` with the same error, stored (and persisted) as such."""
    error = server_stopping_error()

    def interrupt() -> None:
        interrupt_requests(state, error)
        interrupt_embeddings(app, error)
        interrupt_pulls(state, error)

    last = time.monotonic() + FINAL_WRITE_SECONDS
    await gate.close_when_idle(last, each_turn=interrupt)
    await state.background.wait(last)


async def _stop_sanic(lifecycle: Any) -> None:
    """Sanic's own stop hooks (listeners registered on the app), errors ignored."""
    if lifecycle is not None:
        with contextlib.suppress(Exception):
            await lifecycle.before_stop()
            await lifecycle.after_stop()


class Server:
    """afmd's HTTP server over one or more listeners."""

    def __init__(self, config: Config, group: GroupLead | None = None) -> None:
        self.config = config
        #: Rank 0's side of a launched group (``afmd launch``); None: a single process.
        self.group = group
        self.registry = ModelRegistry(config)
        self.scheduler = Scheduler(
            config.queue.max_concurrent_requests, config.queue.max_queued_requests
        )
        self.pipeline = ChatPipeline(
            self.registry, self.scheduler, request_timeout=config.server.request_timeout
        )
        self.state = AppState(config=config, registry=self.registry, pipeline=self.pipeline,
                              group=group)
        self.app = create_app(self.state)
        self.gate = GateContext(config.server, route_checker(self.app),
                                access_log=config.log.access_log,
                                direct=direct_routes(self.app), client_styles=CLIENT_STYLES)
        self._listeners = Listeners(self.app, on_gave_up=self._listener_gave_up)
        self.supervisor.callbacks.append(self.state.metrics.listener_state)
        self._stop = asyncio.Event()
        self._stopping = False
        self._preload: asyncio.Task[None] | None = None
        self.exit_code = 0

    @property
    def listeners(self) -> list[Listener]:
        return self._listeners.items

    @property
    def supervisor(self) -> ListenerSupervisor:
        return self._listeners.supervisor

    # -- lifecycle --
    def _bind_all(self) -> None:
        bind_listeners(self.config.server, self.gate, self._listeners,
                       ollama_port=self.config.ollama.port)

    async def start(self) -> None:
        await self._listeners.start(self._bind_all)
        default = self.config.resolve_model(None)
        if self.group is not None:
            # Every rank loads its shard now, in step: it cannot wait for a first request.
            self._lost = GroupLoss(self)
            self.group.watch(self._lost.busy_since, self._lost.from_thread)
            self._lost.watch_supervisor()
        unavailable = self.registry.unavailable_reason(default.id) if default else None
        if unavailable is not None:  # Apple's model where it cannot run: /health says why
            log.warning("model unavailable", model=default.id if default else None,
                        reason=unavailable)
        elif default is not None and (
            self.config.models.preloads(default) or self.group is not None
        ):
            # A group's shard waits as long as it takes: its ranks are loading it together.
            deadline = float("inf") if self.group is not None else None
            task = self.registry.begin_load(default, deadline)
            task.add_done_callback(self._on_default_loaded)
        # The other models marked preload, after the default (whose load this joins).
        self._preload = asyncio.get_running_loop().create_task(self.registry.preload())
        log.info(
            "listening",
            addresses=[listener.describe() for listener in self.listeners],
            model=default.id if default else None,
            config=self.config.source,
        )
        for listener in self.listeners:
            self.supervisor.emit(ListenerState("running", listener.describe()))
        if default is not None and default.path.startswith("afmd:") \
                and default.path != BUILTIN_SYSTEM_PATH:  # Apple's model is a real one
            log.warning(DEMO_WARNING, model=default.id)

    def _listener_gave_up(self, state: ListenerState) -> None:
        self.exit_code = 1
        self.request_stop(f"listener {state.listener} could not be restarted")

    def _on_default_loaded(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            loaded = task.result()
            log.info("model ready", model=loaded.id, context_length=loaded.context_length)
            if self.group is not None:
                self._lost.attach(loaded)
        elif self.group is not None:
            self._lost.lose(None, f"this rank's shard failed to load: {exc}")
        # failures are logged by the registry and reported by /health

    def request_stop(self, reason: str = "signal") -> None:
        if not self._stop.is_set():
            log.info("stopping", reason=reason)
            self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    async def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        await self._listeners.stop_accepting()
        # Every listener's connections, restarted ones' included; background responses
        # get the same grace to end by themselves.
        grace = time.monotonic() + self.config.server.shutdown_grace
        await self.gate.close_when_idle(grace)
        await self.state.background.wait(grace)
        if self.gate.connections or self.state.background:
            await _end_what_runs(self.state, self.app, self.gate)
        self.gate.close_all()
        self._listeners.close()
        await _stop_sanic(self._listeners.lifecycle)
        if self._preload is not None:
            self._preload.cancel()
        if self.group is not None:
            # Until here a rank lost mid-drain still fails what runs; from here the
            # model's thread tells the other ranks to stop, and their leaving is expected.
            self.group.close()
        await asyncio.to_thread(self.registry.close)
        self._listeners.restore_exception_handler()
        log.info("stopped", exit_code=self.exit_code)

    async def serve(self, *, install_signal_handlers: bool = True) -> int:
        """Run until SIGINT/SIGTERM/SIGHUP (or :meth:`request_stop`); return the exit code."""
        loop = asyncio.get_running_loop()
        stop_signals = self._stop_signals()
        if install_signal_handlers:
            for sig in stop_signals:
                loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        try:
            await self.start()
            await self.wait_stopped()
        except StartupError:
            # Set before shutdown logs "stopped": that line must not say 0 for a server
            # that never served and exits 1.
            self.exit_code = 1
            raise
        finally:
            await self.shutdown()
            if install_signal_handlers:
                for sig in stop_signals:
                    loop.remove_signal_handler(sig)
        return self.exit_code

    def _stop_signals(self) -> tuple[int, ...]:
        """SIGINT, SIGTERM and SIGHUP (the terminal of an ``afmd serve`` in the foreground
        closed: its streams drain and its socket file goes, where the default action
        killed it mid-answer); rank 0 of a launched group stops on SIGINT only (from
        ``afmd launch``): MLX's launcher sends SIGTERM the moment another rank dies, and
        rank 0 must stay to fail what runs, say why, and exit 1 itself."""
        if self.group is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return (signal.SIGINT,)
        return (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run(config: Config, group: GroupLead | None = None) -> int:
    """Serve until stopped; the process exit code."""
    async def main() -> int:
        server = Server(config, group)
        return await server.serve()

    try:
        return asyncio.run(main())
    except StartupError as exc:
        log.error("startup failed", error=str(exc))
        return 1
