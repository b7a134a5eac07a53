"""A model's load: reading its weights, tokenizer and worker thread into memory, and the
task every request for the model shares while that runs.

The load itself (:func:`load_sync`) blocks for seconds to minutes, so it runs off the event
loop; its heavy imports wait inside the function, so importing this module costs nothing.
It may fail (a Hugging Face id with no network), so each model's load runs as one task
that every request for the model shares (:class:`Loads`), one at a time per model, and its
outcome is kept per model so that ``/health`` can report it truthfully and the next request
can retry a failure that may have been transient. Room in the budget is
:mod:`afmd.engine.models.residency`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from afmd.config.sections import BUILTIN_SYSTEM_PATH, Config
from afmd.config.tables import ModelEntry
from afmd.engine.apple import framework
from afmd.engine.first_import import transformers_ready
from afmd.engine.models import kinds, precheck
from afmd.engine.models.kinds import BUILTIN_PREFIX, CHAT
from afmd.engine.models.loaded_model import DEFAULT_CONTEXT_LENGTH, LoadedModel, context_length_from
from afmd.engine.models.residency import RETRY_AFTER_S, Residency, format_bytes, size_before_loading
from afmd.engine.worker_threads import WorkerThread
from afmd.errors import APIError, InvalidRequestError, ServerError, ServiceUnavailableError

if TYPE_CHECKING:
    from afmd.engine.vision.vision_model import VisionSupport
    from afmd.engine.vision.vision_thread import VisionWorker

log = logging.getLogger("afmd.engine")

T = TypeVar("T")


def load_sync(entry: ModelEntry, config: Config) -> LoadedModel:
    """The model in memory with its worker started; blocking, so the registry runs it in
    a thread."""
    if entry.path == BUILTIN_SYSTEM_PATH:  # Apple's model: no weights, no MLX
        return _load_system(entry, config)
    # Fail before the heavy imports: mlx-lm drags in transformers (~45 MB resident, a second
    # or two), which a server whose model folder is missing would otherwise carry forever.
    problem = kinds.local_path_problem(entry.path)
    if problem is not None:
        raise OSError(problem)

    # Heavy imports stay here so `afmd --help`, `check-config` and a server that has not
    # loaded a model yet start fast and small; PyInstaller still sees them statically.
    transformers_ready()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from afmd.engine.batch import backend
    from afmd.engine.batch.cpu_layout import relayout_for_cpu
    from afmd.engine.batch.generation_thread import BatchWorker
    from afmd.engine.demo import builtin as demo
    from afmd.engine.embedding_thread import Embedder
    from afmd.engine.kvcache import folder as kv_folder
    from afmd.engine.kvcache.identity import model_identity
    from afmd.engine.mlx_compat import model_path
    from afmd.engine.models.kept_tokenizers import tokenizer_for
    from afmd.engine.models.memory import apply_memory_bounds
    from afmd.engine.sharded import lockstep
    from afmd.engine.sharded.sharding import load_shard
    from afmd.engine.speculative.draft import load_draft

    _freeze_imports()
    path = backend.current()  # an AFMD_BACKEND_LAYOUT that is not a choice fails the load
    backend.prepare_mlx()
    apply_memory_bounds(config.cache.mlx_buffer_cache_bytes)

    is_demo = entry.path.startswith(BUILTIN_PREFIX)
    folder: Path | None
    worker: BatchWorker | VisionWorker | None = None
    embedder: Embedder | None = None
    vision: VisionSupport | None = None
    shard = None
    kind = CHAT
    # A repo not on disk is pulled here, so that its folder can say what it is.
    source = (str(demo.materialize(entry.path[len(BUILTIN_PREFIX):])) if is_demo
              else kinds.load_source(entry.path))
    if kinds.is_vision(entry, kinds.model_folder(entry.path)):
        folder, model, tokenizer, context_length, worker, vision = _load_vision(
            entry, config, source
        )
    else:
        folder = Path(source) if os.path.exists(source) else None
        group = lockstep.current()
        if group is not None and entry == config.resolve_model(None):
            # A launched group's model: this rank's share of it, in step with the others.
            model, tokenizer, model_config, shard = load_shard(
                folder or Path(source), group, config.distributed.strategy
            )
        else:
            group = None
            # mlx_lm.load's steps, with the tokenizer of an earlier load of the same files
            # where there was one (loading it again stalls every other thread).
            loaded_from = model_path(source)
            model, model_config = load_model(loaded_from)
            tokenizer = tokenizer_for(loaded_from, model_config.get("eos_token_id"))
        _check_tokenizer(tokenizer, source)
        # A repo's files are on disk now: its folder can say what kind of model it is.
        kind, spec = kinds.resolve(entry, folder or kinds.model_folder(entry.path), model_config)
        if shard is not None and kind != CHAT:
            raise ValueError("only a chat model can be sharded over a launched group")
        if kind == CHAT and shard is None:
            relayout_for_cpu(model)  # an embedding model never runs its output projection
        # Loading and re-laying out weights freed buffers a serving process never reuses.
        mx.clear_cache()
        context_length = (
            entry.context_length or context_length_from(model_config) or DEFAULT_CONTEXT_LENGTH
        )
        if spec is not None:
            embedder = Embedder(model, spec, name=entry.id)
            embedder.start()
        else:
            worker = BatchWorker(
                model,
                tokenizer,
                name=entry.id,
                max_batch=config.queue.max_concurrent_requests,
                prompt_cache_bytes=config.cache.prompt_cache_bytes,
                prompt_cache_entries=config.cache.prompt_cache_entries,
                identity=model_identity(folder or kinds.model_folder(entry.path), entry.id),
                block_tokens=config.cache.block_tokens,
                # A sharded model's ranks keep RAM tiers in step; a disk tier each would not
                # stay so (what one rank's writer dropped, another's wrote): off for them.
                disk_dir=None if shard else kv_folder.resolve(config.cache.disk_dir),
                disk_bytes=config.cache.disk_bytes,
                disk_min_free=config.cache.disk_min_free,
                prompt_lookup=config.engine.prompt_lookup,
                draft_model=None if shard else load_draft(entry, config, tokenizer),
                lockstep=group,
            )
            worker.start()
            worker.ready()  # the GPU path's warm-up is part of loading
            log.info("model %s serves on the %s", entry.id, path.describe())
    return LoadedModel(
        entry=entry,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        context_length=context_length,
        worker=worker,
        is_demo=is_demo,
        weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())),  # type: ignore[str-unpack, union-attr]  # mlx types tree_flatten list-or-dict alike
        kind=kind,
        embedder=embedder,
        shard=shard,
        vision=vision,
    )


_frozen = False


def _freeze_imports() -> None:
    """Take what the heavy imports made (hundreds of thousands of objects: modules,
    functions, classes that live as long as the process) out of the garbage collector's
    view, once. The collector runs holding the GIL, and a full collection walks every
    tracked object: unloading a model collects (its modules hold cycles), and the
    allocations of a load set off collections of their own, each of which stalled the
    event loop for as long as the walk took. What is frozen is never collected (a cycle
    among frozen objects stays for good, even once unreachable), so this happens before
    the first model's objects exist, after a collection of what is garbage already."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()


def _load_system(entry: ModelEntry, config: Config) -> LoadedModel:
    """Apple's model as a loaded model: nothing is loaded, its generations get threads."""
    from afmd.engine.apple.worker import SystemWorker

    found = framework.availability()
    if found.reason is not None:
        raise RuntimeError(f"{found.reason}: {found.detail}")
    return LoadedModel(
        entry=entry, folder=None, model=None, tokenizer=None,
        context_length=entry.context_length or framework.context_length(),
        worker=SystemWorker(entry.id, debounce=config.system.tool_call_debounce),
        kind=CHAT, reads_conversation=True,
    )


def _load_vision(
    entry: ModelEntry, config: Config, source: str
) -> tuple[Path, Any, Any, int, VisionWorker, VisionSupport]:
    """Load a vision model with mlx-vlm and start its generation thread: its folder, model,
    tokenizer, context length, worker and prompt side."""
    transformers_ready()
    try:
        from mlx_vlm.utils import get_model_path
    except ImportError:
        raise RuntimeError(
            "this is a vision model, and vision support is not installed: "
            "pip install 'afmd[vision]'"
        ) from None
    import mlx.core as mx

    from afmd.engine.mlx_compat import vlm_model
    from afmd.engine.models.kept_tokenizers import processor_for, tokenizer_for
    from afmd.engine.vision.vision_model import VisionSupport
    from afmd.engine.vision.vision_thread import VisionWorker

    folder = Path(get_model_path(source))
    # mlx_vlm.load's steps, with the processor and tokenizer of an earlier load of the same
    # files where there was one (building them again stalls every other thread).
    model = vlm_model(folder)
    eos = getattr(model.config, "eos_token_id", None)
    processor = processor_for(folder, eos)
    tokenizer = tokenizer_for(folder, [eos] if isinstance(eos, int) else eos)
    _check_tokenizer(tokenizer, source)
    mx.clear_cache()
    raw = _config_json(folder)
    context_length = (
        entry.context_length or context_length_from(raw) or DEFAULT_CONTEXT_LENGTH
    )
    worker = VisionWorker(model, tokenizer, name=entry.id)
    worker.start()
    vision = VisionSupport(model, processor, tokenizer, config.models.max_image_pixels)
    return folder, model, tokenizer, context_length, worker, vision


def _check_tokenizer(tokenizer: Any, source: str) -> None:
    """Fail the load of a model whose tokenizer turns text into no tokens. A folder with no
    tokenizer files loads all the same (transformers builds an empty tokenizer for the
    config's family), and then every request failed with a 400 blaming the client (its
    messages "could not be rendered", its prompt "is empty") while ``/health`` said
    loaded; a load failure names the folder instead, and the next request tries again."""
    try:
        ids = tokenizer.encode("Hello, world.", add_special_tokens=False)
    except Exception as exc:
        raise ValueError(f"its tokenizer cannot encode text: {exc}") from exc
    if not len(ids):
        raise ValueError(precheck.tokenizer_missing(source))


def _config_json(folder: Path) -> dict[str, Any]:
    """The folder's config.json (its text side may sit under ``text_config``)."""
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------- the loads under way


async def off_the_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a daemon thread, awaited. Not the loop's default executor:
    ``asyncio.run`` waits for every thread of that at exit, so a SIGTERM during a load
    waited for the whole load to finish (a large model's minute, past the time launchd
    gives a service to stop before it kills it). The load cannot be stopped, and nothing
    of it needs to finish: the process exits without it. A cancelled wait leaves the
    thread to end on its own. The thread is one of the workers' reused ones
    (:mod:`afmd.engine.worker_threads`): a load computes with MLX, and a new thread each
    time would leave its MLX streams behind."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return  # cancelled meanwhile
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]  # fn returned it

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting task, as to_thread does
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
            loop.call_soon_threadsafe(settle, result, error)
        del result, error

    WorkerThread(run, f"afmd-load-{getattr(fn, '__name__', 'fn')}").start()
    return await future


@dataclass(slots=True)
class LoadCounts:
    """Per model id since the server started: completed loads, failed ones, refusals of a
    model larger than the whole budget, unloads and seconds spent in completed loads
    (``/metrics`` reads them; they outlive an unload)."""

    loads: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    too_large: Counter[str] = field(default_factory=Counter)
    unloads: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=dict)
    #: Per (model id, tier): the block KV cache's counters (``hits``, ``misses``,
    #: ``evictions``) of the model's earlier loads. Each load's cache counts from 0, and a
    #: counter that went back to 0 with a reload would read as a reset.
    kv: dict[tuple[str, str], Counter[str]] = field(default_factory=dict)

    def loaded(self, model_id: str, seconds: float) -> None:
        self.loads[model_id] += 1
        self.seconds[model_id] = self.seconds.get(model_id, 0.0) + seconds

    def unloaded(self, model_id: str) -> None:
        self.unloads[model_id] += 1

    def retire(self, model: LoadedModel) -> None:
        """Keep what an unloading model's KV cache counted, before its cache goes."""
        cache = model.kv_cache
        if cache is None:
            return
        for tier, numbers in cache.stats().items():
            kept = self.kv.setdefault((model.id, tier), Counter())
            kept["hits"] += numbers["hits"]
            kept["misses"] += numbers["misses"]
            if tier == "disk":  # the folder's own count, which outlives the model: its last
                kept["evictions"] = max(kept["evictions"], numbers["evictions"])
            else:
                kept["evictions"] += numbers["evictions"]

    def kv_counts(self, model_id: str, live: dict[str, dict[str, int]] | None
                  ) -> dict[str, dict[str, int]]:
        """Per tier, the KV cache's counters since the server started: the earlier loads'
        and (``live``) the loaded model's own."""
        tiers = {tier: dict(kept) for (model, tier), kept in self.kv.items()
                 if model == model_id}
        for tier, numbers in (live or {}).items():
            kept = tiers.setdefault(tier, {})
            for name in ("hits", "misses", "evictions"):
                if tier == "disk" and name == "evictions":
                    kept[name] = max(kept.get(name, 0), numbers[name])
                else:
                    kept[name] = kept.get(name, 0) + numbers[name]
        return tiers


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
        # Loads started for requests only, not yet past finding room (its size read,
        # waiting for a busy model to go idle): dropped when the last of them leaves.
        self._for_requests: set[str] = set()
        self._finding_room: set[str] = set()
        self._failed: dict[str, str] = {}
        # Models that must not serve again in this process (a launched group lost a rank).
        self._withdrawn: dict[str, str] = {}
        self._ever_loaded: set[str] = set()
        #: Set once the server stops: what a request that would start a load is told.
        self._stopped: APIError | None = None

    # -- what /health reports --
    def status(self) -> dict[str, str]:
        """Per model: ``available``, or ``unavailable: <reason>``."""
        result: dict[str, str] = {}
        for entry in self._config.models.model:
            if entry.id in self._withdrawn:
                result[entry.id] = f"unavailable: {self._withdrawn[entry.id]}"
            elif entry.id in self._residency.loaded:
                result[entry.id] = "available"
            elif entry.id in self._loading:
                # A load started again after a failure is what is going on now.
                result[entry.id] = "unavailable: loading"
            elif entry.id in self._failed:
                result[entry.id] = f"unavailable: {self._failed[entry.id]}"
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
    def stop(self, error: APIError) -> None:
        """The server is stopping: no load starts from now on (a request that would start
        one is told ``error``), and those still waiting for room are dropped; a load under
        way finishes. Turns waiting for their model are cancelled by the pipeline, but
        counting tokens and Ollama's load bodies wait without a turn: once the shutdown
        had cut the busy model's stream, their model was loaded in the server's last
        moment, and a load outlasting it left their connections closed unanswered."""
        self._stopped = error
        for model_id, task in list(self._loading.items()):
            if model_id in self._finding_room:
                task.cancel()

    def begin(
        self, entry: ModelEntry, deadline: float | None = None, *, evict: bool = True,
        for_request: bool = False,
    ) -> asyncio.Task[LoadedModel]:
        """The model's load, started unless under way (see ``ModelRegistry.begin_load``);
        ``for_request``: a request waits for it (else it is wanted for itself: a preload,
        the dashboard's load)."""
        task = self._loading.get(entry.id)
        if task is None:
            if self._stopped is not None:
                raise self._stopped
            if deadline is None:
                deadline = time.monotonic() + self._config.server.request_timeout
            self._finding_room.add(entry.id)
            if for_request:
                self._for_requests.add(entry.id)
            asked = time.monotonic()
            if evict and not framework.is_system(entry):
                self._residency.expect(entry.id, asked)
            task = asyncio.get_running_loop().create_task(
                self._load(entry, deadline, evict, asked))
            task.add_done_callback(functools.partial(self._never_ran, entry.id))
            self._loading[entry.id] = task
        elif not for_request:
            self._for_requests.discard(entry.id)
        return task

    def abandon(self, model_id: str) -> None:
        """No request waits for ``model_id`` any more (cancelled, gone): a load started
        for them that has not found room yet is dropped, or it would unload a model in use
        for one nobody asks for once the busy one went idle. A load under way finishes (the
        next request for the model finds it loaded)."""
        task = self._loading.get(model_id)
        if task is not None and model_id in self._for_requests \
                and model_id in self._finding_room:
            task.cancel()

    async def wait(self, entry: ModelEntry, deadline: float) -> None:
        """Until the model's load ends, starting it if need be (again after a failure:
        it may have been transient); past ``deadline`` 503 ``busy`` while it loads, or
        ``model_unavailable`` while it waits for room."""
        if entry.id in self._failed and entry.id not in self._loading:
            log.info("retrying model load after failure: %s", self._failed.pop(entry.id))
        task = self.begin(entry, deadline, for_request=True)
        try:
            await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise (self._residency.room_error(entry.id) or _still_loading(entry)) from None
        except ServiceUnavailableError:
            # That load gave up waiting for room at its own deadline; ours may be later
            # (it was started by another request): the caller waits again.
            if time.monotonic() >= deadline:
                raise
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not task.cancelled() or (current is not None and current.cancelling()):
                raise
            # That load was dropped (its last waiter left) just as this request came:
            # the caller waits again, for a load of its own.

    async def _load(
        self, entry: ModelEntry, deadline: float, evict: bool, asked: float
    ) -> LoadedModel:
        try:
            return await self._load_within_budget(entry, deadline, evict, asked)
        finally:
            self._ended(entry.id)

    def _ended(self, model_id: str) -> None:
        self._residency.drop_claim(model_id)
        self._loading.pop(model_id, None)
        self._for_requests.discard(model_id)
        self._finding_room.discard(model_id)

    def _never_ran(self, model_id: str, task: asyncio.Task[LoadedModel]) -> None:
        """A load dropped in the turn it began (its last waiter left at once) is
        cancelled before its coroutine runs a line, ``finally`` included: it stayed
        under way for good, ``/health`` said loading, and every later request for the
        model found the dead load, went round waiting for it again, and spun."""
        if self._loading.get(model_id) is task:
            self._ended(model_id)

    async def _load_within_budget(
        self, entry: ModelEntry, deadline: float, evict: bool, asked: float
    ) -> LoadedModel:
        residency = self._residency
        try:
            try:
                # What the folder tells of a load that cannot succeed fails it here, before
                # making room unloads the models that serve for one that never would.
                await off_the_loop(precheck.check, entry)
            except Exception as exc:
                raise self._load_failed(entry, exc) from None
            try:
                size = await off_the_loop(size_before_loading, entry)
            except Exception:  # unreadable: the load itself will say what is wrong
                size = None
            if size is not None and size > residency.budget:
                raise self._too_large(entry, size, "on disk")
            if not framework.is_system(entry):  # Apple's model takes none of afmd's memory
                # (Requests for the busy models it waits for that come after ``asked``,
                # when the first request for it came, wait behind it.)
                await residency.make_room(entry.id, size or 0, deadline, evict=evict,
                                          since=asked)
        finally:
            # From here (in this step: no cancel can land between) the load is under way:
            # a thread loads the weights, which no cancel could stop.
            self._finding_room.discard(entry.id)
        started = time.perf_counter()
        try:
            loaded = await off_the_loop(self._load_sync, entry, self._config)
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
        self._counts.too_large[entry.id] += 1
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


__all__ = ["LoadCounts", "Loads", "load_sync"]
