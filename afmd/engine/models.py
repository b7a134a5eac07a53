"""Which models exist, which are loaded, and the handle the pipeline uses for each.

Loading is slow (seconds to minutes) and may fail (a Hugging Face id with no network), so
the registry loads off the event loop, remembers the outcome per model, and lets
``/health`` report it truthfully. A request for a model that is not loaded starts its load
and waits for it within its deadline (then 503 ``busy``: it is still loading); which
models stay loaded, within the memory budget, is :mod:`afmd.engine.residency`'s. The
handle itself is :mod:`afmd.engine.loaded`'s, the load :mod:`afmd.engine.loading`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from afmd.config import BUILTIN_DEMO_PATH, Config, ModelEntry
from afmd.engine import budget, kinds
from afmd.engine.kinds import CHAT, EMBEDDING
from afmd.engine.loaded import LoadedModel
from afmd.engine.loading import load_sync
from afmd.engine.residency import RETRY_AFTER_S, Lease, Residency, Usage
from afmd.errors import (
    InvalidRequestError,
    NotFoundError,
    ServerError,
    ServiceUnavailableError,
)

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


class ModelRegistry:
    """Resolves names to configured models and loads them on demand, one load at a time
    per model, within the memory budget."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}
        self._failed: dict[str, str] = {}
        # Models that must not serve again in this process (a launched group lost a rank).
        self._withdrawn: dict[str, str] = {}
        self._kinds: dict[str, str] = {}  # read from disk once per model until it loads
        self.counts = LoadCounts()
        self.residency = Residency(
            budget.effective_budget(config.models.memory_budget_bytes),
            config.models.max_loaded,
            on_unload=self.counts.unloaded,
        )
        self._loaded = self.residency.loaded  # one dict: the residency adds and removes
        self._ever_loaded: set[str] = set()

    @property
    def config(self) -> Config:
        return self._config

    def resolve(self, name: str | None) -> ModelEntry:
        entry = self._config.resolve_model(name)
        if entry is None:
            raise NotFoundError(
                f"The model '{name}' does not exist. Available models: "
                + ", ".join(self.listed_ids())
                + ".",
                code="model_not_found",
                param="model",
            )
        return entry

    def kind_of(self, entry: ModelEntry) -> str:
        """``chat`` or ``embedding``: the loaded model's, else what its folder says."""
        loaded = self._loaded.get(entry.id)
        if loaded is not None:
            return loaded.kind
        kind = self._kinds.get(entry.id)
        if kind is None:
            kind = self._kinds[entry.id] = kinds.declared_kind(entry)
        return kind

    def default_for(self, kind: str) -> ModelEntry | None:
        """The model a request of ``kind`` that names none gets: the default model when it
        is of that kind, else the first configured one that is."""
        default = self._config.resolve_model(None)
        if default is not None and self.kind_of(default) == kind:
            return default
        return next((e for e in self._config.models.model if self.kind_of(e) == kind), None)

    def check_kind(self, entry: ModelEntry, kind: str, actual: str | None = None) -> None:
        """400 ``invalid_model_kind`` unless ``entry`` serves ``kind``."""
        actual = actual or self.kind_of(entry)
        if actual == kind:
            return
        serves = "/v1/embeddings" if actual == EMBEDDING else "chat and completions"
        wanted = "embeddings" if kind == EMBEDDING else "chat or completions"
        raise InvalidRequestError(
            f"The model '{entry.id}' is {_article(actual)} {actual} model: it serves "
            f"{serves}, not {wanted}. Use {_article(kind)} {kind} model.",
            code="invalid_model_kind",
            param="model",
        )

    def listed_ids(self) -> list[str]:
        return [*self._config.model_ids(), *self._config.models.aliases]

    def status(self) -> dict[str, str]:
        """Per model: ``available``, or ``unavailable: <reason>``."""
        result: dict[str, str] = {}
        for entry in self._config.models.model:
            if entry.id in self._withdrawn:
                result[entry.id] = f"unavailable: {self._withdrawn[entry.id]}"
            elif entry.id in self._loaded:
                result[entry.id] = "available"
            elif entry.id in self._failed:
                result[entry.id] = f"unavailable: {self._failed[entry.id]}"
            elif entry.id in self._loading:
                result[entry.id] = "unavailable: loading"
            else:
                result[entry.id] = "available"  # loads on first use
        return result

    def loaded(self, model_id: str) -> LoadedModel | None:
        return self._loaded.get(model_id)

    def is_ready(self, model_id: str) -> bool:
        return model_id in self._loaded

    def is_loading(self, model_id: str) -> bool:
        return model_id in self._loading

    def withdraw(self, model_id: str, reason: str) -> None:
        """From now on, requests for ``model_id`` are 503 ``model_unavailable`` (its
        load no longer retried): the process is about to exit for a restart."""
        self._withdrawn[model_id] = reason

    def failure(self, model_id: str) -> str | None:
        return self._failed.get(model_id)

    def was_loaded(self, model_id: str) -> bool:
        """Whether the model has been loaded since the server started (maybe unloaded
        since: it loads again on demand)."""
        return model_id in self._ever_loaded

    def begin_load(
        self, entry: ModelEntry, deadline: float | None = None, *, evict: bool = True
    ) -> asyncio.Task[LoadedModel]:
        """The model's load, started unless under way; it waits for room in the budget
        until ``deadline`` (default: ``request_timeout`` from now), unloading idle models
        for it unless ``evict`` is false."""
        task = self._loading.get(entry.id)
        if task is None:
            if deadline is None:
                deadline = time.monotonic() + self._config.server.request_timeout
            task = asyncio.get_running_loop().create_task(self._load(entry, deadline, evict))
            self._loading[entry.id] = task
        return task

    async def _load(self, entry: ModelEntry, deadline: float, evict: bool) -> LoadedModel:
        try:
            return await self._load_within_budget(entry, deadline, evict)
        finally:
            self._loading.pop(entry.id, None)

    def _too_large(self, entry: ModelEntry, size: int, when: str) -> InvalidRequestError:
        need, limit = budget.format_bytes(size), budget.format_bytes(self.residency.budget)
        reason = (f"larger than the memory budget: its weights take {need} ({size} bytes) "
                  f"{when}, the whole budget is {limit} ({self.residency.budget} bytes)")
        self._failed[entry.id] = reason
        return InvalidRequestError(
            f"The model '{entry.id}' is {reason}. Raise [models] memory_budget_bytes or "
            "use a smaller (more quantized) model.",
            code="model_too_large",
            param="model",
        )

    async def _load_within_budget(
        self, entry: ModelEntry, deadline: float, evict: bool
    ) -> LoadedModel:
        residency = self.residency
        try:
            size = await asyncio.to_thread(budget.size_before_loading, entry)
        except Exception:  # unreadable: the load itself will say what is wrong
            size = None
        if size is not None and size > residency.budget:
            raise self._too_large(entry, size, "on disk")
        await residency.make_room(entry.id, size or 0, deadline, evict=evict)
        started = time.perf_counter()
        try:
            loaded = await asyncio.to_thread(load_sync, entry, self._config)
        except Exception as exc:
            residency.unreserve(entry.id)
            reason = kinds.describe_load_failure(entry, exc)
            self._failed[entry.id] = reason
            self.counts.failures[entry.id] += 1
            log.error("model load failed: %s", reason)
            raise ServerError(
                f"The model '{entry.id}' could not be loaded: {reason}",
                code="model_load_failed",
                param="model",
            ) from None
        except BaseException:  # cancelled (the server is stopping)
            residency.unreserve(entry.id)
            raise
        if loaded.weights_bytes > residency.budget:  # its size was not known before
            residency.unreserve(entry.id)
            await asyncio.to_thread(residency.free, loaded)
            raise self._too_large(entry, loaded.weights_bytes, "in memory")
        self._failed.pop(entry.id, None)
        self._kinds.pop(entry.id, None)
        self._ever_loaded.add(entry.id)
        self.counts.loaded(entry.id, time.perf_counter() - started)
        log.info("model loaded: %s (%s)", entry.id, budget.format_bytes(loaded.memory_bytes))
        residency.admit(loaded, self._config.models.keep_alive_of(entry))
        return loaded

    async def lease(
        self,
        entry: ModelEntry,
        kind: str = CHAT,
        *,
        deadline: float | None = None,
        keep_alive: float | None = None,
    ) -> Lease:
        """A hold on the loaded model, if it serves ``kind`` (else 400
        ``invalid_model_kind``), loading it first if need be; release it when the request
        is over. Past ``deadline`` (default: ``request_timeout`` from now) a model still
        loading is 503 ``busy``, and one that found no room 503 ``model_unavailable``,
        both with ``Retry-After``. ``keep_alive``: the request's own (seconds).

        A model of the wrong kind is refused before loading when its folder already says
        what it is.
        """
        if deadline is None:
            deadline = time.monotonic() + self._config.server.request_timeout
        if keep_alive is None:
            keep_alive = self._config.models.keep_alive_of(entry)
        residency = self.residency
        if entry.id in self._withdrawn:
            raise ServiceUnavailableError(
                f"The model '{entry.id}' is unavailable: {self._withdrawn[entry.id]}. The "
                "server is restarting; retry shortly.",
                code="model_unavailable", param="model",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        residency.waiting[entry.id] += 1
        try:
            while True:
                loaded = self._loaded.get(entry.id)
                if loaded is not None:
                    # (again: a download may have told more than the folder did)
                    self.check_kind(entry, kind, loaded.kind)
                    return residency.hold(loaded, keep_alive)
                self.check_kind(entry, kind)
                if entry.id in self._failed and entry.id not in self._loading:
                    # Try again: a failure may have been transient (disk, memory, network).
                    log.info("retrying model load after failure: %s",
                             self._failed.pop(entry.id))
                task = self.begin_load(entry, deadline)
                try:
                    await asyncio.wait_for(asyncio.shield(task),
                                           max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise (residency.room_error(entry.id) or self._still_loading(entry)) from None
                except ServiceUnavailableError:
                    # That load gave up waiting for room at its own deadline; ours may be
                    # later (it was started by another request).
                    if time.monotonic() >= deadline:
                        raise
        finally:
            residency.waiting[entry.id] -= 1
            if not residency.waiting[entry.id]:
                del residency.waiting[entry.id]
            residency.settle(entry.id)

    def _still_loading(self, entry: ModelEntry) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            f"The model '{entry.id}' is loading; retry shortly.",
            code="busy",
            headers={"Retry-After": "2"},
        )

    async def get(
        self, entry: ModelEntry, kind: str = CHAT, *, deadline: float | None = None
    ) -> LoadedModel:
        """The loaded model, as :meth:`lease` gets it, held for no request (its
        keep-alive starts at once)."""
        lease = await self.lease(entry, kind, deadline=deadline)
        lease.release()
        return lease.model

    def usage(self, model_id: str) -> Usage | None:
        """A loaded model's memory, requests and idle time (None: not loaded)."""
        return self.residency.usage(model_id)

    def queued(self, model_id: str) -> int:
        """Requests waiting for the model to load."""
        return self.residency.waiting[model_id]

    async def preload(self) -> None:
        """Load the models marked ``preload`` (the default model unless configured),
        the default first; one that does not fit beside the others is left to load on
        demand."""
        models = self._config.models
        log.info("model memory budget: %s, at most %d models loaded",
                 budget.format_bytes(self.residency.budget), models.max_loaded)
        default = self._config.resolve_model(None)
        wanted = [e for e in models.model if models.preloads(e)]
        wanted.sort(key=lambda e: e is not default)
        for entry in wanted:
            try:
                await self.begin_load(entry, deadline=time.monotonic(), evict=False)
            except ServiceUnavailableError as exc:
                log.warning("not preloading %s: %s", entry.id, exc.message)
            except Exception:  # logged by the load; /health reports it
                pass

    def close(self) -> None:
        for loaded in self.residency.close():
            if loaded.worker is not None:
                loaded.worker.stop()
            if loaded.embedder is not None:
                loaded.embedder.stop()
        for task in self._loading.values():
            task.cancel()


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


__all__ = ["BUILTIN_DEMO_PATH", "LoadedModel", "ModelRegistry"]
