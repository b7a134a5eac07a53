"""A model's loads: off the event loop, one at a time per model, within the memory budget.

Loading is slow (seconds to minutes) and may fail (a Hugging Face id with no network), so
each load runs as a task that every request for the model shares, and its outcome is kept
per model so that ``/health`` can report it truthfully and the next request can retry a
failure that may have been transient. Room in the budget is :mod:`afmd.engine.models.residency`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from afmd.config.load import Config, ModelEntry
from afmd.engine.apple import framework
from afmd.engine.models import kinds
from afmd.engine.models.loaded import LoadedModel
from afmd.engine.models.residency import RETRY_AFTER_S, Residency, format_bytes, size_before_loading
from afmd.errors import InvalidRequestError, ServerError, ServiceUnavailableError

log = logging.getLogger("afmd.engine")


@dataclass(slots=True)
class LoadCounts:
    """Per model id since the server started: completed loads, failed ones, unloads and
    seconds spent in completed loads (``/metrics`` reads them; they outlive an unload)."""

    loads: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    unloads: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=dict)

    def loaded(self, model_id: str, seconds: float) -> None:
        self.loads[model_id] += 1
        self.seconds[model_id] = self.seconds.get(model_id, 0.0) + seconds

    def unloaded(self, model_id: str) -> None:
        self.unloads[model_id] += 1


class Loads:
    """The loads under way, and how each model's last one ended."""

    def __init__(
        self,
        config: Config,
        residency: Residency,
        counts: LoadCounts,
        *,
        load: Callable[[ModelEntry, Config], LoadedModel],
        on_loaded: Callable[[str], None],
    ) -> None:
        self._config = config
        self._residency = residency
        self._counts = counts
        self._load_sync = load  # blocking: run off the event loop
        self._on_loaded = on_loaded
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}
        self._failed: dict[str, str] = {}
        # Models that must not serve again in this process (a launched group lost a rank).
        self._withdrawn: dict[str, str] = {}
        self._ever_loaded: set[str] = set()

    # -- what /health reports --
    def status(self) -> dict[str, str]:
        """Per model: ``available``, or ``unavailable: <reason>``."""
        result: dict[str, str] = {}
        for entry in self._config.models.model:
            if entry.id in self._withdrawn:
                result[entry.id] = f"unavailable: {self._withdrawn[entry.id]}"
            elif entry.id in self._residency.loaded:
                result[entry.id] = "available"
            elif entry.id in self._failed:
                result[entry.id] = f"unavailable: {self._failed[entry.id]}"
            elif entry.id in self._loading:
                result[entry.id] = "unavailable: loading"
            else:
                result[entry.id] = "available"  # loads on first use
        return result

    def is_loading(self, model_id: str) -> bool:
        return model_id in self._loading

    def failure(self, model_id: str) -> str | None:
        return self._failed.get(model_id)

    def was_loaded(self, model_id: str) -> bool:
        """Whether the model has been loaded since the server started (maybe unloaded
        since: it loads again on demand)."""
        return model_id in self._ever_loaded

    # -- withdrawn models --
    def withdraw(self, model_id: str, reason: str) -> None:
        """From now on, requests for ``model_id`` are 503 ``model_unavailable`` (its
        load no longer retried): the process is about to exit for a restart."""
        self._withdrawn[model_id] = reason

    def refuse_withdrawn(self, entry: ModelEntry) -> None:
        """503 ``model_unavailable`` for a withdrawn model: it is not loaded again."""
        if entry.id in self._withdrawn:
            raise _withdrawn_error(entry, self._withdrawn[entry.id])

    # -- loading --
    def begin(
        self, entry: ModelEntry, deadline: float | None = None, *, evict: bool = True
    ) -> asyncio.Task[LoadedModel]:
        """The model's load, started unless under way (see ``ModelRegistry.begin_load``)."""
        task = self._loading.get(entry.id)
        if task is None:
            if deadline is None:
                deadline = time.monotonic() + self._config.server.request_timeout
            task = asyncio.get_running_loop().create_task(self._load(entry, deadline, evict))
            self._loading[entry.id] = task
        return task

    async def wait(self, entry: ModelEntry, deadline: float) -> None:
        """Until the model's load ends, starting it if need be (again after a failure:
        it may have been transient); past ``deadline`` 503 ``busy`` while it loads, or
        ``model_unavailable`` while it waits for room."""
        if entry.id in self._failed and entry.id not in self._loading:
            log.info("retrying model load after failure: %s", self._failed.pop(entry.id))
        task = self.begin(entry, deadline)
        try:
            await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise (self._residency.room_error(entry.id) or _still_loading(entry)) from None
        except ServiceUnavailableError:
            # That load gave up waiting for room at its own deadline; ours may be later
            # (it was started by another request): the caller waits again.
            if time.monotonic() >= deadline:
                raise

    async def _load(self, entry: ModelEntry, deadline: float, evict: bool) -> LoadedModel:
        try:
            return await self._load_within_budget(entry, deadline, evict)
        finally:
            self._loading.pop(entry.id, None)

    async def _load_within_budget(
        self, entry: ModelEntry, deadline: float, evict: bool
    ) -> LoadedModel:
        residency = self._residency
        try:
            size = await asyncio.to_thread(size_before_loading, entry)
        except Exception:  # unreadable: the load itself will say what is wrong
            size = None
        if size is not None and size > residency.budget:
            raise self._too_large(entry, size, "on disk")
        if not framework.is_system(entry):  # Apple's model takes none of afmd's memory
            await residency.make_room(entry.id, size or 0, deadline, evict=evict)
        started = time.perf_counter()
        try:
            loaded = await asyncio.to_thread(self._load_sync, entry, self._config)
        except Exception as exc:
            residency.unreserve(entry.id)
            raise self._load_failed(entry, exc) from None
        except BaseException:  # cancelled (the server is stopping)
            residency.unreserve(entry.id)
            raise
        if loaded.weights_bytes > residency.budget:  # its size was not known before
            residency.unreserve(entry.id)
            await asyncio.to_thread(residency.free, loaded)
            raise self._too_large(entry, loaded.weights_bytes, "in memory")
        self._failed.pop(entry.id, None)
        self._on_loaded(entry.id)
        self._ever_loaded.add(entry.id)
        self._counts.loaded(entry.id, time.perf_counter() - started)
        log.info("model loaded: %s (%s)", entry.id, format_bytes(loaded.memory_bytes))
        residency.admit(loaded, self._config.models.keep_alive_of(entry))
        return loaded

    def _load_failed(self, entry: ModelEntry, exc: Exception) -> ServerError:
        reason = kinds.describe_load_failure(entry, exc)
        self._failed[entry.id] = reason
        self._counts.failures[entry.id] += 1
        log.error("model load failed: %s", reason)
        return ServerError(
            f"The model '{entry.id}' could not be loaded: {reason}",
            code="model_load_failed",
            param="model",
        )

    def _too_large(self, entry: ModelEntry, size: int, when: str) -> InvalidRequestError:
        whole = self._residency.budget
        need, limit = format_bytes(size), format_bytes(whole)
        reason = (f"larger than the memory budget: its weights take {need} ({size} bytes) "
                  f"{when}, the whole budget is {limit} ({whole} bytes)")
        self._failed[entry.id] = reason
        return _too_large_error(entry, reason)

    def close(self) -> None:
        for task in self._loading.values():
            task.cancel()


def _too_large_error(entry: ModelEntry, reason: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"The model '{entry.id}' is {reason}. Raise [models] memory_budget_bytes or "
        "use a smaller (more quantized) model.",
        code="model_too_large",
        param="model",
    )


def _withdrawn_error(entry: ModelEntry, reason: str) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        f"The model '{entry.id}' is unavailable: {reason}. The server is restarting; "
        "retry shortly.",
        code="model_unavailable", param="model",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _still_loading(entry: ModelEntry) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        f"The model '{entry.id}' is loading; retry shortly.",
        code="busy",
        headers={"Retry-After": "2"},
    )


__all__ = ["LoadCounts", "Loads"]
