"""Which models exist, which are loaded, and the handle the pipeline uses for each.

A request for a model that is not loaded starts its load and waits for it within its
deadline (then 503 ``busy``: it is still loading). The registry is the one face the rest of
afmd sees, and owns which configured model a request names and which kind of model it is;
loads and their outcomes are :mod:`afmd.engine.models.loading`'s, which models stay loaded
within the memory budget :mod:`afmd.engine.models.residency`'s, and the handle itself
:mod:`afmd.engine.models.loaded_model`'s.

A request for a model of the wrong kind is refused before a load that may take minutes, so
a model not loaded yet has its kind read from its folder (once: reading it costs disk
I/O); once loaded the model's own word wins, since a download may tell more than the folder
did, and after an unload the folder is read again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time

from afmd.config.sections import Config
from afmd.config.tables import ModelEntry
from afmd.engine.apple import framework
from afmd.engine.models import kinds
from afmd.engine.models.kinds import CHAT, EMBEDDING
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.loading import LoadCounts, Loads, load_sync
from afmd.engine.models.residency import Lease, Residency, effective_budget, format_bytes
from afmd.errors import (
    InvalidRequestError,
    ModelKindError,
    NotFoundError,
    ServerError,
    ServiceUnavailableError,
)
from afmd.hub import cache as hubcache

log = logging.getLogger("afmd.engine")

#: Longest shutdown waits for the KV cache's queued disk writes.
SHUTDOWN_FLUSH_S = 10.0


def _load_sync(entry: ModelEntry, config: Config) -> LoadedModel:
    # Looked up in this module at each load, so that tests can stand in for the real one.
    return load_sync(entry, config)


class ModelRegistry:
    """Resolves names to configured models and loads them on demand, one load at a time
    per model, within the memory budget."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self.counts = LoadCounts()
        self.residency = Residency(
            effective_budget(config.models.memory_budget_bytes),
            config.models.max_loaded,
            on_unload=self.counts.unloaded,
            on_retire=self.counts.retire,
        )
        self._loaded = self.residency.loaded  # one dict: the residency adds and removes
        self._kinds: dict[str, str] = {}  # read from disk once per model until it loads
        self._repos: dict[str, ModelEntry] = {}  # downloaded models named by repo id
        #: The loads under way and how each model's last one ended (``is_loading``,
        #: ``was_loaded``, ``withdraw``); which models stay loaded is :attr:`residency`'s.
        self.loads = Loads(config, self.residency, self.counts, load=_load_sync,
                           on_loaded=self.forget_kind)

    @property
    def config(self) -> Config:
        return self._config

    # -- which configured model a request names, and its kind --
    def resolve(self, name: str | None) -> ModelEntry:
        entry = self._config.resolve_model(name)
        if entry is None and name is not None:
            # Ollama's clients name a model's default tag (``demo:latest``), and a hub
            # repo as Ollama names it (``hf.co/OWNER/NAME``); a model pulled into the
            # Hugging Face cache serves under its repo id without configuring it, or as
            # the configured model of that path, when there is one: its own id would have
            # loaded a second copy of the same files beside it.
            base = hubcache.plain_name(name)
            entry = self._config.resolve_model(base) if base != name else None
            entry = (entry or self._configured_path(base) or self._downloaded(base)
                     or self._any_case(base))
        if entry is None:
            raise NotFoundError(
                f"The model '{name}' does not exist. Available models: "
                + ", ".join(self.listed_ids())
                + ".",
                code="model_not_found",
                param="model",
            )
        return entry

    def _any_case(self, name: str) -> ModelEntry | None:
        """The configured model or alias ``name`` is in another case, when just one is.
        Ollama compares names case-insensitively and its clients lowercase what they are
        given (``qwen3-coder`` for a model listed as ``Qwen3-Coder``); two names that
        differ only in case leave it ambiguous, and neither is guessed."""
        folded = name.casefold()
        matches = [n for n in self.listed_ids() if n.casefold() == folded]
        return self._config.resolve_model(matches[0]) if len(matches) == 1 else None

    def _configured_path(self, repo: str) -> ModelEntry | None:
        """The first configured model whose path is this repo id."""
        if not hubcache.REPO_ID.match(repo):
            return None
        return next((e for e in self._config.models.model if e.path == repo), None)

    def sharing_files(self, repo: str) -> list[str]:
        """The ids of every model served from this repo's download: the configured ones of
        that path, and the repo id itself (a download served unconfigured)."""
        return [*(e.id for e in self._config.models.model if e.path == repo and e.id != repo),
                repo]

    def _downloaded(self, repo: str) -> ModelEntry | None:
        """The entry a complete download of ``repo`` serves under (one per repo, so that
        its loads and leases are one model's). Looked for on disk each time unless the
        model is loaded or loading: a download deleted since (``/api/delete``, ``afmd rm``)
        is no model any more, where a remembered entry had its load fetch the repo again."""
        if not hubcache.REPO_ID.match(repo):
            return None
        entry = self._repos.get(repo)
        if entry is not None and (entry.id in self._loaded or self.loads.is_loading(entry.id)):
            return entry
        if not hubcache.complete_snapshot(repo):
            return None
        return self._repos.setdefault(repo, ModelEntry(id=repo, path=repo))

    def downloads_in_use(self) -> list[ModelEntry]:
        """The downloads served under their repo id (not configured) that are loaded or
        loading now: models of the server's as much as the configured ones."""
        return [e for e in self._repos.values()
                if e.id in self._loaded or self.loads.is_loading(e.id)]

    def listed_ids(self) -> list[str]:
        return [*self._config.model_ids(), *self._config.models.aliases]

    def kind_of(self, entry: ModelEntry) -> str:
        """``chat`` or ``embedding``: the loaded model's, else what its folder says."""
        loaded = self._loaded.get(entry.id)
        if loaded is not None:
            return loaded.kind
        kind = self._kinds.get(entry.id)
        if kind is None:
            kind = self._kinds[entry.id] = kinds.declared_kind(entry)
        return kind

    def forget_kind(self, model_id: str) -> None:
        """A load has told the model's kind; after an unload its folder is read again."""
        self._kinds.pop(model_id, None)

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
        serves = "embeddings" if actual == EMBEDDING else "chat and completions"
        wanted = "embeddings" if kind == EMBEDDING else "chat or completions"
        raise ModelKindError(
            f"The model '{entry.id}' is {_article(actual)} {actual} model: it serves "
            f"{serves}, not {wanted}. Use {_article(kind)} {kind} model.",
            model=entry.id, wanted=kind,
        )

    # -- loads and residency --

    def status(self) -> dict[str, str]:
        status = self.loads.status()
        for entry in self._config.models.model:
            found = self.availability(entry)
            if found is not None:
                status[entry.id] = found.status
        return status

    def availability(self, entry: ModelEntry) -> framework.Availability | None:
        """Apple's model's availability, asked of the framework now (None: another kind of
        model, available as its loads say)."""
        return framework.availability() if framework.is_system(entry) else None

    def unavailable_reason(self, model_id: str) -> str | None:
        """Why Apple's model cannot answer now (``device_not_eligible``, …); None for any
        other model, or while it can."""
        entry = self._config.resolve_model(model_id)
        found = self.availability(entry) if entry is not None else None
        return found.reason if found is not None else None

    def loaded(self, model_id: str) -> LoadedModel | None:
        return self._loaded.get(model_id)

    def is_ready(self, model_id: str) -> bool:
        return model_id in self._loaded

    def failure(self, model_id: str) -> str | None:
        entry = self._config.resolve_model(model_id)
        if entry is not None and framework.is_system(entry):
            # The framework's answer now, not how an earlier load ended: it may be ready now.
            return self.unavailable_reason(model_id)
        return self.loads.failure(model_id)

    def begin_load(
        self, entry: ModelEntry, deadline: float | None = None, *, evict: bool = True
    ) -> asyncio.Task[LoadedModel]:
        """The model's load, started unless under way; it waits for room in the budget
        until ``deadline`` (default: ``request_timeout`` from now), unloading idle models
        for it unless ``evict`` is false. Apple's model where it cannot answer is 503
        ``model_unavailable`` at once: there is nothing to load."""
        found = self.availability(entry)
        if found is not None and found.reason is not None:
            raise framework.unavailable_error(entry.id, found)
        return self.loads.begin(entry, deadline, evict=evict)

    async def unload(self, model_id: str, reason: str = "unloaded on request") -> bool:
        """Unload an idle model now (the dashboard's unload); False: it was not loaded.
        Raises 409 ``model_busy`` while requests hold or wait for it."""
        task = self.residency.unload(model_id, reason)
        if task is None:
            return False
        await self.residency.freed(task)
        return True

    async def unload_when_idle(self, entry: ModelEntry) -> None:
        """What a request that only unloads does (Ollama's bodies with ``keep_alive`` 0
        and nothing to generate, ``ollama stop``): the model unloads once idle. A model
        still loading for other requests is waited for, as Ollama does, and unloaded once
        they are done with it: they came first, so they get it first, and this request's
        0 is the last word. Before, the unload was answered at once and the model, loaded
        a moment later, stayed for its keep-alive. This request is not one the load is
        for (one nobody else waits for any more is dropped), it never loads the model
        itself, and a load that fails leaves nothing to unload: answered as done."""
        if entry.id not in self._loaded and self.loads.is_loading(entry.id):
            deadline = time.monotonic() + self._config.server.request_timeout
            # (Joins the load: starts none. One that fails, or finds the model too large,
            # leaves nothing loaded.)
            with contextlib.suppress(ServerError, InvalidRequestError):
                await self.loads.wait(entry, deadline)
        loaded = self._loaded.get(entry.id)
        if loaded is not None:
            self.residency.hold(loaded, 0.0).release()

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
        arrived = time.monotonic()
        if deadline is None:
            deadline = arrived + self._config.server.request_timeout
        if keep_alive is None:
            keep_alive = self._config.models.keep_alive_of(entry)
        residency = self.residency
        self.loads.refuse_withdrawn(entry)
        found = self.availability(entry)
        if found is not None and found.reason is not None:
            # Its kind does not wait on the framework: a request it could never serve is
            # told so, not told to retry.
            self.check_kind(entry, kind)
            raise framework.unavailable_error(entry.id, found)
        residency.waiting[entry.id] += 1
        try:
            while True:
                loaded = self._loaded.get(entry.id)
                # (again once loaded: a download may have told more than the folder did)
                self.check_kind(entry, kind, loaded.kind if loaded is not None else None)
                if residency.held_for(entry.id, arrived) is not None:
                    # A load asked for before this request waits for this model's room:
                    # this request comes after it (once that load has its room, or gave
                    # up), waiting as queued, not busy, so the model can go idle. Taking
                    # it now kept a model in steady use loaded for good, and the other
                    # load waiting until its requests' deadline (503); loading it again
                    # once it was unloaded for that load took the room back before the
                    # load could use it, a load and an unload for nothing.
                    residency.waiting[entry.id] -= 1
                    residency.settle(entry.id)
                    try:
                        await residency.wait_turn(entry.id, arrived, deadline)
                    finally:
                        residency.waiting[entry.id] += 1
                    continue
                if loaded is not None:
                    return residency.hold(loaded, keep_alive)
                await self.loads.wait(entry, deadline)
        finally:
            residency.waiting[entry.id] -= 1
            if not residency.waiting[entry.id]:
                del residency.waiting[entry.id]
                if entry.id not in self._loaded:
                    self.loads.abandon(entry.id)  # the last waiter left before the load
            residency.settle(entry.id)

    async def get(
        self, entry: ModelEntry, kind: str = CHAT, *, deadline: float | None = None
    ) -> LoadedModel:
        """The loaded model, as :meth:`lease` gets it, held for no request (its
        keep-alive starts at once)."""
        lease = await self.lease(entry, kind, deadline=deadline)
        lease.release()
        return lease.model

    async def preload(self) -> None:
        """Load the models marked ``preload`` (the default model unless configured),
        the default first; one that does not fit beside the others is left to load on
        demand."""
        models = self._config.models
        log.info("model memory budget: %s, at most %d models loaded",
                 format_bytes(self.residency.budget), models.max_loaded)
        default = self._config.resolve_model(None)
        wanted = [e for e in models.model if models.preloads(e)]
        wanted.sort(key=lambda e: e is not default)
        for entry in wanted:
            found = self.availability(entry)
            if found is not None and found.reason is not None:
                log.info("not preloading %s: %s (%s)", entry.id, found.reason, found.detail)
                continue
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
        self.loads.close()
        # The generation threads have stopped: what they queued for the disk tier is
        # written before the process exits, bounded like the threads' own stop. Only where
        # a model brought the KV cache in: a process that never imported it has no store
        # to flush, and importing it here (mlx-lm, and with it transformers) raced a first
        # load still importing them on its own thread, whose half-initialised transformers
        # failed this import and the shutdown with it (exit 1 on a SIGTERM during a load).
        # A module still being imported has not defined the function yet: no store either.
        disk = sys.modules.get("afmd.engine.kvcache.disk")
        flush_every_store = getattr(disk, "flush_every_store", None)
        if flush_every_store is not None and not flush_every_store(SHUTDOWN_FLUSH_S):
            log.warning("KV cache: not every block reached the disk before shutdown")


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"



__all__ = ["ModelRegistry"]
